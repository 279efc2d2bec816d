"""Per-flow log lines from the real program: one line per flow, at info when it failed or
was blocked, at debug for every flow."""

from __future__ import annotations

import re
import signal

import pytest

from tests.helpers.flows import curl
from tests.helpers.program import running, wait_for_line, write_config
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
