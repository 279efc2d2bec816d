"""The composition root: wires the engine's core, its actors and its transports (HTTP,
IPC, gRPC), and the public :class:`~spliceway.app.engine.Engine` built on it.

- ``compose``     builds the core and the actors, sinks and TUN it starts, each with its ports
- ``engine``      ``Engine``, the engine as a library inside a threaded host application
- ``transports``  the control transports (HTTP, IPC, gRPC) over the engine's core
"""
