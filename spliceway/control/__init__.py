"""The control plane's one definition of what can be asked of a running engine.

- ``commands``      the command table: permission, parameters, handler
- ``queries``       the query table: every read-only resource by name
- ``capabilities``  what this build can do
- ``diagnostics``   diagnostics that dial (probe_target, probe_outbound)
- ``messages``      what a command sends to the engine's actors (close, select, probe)
"""
