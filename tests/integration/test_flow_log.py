"""Per-flow log lines from the real program: one line per flow, at info when it failed or
was blocked, at debug for every flow."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.helpers.flows import curl
from tests.helpers.program import environ_without, running, wait_for_line, write_config
from tests.helpers.udp import Association, UdpEcho
from tests.helpers.upstreams import refused_port

FLOW_LINE = re.compile(r" (INFO|DEBUG) spliceway\.flow: (flow=\S+ .*)$")


def run_three_flows(tmp_path, origin, log_level: str) -> list[tuple[str, dict[str, str]]]:
    """One relayed, one blocked and one failed flow through a real `spliceway run`;
    the flow lines it logged, parsed."""
    doc = {
        "inbounds": [{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}],
        "rules": [{"domain_suffix": ["blocked.test"], "action": "block"}],
        "runtime": {"log_level": log_level},
        "api": {"control": {"enabled": False}, "ipc": {"enabled": False}},
    }
    with running(write_config(tmp_path, doc)) as proc:
        proxy = wait_for_line(proc, r"listening on (127\.0\.0\.1:\d+)").group(1)
        ok = curl("--socks5-hostname", proxy, f"http://127.0.0.1:{origin[1]}/")
        assert ok.stdout == "hello from origin\n", ok.stderr
        blocked = curl("--socks5-hostname", proxy, "http://www.blocked.test/")
        assert blocked.returncode != 0
        failed = curl("--socks5-hostname", proxy, f"http://127.0.0.1:{refused_port()}/")
        assert failed.returncode != 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        stderr = proc.stderr.read()
    lines = []
    for text in stderr.splitlines():
        if match := FLOW_LINE.search(text):
            fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', match.group(2)))
            lines.append((match.group(1), fields))
    return lines


def by_outcome(lines):
    return {fields["outcome"]: (level, fields) for level, fields in lines}


def test_info_logs_exactly_the_failed_and_the_blocked_flow(tmp_path, origin) -> None:
    lines = run_three_flows(tmp_path, origin, "info")
    assert sorted(fields["outcome"] for _, fields in lines) == ["blocked", "failed"]
    outcomes = by_outcome(lines)
    level, failed = outcomes["failed"]
    assert level == "INFO"
    assert failed["inbound"] == "socks-in"
    assert failed["outbound"] == "direct"
    assert failed["target"].startswith("127.0.0.1:")
    assert failed["close_reason"] == "upstream_error"
    assert failed["stage"] == "connect"
    assert failed["code"] == "connection_refused"
    assert failed["error"].startswith('"')
    level, blocked = outcomes["blocked"]
    assert level == "INFO"
    assert blocked["target"] == "www.blocked.test:80"
    assert blocked["outbound"] == "-"
    assert blocked["rule"] == "0"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", blocked["source"])


@pytest.mark.parametrize("level", ["debug", "trace"])
def test_debug_logs_one_line_for_every_flow(tmp_path, origin, level) -> None:
    lines = run_three_flows(tmp_path, origin, level)
    assert sorted(fields["outcome"] for _, fields in lines) == [
        "blocked",
        "direct_relayed",
        "failed",
    ]
    level_of = {fields["outcome"]: lvl for lvl, fields in lines}
    assert level_of == {"blocked": "INFO", "direct_relayed": "DEBUG", "failed": "INFO"}
    relayed = by_outcome(lines)["direct_relayed"][1]
    assert int(relayed["down"]) > len("hello from origin\n")
    assert int(relayed["up"]) > 0
    assert len({fields["flow"] for _, fields in lines}) == 3


def test_udp_flows_that_are_blocked_or_cannot_be_relayed_are_logged(tmp_path) -> None:
    """A SOCKS5 UDP datagram to a rule-blocked name and one routed to an http outbound
    (which relays no UDP) each make one INFO line, as a TCP flow would."""
    with UdpEcho() as echo:
        doc = {
            "inbounds": [{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}],
            "outbounds": [
                {"tag": "direct", "protocol": "direct"},
                {"tag": "web", "protocol": "http", "server": "127.0.0.1", "port": refused_port()},
            ],
            "rules": [
                {"domain_suffix": ["blocked.test"], "network": "udp", "action": "block"},
                {"port": [str(echo.port)], "network": "udp", "outbound": "web"},
            ],
            # The control API only tells the test when both flows completed.
            "api": {
                "control": {"listen": {"port": 0}, "api_key_env": None},
                "ipc": {"enabled": False},
            },
        }
        env = environ_without("SPLICEWAY_API_KEY")
        with running(write_config(tmp_path, doc), env) as proc:
            proxy = wait_for_line(proc, r"listening on 127\.0\.0\.1:(\d+)").group(1)
            base = wait_for_line(proc, r"control API listening on (http://\S+)/api/v1/").group(1)
            with Association(("127.0.0.1", int(proxy))) as assoc:
                assoc.send("dns.blocked.test", 53, b"blocked")
                assoc.send("127.0.0.1", echo.port, b"unsupported")
                wait_until(
                    lambda: len(events(base, "flow.completed")) == 2, what="2 flow.completed"
                )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
            stderr = proc.stderr.read()
        assert echo.received == 0
    lines = [m for text in stderr.splitlines() if (m := FLOW_LINE.search(text))]
    assert [m.group(1) for m in lines] == ["INFO", "INFO"], stderr
    parsed = [dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', m.group(2))) for m in lines]
    by_target = {fields["target"]: fields for fields in parsed}
    blocked = by_target["dns.blocked.test:53"]
    assert {k: blocked[k] for k in ("outcome", "network", "inbound", "outbound", "rule")} == {
        "outcome": "blocked",
        "network": "udp",
        "inbound": "socks-in",
        "outbound": "-",
        "rule": "0",
    }
    failed = by_target[f"127.0.0.1:{echo.port}"]
    assert {k: failed[k] for k in ("outcome", "network", "outbound", "stage", "code")} == {
        "outcome": "failed",
        "network": "udp",
        "outbound": "web",
        "stage": "route",
        "code": "udp_unsupported",
    }
    assert failed["error"] == "\"outbound 'web' (http) does not relay UDP in this build\""
    assert failed["close_reason"] == "upstream_error"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", failed["source"])


def events(base: str, types: str) -> list[dict[str, Any]]:
    """The ring's events of ``types``, over the engine's HTTP API."""
    url = f"{base}/api/v1/events?types={types}"
    with urllib.request.urlopen(url, timeout=10) as response:
        found: list[dict[str, Any]] = json.load(response)["result"]["events"]
    return found
