"""The control plane's transports (installed as ``spliceway.api``): HTTP, IPC, gRPC."""
