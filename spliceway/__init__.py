"""spliceway: a proxy engine with a C splice relay, actors, and a durable event pipeline.

Map of the package:
- ``engine``      the public ``Engine`` facade for embedding (README, "Embedding")
- ``engine_core`` the running engine's parts and their start/stop order
- ``config``      the configuration schema (pydantic), validation with field paths
- ``routing``     pure rule matching and route decisions
- ``commands``    the one command table; ``queries`` the one query table
- ``events``      the event ring with sequences and live subscriptions
- ``records``     FlowRecords and flow event payloads
- ``inbound``     server side of socks5/http/mixed handshakes
- ``outbounds``   direct, block, socks5 and http dialers
- ``protocols``   pure parsers: SOCKS5, HTTP heads, TLS SNI / HTTP Host sniffing
- ``relay``       the only module that imports the C relay (``spliceway._relay``)
- ``actors``      Pykka actors: supervisor, listener, flow, stats sampler
- ``cli``         the ``spliceway`` command
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from spliceway.engine import Engine
    from spliceway.errors import ApiError

__all__ = ["ApiError", "Engine", "__version__"]


def __getattr__(name: str) -> object:
    # Engine pulls in the actors and the compiled relay; import it only when asked,
    # so `spliceway validate` and the pure modules work without them. ApiError too:
    # the `spliceway` command's first module (_console) must come before any import
    # that takes time, so a Ctrl-C then ends it quietly.
    if name == "Engine":
        from spliceway.engine import Engine

        return Engine
    if name == "ApiError":
        from spliceway.errors import ApiError

        return ApiError
    raise AttributeError(name)
