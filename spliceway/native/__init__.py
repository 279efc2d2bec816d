"""The Python faces of the C data plane (``spliceway._relay``), one per C module.

- ``relay``  ``csrc/relay.c``: the splice relay
- ``conn``   ``csrc/conn.c`` and ``csrc/parse.c``: the C connection path
- ``route``  ``csrc/route.c``: the compiled route table and its Python mirror
- ``udp``    ``csrc/udp.c``: the UDP datagram relay
- ``tun``    ``csrc/tun.c`` and ``csrc/pkt.c``: the TUN packet stack
"""
