"""``GET /api/v1/config`` lists the rules in force and ``route.final``: each rule's
``index`` and ``condition`` are what a flow it routes records as ``route.matched_rule``
(real HTTP, a real flow through the engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.api.conftest import control_config, get_result
from tests.conftest import wait_until
from tests.helpers.servers import EchoServer
from tests.helpers.socks import recv_exact, socks5_connect

TIMEOUT = 10.0


def get(base_url: str, path: str) -> dict[str, Any]:
    return get_result(base_url, path, TIMEOUT)


def test_config_lists_rules_as_flows_name_them(make_engine: Callable[..., Any]) -> None:
    with EchoServer() as echo:
        cfg = control_config()
        cfg["outbounds"] = [
            {"tag": "direct", "protocol": "direct"},
            {"tag": "direct-b", "protocol": "direct"},
        ]
        cfg["rules"] = [
            {"domain_suffix": ["ads.example", "track.example"], "action": "block"},
            {"port": [str(echo.port)], "network": "tcp", "outbound": "direct-b"},
        ]
        cfg["route"] = {"final": "direct"}
        engine = make_engine(cfg)
        config = get(engine.control_url, "/api/v1/config")
        assert config["rule_count"] == 2
        assert config["final"] == "direct"
        assert config["rules"] == [
            {
                "index": 0,
                "condition": "domain_suffix=ads.example|track.example",
                "action": "block",
                "outbound": None,
            },
            {
                "index": 1,
                "condition": f"port={echo.port},network=tcp",
                "action": "route",
                "outbound": "direct-b",
            },
        ]
        sock = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
        try:
            sock.sendall(b"ping")
            assert recv_exact(sock, 4) == b"ping"
            flows = wait_until(
                lambda: get(engine.control_url, "/api/v1/flows")["active_flows"],
                TIMEOUT,
                "the flow listed",
            )
            matched = flows[0]["route"]["matched_rule"]
            rule = config["rules"][matched["index"]]
            assert (rule["index"], rule["condition"]) == (matched["index"], matched["condition"])
            assert flows[0]["path"]["outbound"]["tag"] == rule["outbound"]
        finally:
            sock.close()
