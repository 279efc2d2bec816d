"""A url_test or fallback group with no healthy member warns once per outage: one WARNING
line and one ``engine.warning`` ``policy_no_healthy_member`` when it gets there, however
many rounds follow, an INFO line when a member is healthy again, and a new warning only
after that. The members are direct; the probe URL's port is ours, refusing (bound, not
listening) or answering, so the outage starts and ends when the test says."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

import pytest

from spliceway.actors.policy import NO_HEALTHY_MEMBER
from tests.conftest import base_config, wait_until
from tests.events.test_catalogue import check_event

LOGGER = "spliceway.actors.policy"
GROUPS = ("auto", "fb")


def refusing(port: int = 0) -> socket.socket:
    """A socket bound to ``port`` on loopback and never listening: connects are refused."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class Answering:
    """``sock`` listening, each connection answered ``204`` and closed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.listen(16)
        sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def rounds(engine: Any, tag: str) -> list[dict[str, Any]]:
    """The payloads of ``tag``'s finished probe rounds, oldest first."""
    found = engine.query("events", {"types": "policy.probe.completed"})["events"]
    return [e["payload"] for e in found if e["payload"]["policy_tag"] == tag]


def warnings(engine: Any) -> list[dict[str, Any]]:
    return engine.query("events", {"types": "engine.warning"})["events"]


def wait_rounds(engine: Any, after: int, *, healthy: bool, n: int = 2) -> None:
    """Until each group finished ``n`` rounds past ``after`` that all found ``healthy``."""

    def done() -> bool:
        for tag in GROUPS:
            later = rounds(engine, tag)[after:]
            found = [r for r in later if all(m["healthy"] is healthy for m in r["members"])]
            if len(found) < n:
                return False
        return True

    wait_until(done, timeout=20, what=f"{n} rounds per group with healthy={healthy}")


def log_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_group_without_a_healthy_member_warns_once_per_outage(
    make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    sock = refusing()
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/generate_204"
    cfg = base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "d1", "protocol": "direct"},
            {"tag": "d2", "protocol": "direct"},
        ],
        outbound_groups=[
            {
                "tag": "auto",
                "kind": "url_test",
                "outbounds": ["d1", "d2"],
                "url": url,
                "interval_seconds": 1,
            },
            {
                "tag": "fb",
                "kind": "fallback",
                "outbounds": ["d2", "d1"],
                "url": url,
                "interval_seconds": 1,
            },
            # Never warned about: a load_balance group uses every member then.
            {"tag": "lb", "kind": "load_balance", "outbounds": ["d1", "d2"], "url": url},
        ],
    )
    engine = make_engine(cfg)
    try:
        # Three rounds of each group found both members down: one warning per group.
        wait_rounds(engine, 0, healthy=False, n=3)
        first = warnings(engine)
        assert [w["payload"]["code"] for w in first] == [NO_HEALTHY_MEMBER] * 2
        assert all(check_event(w) == [] for w in first)
        by_group = {w["payload"]["message"].split("'")[1]: w["payload"]["message"] for w in first}
        assert set(by_group) == set(GROUPS)
        assert by_group["auto"].startswith("policy group 'auto' (url_test) has no healthy member")
        assert by_group["fb"].startswith("policy group 'fb' (fallback) has no healthy member")
        assert "d1: " in by_group["fb"] and "d2: " in by_group["fb"]
        assert by_group["fb"].endswith("its flows go to 'd2' until a member is healthy again")
        lines = log_lines(caplog)
        assert sorted(lines) == sorted((logging.WARNING, m) for m in by_group.values())

        # The URL answers: each group logs its recovery once, and warns no more.
        seen = {tag: len(rounds(engine, tag)) for tag in GROUPS}
        answering = Answering(sock)
        try:
            wait_rounds(engine, min(seen.values()), healthy=True)
        finally:
            answering.close()
        assert warnings(engine) == first
        recovered = log_lines(caplog)[len(lines) :]
        assert sorted(recovered) == [
            (logging.INFO, "policy group 'auto' (url_test) has a healthy member again: d1, d2"),
            (logging.INFO, "policy group 'fb' (fallback) has a healthy member again: d2, d1"),
        ]

        # Refused again: a second outage, a second warning per group.
        sock = refusing(port)
        seen = {tag: len(rounds(engine, tag)) for tag in GROUPS}
        wait_rounds(engine, max(seen.values()), healthy=False)
        again = warnings(engine)[len(first) :]
        assert [w["payload"]["code"] for w in again] == [NO_HEALTHY_MEMBER] * 2
        assert sorted(w["payload"]["message"].split("'")[1] for w in again) == list(GROUPS)
        assert [lvl for lvl, _ in log_lines(caplog)[len(lines) + 2 :]] == [logging.WARNING] * 2
    finally:
        sock.close()
