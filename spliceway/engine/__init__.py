"""The running engine's state and its lifecycle: built from a configuration, replaced
whole on reload.

- ``core``           ``EngineCore``: the running engine's parts and their start/stop order
- ``assembly``       the routing parts built from a configuration
- ``reconcile``      config.apply / apply_runtime / SIGHUP: a new configuration, live
- ``route_publish``  keeps the C connection path's route table in step
- ``runtime``        state shared between the actors and the query surface
"""
