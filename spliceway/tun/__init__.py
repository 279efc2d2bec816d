"""The TUN inbound: the device, routing the host into it, and the packet loop.

Modules (each has its own owner; see their docstrings):

- ``device``: creating the TUN device, its addresses, MTU and link state.
- ``routing``: ``auto_route``, ``strict_route`` and ``dns_hijack`` as a policy routing
  table and ``ip rule`` set, recorded so a crash leaves nothing behind.
- ``egress``: the physical egress interfaces and the network generation.
- ``controller``: start/stop/status of the host side, composed from the above.
- ``stack`` / ``packet``: the packet loop (system stack) over the device.
"""
