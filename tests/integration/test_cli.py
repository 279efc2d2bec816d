"""The ``spliceway`` program as a user runs it: run, signals, port conflicts, validate."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from tests.helpers.flows import curl
from tests.helpers.program import (
    SPLICEWAY,
    environ_without,
    running,
    wait_for_line,
    write_config,
)


def spliceway(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the program to completion (30 s at most), capturing its output as text."""
    return subprocess.run(
        [*SPLICEWAY, *args], capture_output=True, text=True, timeout=30, check=False
    )


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
    with running(config) as proc:
        port = int(wait_for_line(proc, r"listening on 127\.0\.0\.1:(\d+)").group(1))
        result = curl("--socks5-hostname", f"127.0.0.1:{port}", f"http://127.0.0.1:{origin[1]}/")
        assert result.stdout == "hello from origin\n"
        proc.send_signal(signum)
        assert proc.wait(20) == 0
        rest = proc.stderr.read()
        assert f"engine stopped on {signal.Signals(signum).name}" in rest


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
    assert result.stderr.startswith("spliceway: invalid_argument: ")


def test_validate_json_is_one_object_for_a_script(tmp_path):
    good = spliceway("validate", "--json", write_config(tmp_path, socks_config(1080)))
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout) == {"file": str(tmp_path / "config.json"), "valid": True}
    doc = socks_config(70000)
    doc["rules"] = [{"domain": ["a.test"], "outbound": "missing"}]
    bad = spliceway("validate", "--json", write_config(tmp_path, doc))
    assert bad.returncode == 1
    assert bad.stderr.startswith("spliceway: invalid_argument: configuration is invalid")
    error = json.loads(bad.stdout)
    assert error["code"] == "invalid_argument"
    assert error["message"].startswith("configuration is invalid")
    assert sorted(d["field_path"] for d in error["details"]) == [
        "inbounds[0].listen.port",
        "rules[0].outbound",
    ]
    assert all(d["message"] for d in error["details"])
    missing = spliceway("validate", "--json", str(tmp_path / "nope.json"))
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["details"][0]["message"]


def test_build_info_prints_a_table_and_json():
    from spliceway import __version__
    from spliceway.native import relay

    table = spliceway("build-info")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["FIELD", "VALUE"]
    rows = dict(line.split(None, 1) for line in lines[1:])
    assert rows["version"] == __version__ and rows["relay_abi"] == str(relay.ABI_VERSION)
    as_json = spliceway("build-info", "--json")
    assert as_json.returncode == 0, as_json.stderr
    info = json.loads(as_json.stdout)
    assert (info["version"], info["relay_abi"]) == (__version__, relay.ABI_VERSION)
    assert (",".join(info["build_features"]) or "-") == rows["build_features"]


def test_invalid_config_for_run_exits_2(tmp_path):
    config = write_config(tmp_path, {"inbounds": [{"tag": "x"}]})
    result = spliceway("run", "-c", config)
    assert result.returncode == 2
    assert "inbounds[0]" in result.stderr


def spliceway_dev(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the program under ``-X dev``, which prints every leaked socket, pipe or event
    loop as a ResourceWarning: a failed start must leave nothing behind."""
    return subprocess.run(
        [sys.executable, "-X", "dev", "-m", "spliceway", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )


RELAY_CONFIG = {
    "inbounds": [{"tag": "in", "protocol": "socks5", "listen": {"port": 0}}],
    "outbounds": [
        {"tag": "a", "protocol": "socks5", "server": "127.0.0.1", "port": 1080},
        {"tag": "b", "protocol": "http", "server": "127.0.0.1", "port": 3128},
    ],
    "outbound_groups": [{"tag": "chain", "kind": "relay", "outbounds": ["a", "b"]}],
}


@pytest.mark.parametrize("doc", [{}, RELAY_CONFIG], ids=["empty", "relay-group"])
def test_unset_key_variable_is_one_kind_line_and_exit_2(tmp_path, doc):
    config = write_config(tmp_path, doc)
    result = spliceway_dev("run", "-c", config, env=environ_without("SPLICEWAY_API_KEY"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "spliceway: cannot start: invalid_argument: api.control.api_key_env: environment "
        "variable SPLICEWAY_API_KEY is not set: export SPLICEWAY_API_KEY=<the key clients "
        'must send>, or set "api_key_env": null in api.control for a control API without a '
        "key (keep it on loopback)"
    ]
    # validate says the same, with the same field path, instead of calling it valid.
    checked = spliceway_dev("validate", config, env=environ_without("SPLICEWAY_API_KEY"))
    assert checked.returncode == 1
    assert checked.stdout.startswith(
        "api.control.api_key_env: environment variable SPLICEWAY_API_KEY is not set"
    )


def test_validate_lists_every_unset_key_variable(tmp_path):
    doc = socks_config()
    doc["api"]["control"] = {
        "enabled": True,
        "api_key_env": "SW_TEST_ADMIN_UNSET",
        "keys": [{"name": "dash", "key_env": "SW_TEST_DASH_UNSET", "permissions": ["read"]}],
    }
    result = spliceway("validate", write_config(tmp_path, doc))
    assert result.returncode == 1
    paths = [line.split(":", 1)[0] for line in result.stdout.splitlines()]
    assert paths == ["api.control.api_key_env", "api.control.keys[0].key_env"]


def test_key_variable_set_or_null_starts(tmp_path):
    env = {**environ_without("SPLICEWAY_API_KEY"), "SW_TEST_KEY_SET": "k"}
    for control in ({"api_key_env": "SW_TEST_KEY_SET"}, {"api_key_env": None}):
        doc = socks_config()
        doc["api"]["control"] = {"listen": {"port": 0}, **control}
        checked = subprocess.run(
            [*SPLICEWAY, "validate", write_config(tmp_path, doc)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=env,
        )
        assert checked.returncode == 0, checked.stdout


def _taken_port_config(kind: str, port: int) -> dict:
    doc = socks_config(port if kind == "inbound" else 0)
    if kind == "control":
        doc["api"]["control"] = {"api_key_env": None, "listen": {"port": port}}
    return doc


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("inbound", "cannot start: conflict: inbounds[0].listen: inbound 'socks-in' cannot listen"),
        ("control", "cannot start: conflict: api.control.listen: control API cannot listen"),
        ("tun", "cannot start: invalid_argument: runtime.tun.tag: tag 'socks-in' already names"),
        ("invalid", "invalid configuration: inbounds[0].listen: required key is missing"),
    ],
)
def test_every_failed_start_is_one_line_with_nothing_leaked(tmp_path, case, expected):
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        if case in ("inbound", "control"):
            doc = _taken_port_config(case, port)
        elif case == "tun":
            doc = socks_config()
            # Refused before any device, route or rule exists in this namespace.
            doc["runtime"] = {"tun": {"addr": "172.19.0.1/30", "tag": "socks-in"}}
        else:
            doc = {"inbounds": [{"tag": "x", "protocol": "socks5"}]}
        result = spliceway_dev("run", "-c", write_config(tmp_path, doc))
    finally:
        taken.close()
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"spliceway: {expected}"), lines


def test_config_schema_is_the_json_schema_of_the_document():
    import jsonschema

    result = spliceway("config-schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(socks_config())
    errors = list(validator.iter_errors({"inbounds": [{"tag": "x", "protocol": "gopher"}]}))
    assert errors
