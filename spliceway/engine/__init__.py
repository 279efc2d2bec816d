"""The running engine's state and its lifecycle: built from a configuration, replaced
whole on reload.

- ``core``           ``EngineCore``: the running engine's state and its start/stop order
- ``tun_wiring``     the core's TUN wiring (a mixin): the TUN service's parts and teardown
- ``stats``          the core's live counters (a mixin): stats resource, traffic, UDP drops
- ``generation``     ``Generation``: what a reload replaces, frozen, published by one assignment
- ``components``     the ports through which the core starts actors, sinks and the TUN
- ``assembly``       the routing parts built from a configuration
- ``reconcile``      config.apply / apply_runtime / SIGHUP: a new configuration, live
- ``route_publish``  keeps the C connection path's route table in step
- ``runtime``        state shared between the actors and the query surface
"""
