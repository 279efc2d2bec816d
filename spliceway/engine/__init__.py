"""The running engine's state and its lifecycle: built from a configuration, replaced
whole on reload.

- ``core``           ``EngineCore``: the running engine's state and its start/stop order
- ``generation``     ``Generation``: what a reload replaces, frozen, published by one assignment
- ``components``     the ports through which the core starts actors, sinks and the TUN
- ``assembly``       the routing parts built from a configuration
- ``reconcile``      config.apply / apply_runtime / SIGHUP: a new configuration, live
- ``route_publish``  keeps the C connection path's route table in step
- ``runtime``        state shared between the actors and the query surface
"""
