"""spliceway: a proxy engine with a C splice relay, actors, and a durable event pipeline.

Map of the package, one line per subpackage (each ``__init__`` names its modules):
- ``app``        the composition root and the public ``Engine`` for embedding (README, "Embedding")
- ``engine``     the running engine's state, built from a configuration and replaced whole
- ``config``     the configuration document: schema (pydantic), checks with field paths, loading
- ``routing``    rule matching, policy groups, canonical hosts, process lookup
- ``flows``      a flow from handshake to record: inbounds, outbounds, records, the flow hook
- ``control``    the one command table and the one query table, capabilities, diagnostics
- ``events``     the event ring with sequences, the event catalogue, recent log lines
- ``shapes``     the wire shapes (FlowRecord, event envelope, stats, counters), declared once
- ``native``     the Python faces of the C data plane (``spliceway._relay``), one per C module
- ``protocols``  pure parsers: SOCKS5, HTTP heads, TLS SNI / HTTP Host sniffing, Shadowsocks
- ``dns``        the resolver, fake-IP pool and DNS server; ``tun`` the TUN inbound
- ``actors``     Pykka actors: supervisor, listeners, flows, policy groups, stats, sinks
- ``api``        the transports: HTTP (Falcon on Waitress), IPC, gRPC; ``connector`` the sinks
- ``cli``        the ``spliceway`` command; ``tools`` developer tools (docgen)
- ``support``    operating-system helpers; ``errors`` the one error type and its codes
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from spliceway.app.engine import Engine
    from spliceway.errors import ApiError

__all__ = ["ApiError", "Engine", "__version__"]


def __getattr__(name: str) -> object:
    # Engine pulls in the actors and the compiled relay; import it only when asked,
    # so `spliceway validate` and the pure modules work without them. ApiError too:
    # the `spliceway` command's first module (_console) must come before any import
    # that takes time, so a Ctrl-C then ends it quietly.
    if name == "Engine":
        from spliceway.app.engine import Engine

        return Engine
    if name == "ApiError":
        from spliceway.errors import ApiError

        return ApiError
    raise AttributeError(name)
