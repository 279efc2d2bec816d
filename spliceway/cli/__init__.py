"""The ``spliceway`` command (docs/running.md).

- ``main``        the parser and the local subcommands (``run``, ``validate``, ...)
- ``remote``      the subcommands that talk to a running engine over IPC
- ``ipc_client``  a client of the IPC control socket (docs/ipc.md)
"""
