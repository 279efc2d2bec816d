"""Python stubs of ``spliceway/v1/control.proto``, generated and checked in.

``control_pb2`` (messages), ``control_pb2_grpc`` (service) and ``control_pb2.pyi``
are written by ``python -m spliceway.api.grpc_gen`` (needs ``grpcio-tools``, the
``grpc-tools`` extra) from ``api/proto/spliceway/v1/control.proto``; never edit
them by hand. Importing them needs the ``grpc`` extra.
"""
