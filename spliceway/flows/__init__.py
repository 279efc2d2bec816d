"""A flow from its handshake to its record.

- ``inbound``     server side of the socks5/http/mixed handshakes
- ``outbounds``   direct, block, socks5, http and shadowsocks dialers
- ``records``     FlowRecords and the flow event payloads
- ``machine``     a TCP flow's states and transitions, sans I/O (FlowActor drives it)
- ``hook``        the flow hook client (docs/flow-hook.md)
- ``log``         the one log line of a completed flow
- ``probe``       latency probes through an outbound
- ``histograms``  per-outbound duration and size histograms
"""
