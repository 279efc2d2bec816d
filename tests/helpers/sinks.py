"""Event-sink tests' shared parts: configs, the delivery oracle, an engine in a subprocess,
and readers for the outbox's files and the kernel's socket table."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import urllib.request
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tests.conftest import base_config, wait_until
from tests.helpers.flows import socks_curl
from tests.helpers.program import SPLICEWAY

#: A stats interval no test outlives: no stats.sampled events unless a test wants them.
STATS_OFF_MS = 3_600_000
SOURCE_ID = "node-1"
#: The event types this build can emit (config.changed, engine.warning and ipc.* have no
#: emitter yet).
EMITTED = {
    "engine.started",
    "engine.stopped",
    "flow.started",
    "flow.routed",
    "flow.updated",
    "flow.completed",
    "policy.selected",
    "policy.probe.completed",
    "stats.sampled",
}
#: Fast delivery policy for tests (each test overrides what it exercises).
FAST_DISPATCHER = {
    "request_timeout_ms": 2000,
    "backoff_initial_ms": 20,
    "backoff_max_ms": 200,
    "retry_threshold": 10,
    "on_exhausted": "retry_forever",
}
STATUS_KEYS = {
    "name",
    "type",
    "pending",
    "total_delivered",
    "total_failed",
    "total_dead_lettered",
    "total_discarded",
    "dead_letters",
    "replay_gaps",
    "cursor_sequence",
    "last_success_at_unix_ms",
    "last_failure_at_unix_ms",
    "last_error",
    "outbox_storage",
    "delivery",
    "outbox_recovery",
}
STORAGE_KEYS = {
    "available_bytes",
    "total_bytes",
    "reserve_bytes",
    "maintenance_reserve_bytes",
    "write_blocked",
}
DELIVERY_KEYS = {
    "in_flight",
    "retry_pending",
    "ack_retry_pending",
    "durable_pending",
    "next_retry_at_unix_ms",
}
RECOVERY_KEYS = {
    "state",
    "recovered_records",
    "lost_records",
    "damaged_regions",
    "truncated_bytes",
    "damaged_ledger_slots",
    "unreadable_segments",
    "errors",
}


def every_event_groups(origin: tuple[str, int]) -> list[dict[str, Any]]:
    """A selector to select through and a url_test group probing ``origin``: with them an
    engine emits policy.selected and policy.probe.completed."""
    return [
        {"tag": "pick", "kind": "selector", "outbounds": ["direct", "block"]},
        {
            "tag": "auto",
            "kind": "url_test",
            "outbounds": ["direct"],
            "url": f"http://127.0.0.1:{origin[1]}/generate_204",
        },
    ]


def webhook(tag: str, url: str, events: Iterable[str] = (), **extra: Any) -> dict[str, Any]:
    """A webhook registration with ``source_id`` node-1."""
    return {
        "type": "webhook",
        "tag": tag,
        "url": url,
        "events": list(events),
        "source_id": SOURCE_ID,
        **extra,
    }


def jsonl(tag: str, path: str | os.PathLike[str], events: Iterable[str] = ()) -> dict[str, Any]:
    """A JSONL registration."""
    return {"type": "jsonl", "tag": tag, "path": str(path), "events": list(events)}


def sink_config(
    sinks: list[dict[str, Any]],
    outbox: str | os.PathLike[str] | None = None,
    *,
    dispatcher: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    control: bool = False,
    **api: Any,
) -> dict[str, Any]:
    """``base_config`` with ``sinks``, an outbox without a free-space reserve (unless
    ``api`` says otherwise), the fast dispatcher and no stats events."""
    cfg = base_config()
    cfg["runtime"] = {"stats_interval_ms": STATS_OFF_MS, **(runtime or {})}
    section = cfg["api"]
    section["event_sinks"] = sinks
    section["dispatcher"] = {**FAST_DISPATCHER, **(dispatcher or {})}
    if outbox is not None:
        section.update(outbox_path=str(outbox), outbox_min_free_bytes=0, outbox_min_free_percent=0)
    if control:
        section["control"] = {
            "enabled": True,
            "listen": {"address": "127.0.0.1", "port": 0},
            "api_key_env": None,
        }
    section.update(api)
    return cfg


def status_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """Sink ``name``'s item in a ``sinks`` query answer."""
    for item in doc["sinks"]:
        if item["name"] == name:
            return item
    raise AssertionError(f"no sink {name!r} in {[s['name'] for s in doc['sinks']]}")


def expected_body(envelope: dict[str, Any], source_id: str | None = SOURCE_ID) -> bytes:
    """The exact body a sink with ``source_id`` delivers for ``envelope`` (the ring's
    envelope, ``source_id`` filled in, same key order)."""
    return orjson.dumps({**envelope, "source_id": source_id})


def ring_events(events_doc: dict[str, Any], types: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The ring's envelopes a sink with filter ``types`` selects ([] = all)."""
    wanted = set(types)
    return [
        e
        for e in events_doc["events"]
        if e["event_type"] != "flow.snapshot" and (not wanted or e["event_type"] in wanted)
    ]


def assert_at_least_once(delivered: dict[str, list[bytes]], expected: dict[str, bytes]) -> None:
    """The oracle: every expected event arrived at least once, every copy of an event
    is byte-identical, and equal to the expected body."""
    missing = sorted(set(expected) - set(delivered))
    assert not missing, f"{len(missing)} of {len(expected)} events never delivered: {missing[:10]}"
    for event_id, bodies in delivered.items():
        assert len(set(bodies)) == 1, f"{event_id}: {len(set(bodies))} different bodies"
        if event_id in expected:
            assert bodies[0] == expected[event_id], (
                f"{event_id}: delivered {bodies[0][:300]!r}, expected {expected[event_id][:300]!r}"
            )


def flows(engine: Any, origin: tuple[str, int], n: int) -> None:
    """``n`` flows through the engine's socks-in, each answered by ``origin``."""
    for _ in range(n):
        result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/")
        assert result.stdout == "hello from origin\n", result.stderr


def wait_completed(engine: Any, n: int) -> dict[str, Any]:
    """The ring once it holds ``n`` flow.completed events."""

    def done() -> dict[str, Any] | None:
        ring = engine.query("events")
        count = sum(e["event_type"] == "flow.completed" for e in ring["events"])
        return ring if count >= n else None

    return wait_until(done, 10, f"{n} flow.completed events")


# -- the engine as a program ------------------------------------------------------------


class EngineProcess:
    """``python -m spliceway run -c FILE`` with its control API; stderr goes to a file."""

    def __init__(
        self,
        config: dict[str, Any],
        workdir: Path,
        name: str,
        *,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start it; ``prefix`` runs it under another program (``faketime``), ``env``
        adds environment variables."""
        self.config_path = workdir / f"{name}.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*prefix, *SPLICEWAY, "run", "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, **(env or {})},
                # A group of its own: a prefix such as faketime forks the engine and does
                # not pass signals on, so signals go to the group, never to one pid.
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self.base_url = ""
        self.socks_port = 0

    def wait_started(self, timeout: float = 20) -> EngineProcess:
        """Wait for the control API's and socks-in's listening lines."""

        def ready() -> bool:
            text = self.log()
            api = re.search(r"control API listening on (http://\S+)/api/v1/", text)
            socks = re.search(r"inbound socks-in \(socks5\) listening on 127\.0\.0\.1:(\d+)", text)
            if api and socks:
                self.base_url, self.socks_port = api.group(1), int(socks.group(1))
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited {self.proc.returncode}: {text}")
            return False

        wait_until(ready, timeout, "the engine's listening lines")
        return self

    def log(self) -> str:
        """Everything the engine wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> dict[str, Any]:
        """``GET /api/v1/<path>``: the answer envelope's result."""
        with urllib.request.urlopen(f"{self.base_url}/api/v1/{path}", timeout=10) as answer:
            doc = json.loads(answer.read())
        assert doc["ok"] is True, doc
        return doc["result"]

    def sink(self, name: str) -> dict[str, Any]:
        """Sink ``name``'s status item."""
        return status_of(self.get("sinks"), name)

    def kill(self) -> None:
        """SIGKILL (the engine and any prefix) and reap."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM to the engine (and any prefix); the exit status."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        return self.proc.wait(20)

    def close(self) -> None:
        """Make sure every process of it is gone (stopped ones are continued so they can
        die), the engine under a prefix included."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
            os.killpg(self.pid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.wait(10)


def freeze_process(pid: int, timeout: float = 5) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped (the signal
    alone only starts the group stop: a thread on another CPU may run on a little)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
        return True

    wait_until(stopped, timeout, f"every thread of {pid} stopped")


def unread_bytes_from(remote_port: int) -> int:
    """Bytes waiting unread in this host's established IPv4 TCP sockets connected to
    127.0.0.1:``remote_port`` (the receive queue in /proc/net/tcp)."""
    total = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            remote, state, queues = fields[2], fields[3], fields[4]
            if state == "01" and int(remote.split(":")[1], 16) == remote_port:
                total += int(queues.split(":")[1], 16)
    return total


# -- the outbox's files -----------------------------------------------------------------

_HEADER = struct.Struct("<IIQI")
_MAGIC = 0x31525753


@dataclass(frozen=True)
class SegmentRecord:
    """A record of a segment file as this independent reader parsed it."""

    record_id: int
    offset: int
    end: int
    payload: bytes


def sink_dir(outbox: Path, tag: str) -> Path:
    return outbox / "sinks" / f"t-{tag}"


def segment_files(outbox: Path, tag: str) -> list[Path]:
    """Sink ``tag``'s segment files, oldest first."""
    return sorted(sink_dir(outbox, tag).glob("seg-*.log"))


def read_records(path: Path, *, torn_tail: bool = False) -> list[SegmentRecord]:
    """Every record of a segment file. Asserts the file is undamaged, but for a torn tail
    when ``torn_tail`` (what a crash mid-write leaves): reading stops there."""
    data = path.read_bytes()
    out = []
    pos = 0
    while pos < len(data):
        valid = pos + _HEADER.size <= len(data)
        if valid:
            magic, length, record_id, crc = _HEADER.unpack_from(data, pos)
            end = pos + _HEADER.size + length
            payload = data[pos + _HEADER.size : end]
            valid = (
                magic == _MAGIC
                and end <= len(data)
                and zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", length, record_id))) == crc
            )
        if not valid:
            assert torn_tail, f"{path}: no valid record at {pos}"
            break
        out.append(SegmentRecord(record_id, pos, end, payload))
        pos = end
    return out


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        (byte,) = f.read(1)
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def durable_acked_id(path: Path) -> int:
    """The ACK of the newest valid ledger slot (0 without one)."""
    raw = path.read_bytes() if path.exists() else b""
    best = (0, 0)
    for i in range(2):
        body = raw[i * 512 : i * 512 + 20]
        if len(body) < 20 or len(raw) < i * 512 + 24:
            continue
        magic, generation, acked = struct.unpack("<IQQ", body)
        (crc,) = struct.unpack_from("<I", raw, i * 512 + 20)
        if magic == 0x31475753 and zlib.crc32(body) == crc:
            best = max(best, (generation, acked))
    return best[1]


def read_ledger_slots(path: Path) -> list[tuple[int, int]]:
    """``(generation, acked id)`` of both slots of an ACK ledger (asserts both are valid)."""
    raw = path.read_bytes()
    slots = []
    for i in range(2):
        body = raw[i * 512 : i * 512 + 20]
        magic, generation, acked = struct.unpack("<IQQ", body)
        (crc,) = struct.unpack_from("<I", raw, i * 512 + 20)
        assert magic == 0x31475753 and zlib.crc32(body) == crc, f"slot {i} invalid"
        slots.append((generation, acked))
    return slots
