"""Where a flow goes.

- ``rules``           pure rule matching and route decisions
- ``policy``          policy groups: selection, health, chains, snapshots
- ``hostnorm``        target hosts in canonical form
- ``process_lookup``  the local process behind a flow
"""
