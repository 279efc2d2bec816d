"""The ``spliceway`` program as a user runs it: run, signals, port conflicts, validate."""

from __future__ import annotations

import json
import signal
import socket
import subprocess

import pytest

from tests.helpers.flows import curl
from tests.helpers.program import SPLICEWAY, wait_for_line


def spliceway(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the program to completion (30 s at most), capturing its output as text."""
    return subprocess.run(
        [*SPLICEWAY, *args], capture_output=True, text=True, timeout=30, check=False
    )


def write_config(tmp_path, doc) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return str(path)


def socks_config(port: int = 0) -> dict:
    return {
        "inbounds": [
            {
                "tag": "socks-in",
                "protocol": "socks5",
                "listen": {"address": "127.0.0.1", "port": port},
            }
        ],
        "api": {"control": {"enabled": False}, "ipc": {"enabled": False}},
    }


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_run_serves_and_stops_cleanly_on_signal(tmp_path, origin, signum):
    config = write_config(tmp_path, socks_config())
    proc = subprocess.Popen([*SPLICEWAY, "run", "-c", config], stderr=subprocess.PIPE, text=True)
    try:
        port = int(wait_for_line(proc, r"listening on 127\.0\.0\.1:(\d+)").group(1))
        result = curl("--socks5-hostname", f"127.0.0.1:{port}", f"http://127.0.0.1:{origin[1]}/")
        assert result.stdout == "hello from origin\n"
        proc.send_signal(signum)
        assert proc.wait(20) == 0
        rest = proc.stderr.read()
        assert f"engine stopped on {signal.Signals(signum).name}" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_run_with_port_in_use_is_one_line_and_exit_2(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        config = write_config(tmp_path, socks_config(taken.getsockname()[1]))
        result = spliceway("run", "-c", config)
    finally:
        taken.close()
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "socks-in" in lines[0]
    assert "Address already in use" in lines[0]


def test_validate_accepts_a_good_file(tmp_path):
    config = write_config(tmp_path, socks_config(1080))
    result = spliceway("validate", config)
    assert result.returncode == 0, result.stdout


def test_validate_reports_one_line_per_problem_with_field_paths(tmp_path):
    doc = socks_config(70000)
    doc["inbounds"][0]["colour"] = "blue"
    doc["rules"] = [{"domain": ["a.test"], "outbound": "missing"}]
    config = write_config(tmp_path, doc)
    result = spliceway("validate", config)
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3, lines
    paths = sorted(line.split(":", 1)[0] for line in lines)
    assert paths == ["inbounds[0].colour", "inbounds[0].listen.port", "rules[0].outbound"]


def test_invalid_config_for_run_exits_2(tmp_path):
    config = write_config(tmp_path, {"inbounds": [{"tag": "x"}]})
    result = spliceway("run", "-c", config)
    assert result.returncode == 2
    assert "inbounds[0]" in result.stderr
