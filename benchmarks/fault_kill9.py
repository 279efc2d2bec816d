#!/usr/bin/env python3
"""Fault benchmark: kill -9 the engine at random moments while its sinks deliver; lose nothing.

    python benchmarks/fault_kill9.py [--rounds 50] [--seed N] [--rate 25]

The engine runs as its own process (``python -m spliceway run -c <tmp config>``) with a socks5
inbound, the control API on port 0 and two sinks with the same filter and no ``source_id``, in
this order: a webhook sink (``hook``) posting to a receiver in this process, and a JSONL sink
(``ref``) appending to a file. Both share one ``outbox_path`` that is reused across all rounds.

Each round: start the engine (it must report its ports within ``--start-timeout``), read every
sink's ``outbox_recovery`` from ``GET /api/v1/sinks``, drive short TCP connections through the
socks5 inbound to a local TCP server from a thread, and ``SIGKILL`` the engine after a random
0.3-2.0 s (a fraction of rounds, ``--early-kill-fraction``, much sooner: 0-0.3 s, while the
restart's backlog is being redelivered). The receiver answers mostly 200, sometimes 500, 429 or
503, sometimes late, and rarely later than the sink's request timeout, so kills land before a
POST, while one is in flight, and between a 2xx and the durable ACK. After the last round the
engine runs once more with a healthy receiver and no load until the receiver has every expected
event, then stops with SIGTERM.

Oracle (what the webhook sink must deliver; see ``Oracle``). After every kill the webhook
sink's outbox files are read here, with a parser independent of the engine's: every intact
record must in the end be answered 2xx with the same bytes, and every record at or below the
durable ACK must already have been answered 2xx (an ACK never precedes its 2xx). The JSONL file
is a second reference: its bodies are the same bytes (same envelope, no ``source_id``), and as
the intake commits a prefix of each engine's event sequence to each sink, every JSONL event of
an engine at or below the highest sequence the webhook sink is known to have held must be
delivered too. (The JSONL file alone is not enough: in one intake round the JSONL feed reads
the event log after the webhook's feed did, so it can hold a few events the webhook sink never
took before the kill; those are counted as "ahead", not as lost, and so is a crash completion
the webhook did not owe because it had taken that flow's real flow.completed.) Duplicates are
counted (expected after kills) and must be byte-identical; losses must be 0. Every flow whose
flow.started the webhook delivered must have exactly one flow.completed event delivered (a flow
a kill left open is completed at the next start, outcome engine_crashed).

Prints a summary and writes ``benchmarks/results/<timestamp>-fault-kill9.json`` (plus the
engine's stderr of every round as ``.engine.log``). Exit status 1 when an event was lost, a body
differed, a start failed or the final drain did not finish. Every server listens on 127.0.0.1;
every loop is bounded in count and time; only processes this script started are signalled, by
pid. See benchmarks/README.md ("Fault benchmark: kill -9").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import http.client
import http.server
import itertools
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run_e2e as e2e  # noqa: E402  (shared tooling: engine launch command, preexec)
from bench_control import CONTROL_RE, control_api  # noqa: E402
from run_e2e import RESULTS, ROOT, log  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.helpers.socks import recv_exact  # noqa: E402

EVENTS = ["flow.started", "flow.routed", "flow.completed", "engine.started"]
DAMAGE_RE = re.compile(r"sink (\S+): outbox recovered with damage")
FLAG_RE = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b")
LOG_CAP = 8 << 20  # bytes of engine stderr kept in results/ over the whole run
REQUEST_TIMEOUT_MS = 2000
BACKOFF_MAX_S = 0.2  # dispatcher backoff_max_ms below
ACK_WINDOW_S = 0.05  # actors/sink.py ACK_INTERVAL_S: a 2xx this recent is probably not ACKed yet
MAX_FLOWS_PER_ROUND = 2000  # the load thread's count bound per round
MAX_CONSECUTIVE_START_FAILURES = 3


# --------------------------------------------------------------------------- receiver


class Receiver:
    """Threaded keep-alive HTTP/1.1 webhook receiver on 127.0.0.1:<free port>.

    Records every request; a body counts as delivered only once a 2xx answer was written.
    Answers are drawn from a seeded mix of faults unless ``healthy`` is set.
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.healthy = False
        #: event_id -> every body answered 2xx (in order)
        self.delivered: dict[str, list[bytes]] = {}
        #: event_id -> the status of every request that carried it
        self.seen: dict[str, list[int]] = {}
        self.status_counts: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.unparseable = 0
        self.connection_errors = 0  # connections that ended in an error (kills)
        self.answer_failed = 0  # the engine was gone before the answer was written
        #: Requests being answered, by engine generation (a killed engine's late
        #: answers do not count as this engine's in-flight request).
        self.generation = 0
        self.in_progress: collections.Counter[int] = collections.Counter()
        self.last_answer: tuple[int, int, float] = (0, 0, 0.0)  # generation, status, when
        self.max_in_progress = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30  # an idle keep-alive connection ends after this

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                receiver._handle(self)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                # A killed engine resets its connections: expected, counted, not printed.
                with receiver._lock:
                    receiver.connection_errors += 1

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    def _reply(self) -> tuple[int, float, dict[str, str]]:
        """(status, delay before answering, extra headers) for the next request."""
        if self.healthy:
            return 200, 0.0, {}
        with self._lock:
            x = self._rng.random()
            u = self._rng.random()
        if x < 0.90:
            return 200, 0.0, {}
        if x < 0.94:
            return 200, 0.005 + 0.045 * u, {}  # late: a kill lands while it is in flight
        if x < 0.95:
            return 200, 0.1 + 0.2 * u, {}  # very late
        if x < 0.97:
            return 500, 0.0, {}
        if x < 0.985:
            return 429, 0.0, {"Retry-After": "1"}  # honoured up to backoff_max_ms
        if x < 0.999:
            return 503, 0.02 * u, {}
        # Past the sink's request timeout: the sink gives up and sends it again, though the
        # receiver answers 200 (a duplicate that needs no kill).
        return 200, REQUEST_TIMEOUT_MS / 1000 + 0.3, {}

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length", "0"))
        body = h.rfile.read(length)
        with self._lock:
            self.requests += 1
            gen = self.generation
            self.in_progress[gen] += 1
            self.max_in_progress = max(self.max_in_progress, sum(self.in_progress.values()))
        status, delay, headers = self._reply()
        try:
            event_id: str | None = str(json.loads(body)["event_id"])
        except (ValueError, KeyError, TypeError):
            event_id = None
        ok = 200 <= status < 300
        if delay:
            time.sleep(delay)
        with self._lock:
            if event_id is None:
                self.unparseable += 1
            else:
                self.seen.setdefault(event_id, []).append(status)
                if ok:
                    # Recorded before the answer is sent: the engine can only ACK after it.
                    self.delivered.setdefault(event_id, []).append(body)
        try:
            h.send_response(status)
            for name, value in headers.items():
                h.send_header(name, value)
            h.send_header("Content-Length", "0")
            h.end_headers()
            h.wfile.flush()
            written = True
        except OSError:
            written = False
            h.close_connection = True
        with self._lock:
            self.in_progress[gen] -= 1
            if not written:
                # The engine was gone before the answer was written: not delivered.
                self.answer_failed += 1
                if ok and event_id is not None:
                    self.delivered[event_id].remove(body)
                    if not self.delivered[event_id]:
                        del self.delivered[event_id]
                return
            self.status_counts[str(status)] += 1
            self.last_answer = (gen, status, time.monotonic())

    def snapshot(self) -> dict[str, list[bytes]]:
        with self._lock:
            return {k: list(v) for k, v in self.delivered.items()}

    def seen_ids(self) -> set[str]:
        with self._lock:
            return set(self.seen)

    def statuses_of(self, event_id: str) -> list[int]:
        with self._lock:
            return list(self.seen.get(event_id, []))

    def next_generation(self) -> None:
        """A new engine process starts: later requests are its own."""
        with self._lock:
            self.generation += 1

    def phase(self) -> str:
        """Where the webhook sink probably is right now (for the kill-phase tally)."""
        with self._lock:
            gen, status, at = self.last_answer
            if self.in_progress[self.generation]:
                return "request_in_flight"
            if gen != self.generation:
                return "no_answer_yet"
            ago = time.monotonic() - at
            if 200 <= status < 300 and ago < ACK_WINDOW_S:
                return "after_2xx_before_ack_flush"
            if not 200 <= status < 300 and ago < BACKOFF_MAX_S:
                return "retry_backoff"
            return "between_requests"

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests,
                "statuses": dict(self.status_counts),
                "answer_failed": self.answer_failed,
                "connection_errors": self.connection_errors,
                "unparseable_2xx_bodies": self.unparseable,
                "max_concurrent_requests": self.max_in_progress,
            }

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


# --------------------------------------------------------------------------- load


class TargetServer:
    """Tiny threaded TCP server: read the request, answer a few bytes, close."""

    def __init__(self) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(3)
                with contextlib.suppress(OSError):
                    self.request.recv(256)
                    self.request.sendall(b"pong\n" * 20)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def one_flow(socks_port: int, target_port: int) -> None:
    """One short connection through the socks5 inbound: handshake, request, read to EOF."""
    with socket.create_connection(("127.0.0.1", socks_port), timeout=2) as s:
        s.sendall(b"\x05\x01\x00")
        if recv_exact(s, 2) != b"\x05\x00":
            raise ConnectionError("socks5 method refused")
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + target_port.to_bytes(2))
        reply = recv_exact(s, 10)
        if reply[1] != 0:
            raise ConnectionError(f"socks5 reply {reply[1]}")
        s.sendall(b"ping\n")
        while s.recv(4096):
            pass


class Load:
    """A thread pacing short flows at ``rate``/s until stopped (bounded in count)."""

    def __init__(self, socks_port: int, target_port: int, rate: float) -> None:
        self.socks_port = socks_port
        self.target_port = target_port
        self.interval = 1.0 / rate
        self.ok = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        for _ in range(MAX_FLOWS_PER_ROUND):
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            next_at += self.interval
            try:
                one_flow(self.socks_port, self.target_port)
                self.ok += 1
            except OSError:
                self.failed += 1

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(5)
        return {"flows_ok": self.ok, "flows_failed": self.failed}


# --------------------------------------------------------------------------- engine


class EngineProc:
    """One engine process; its stderr is drained by a thread into the shared log."""

    def __init__(self, cmd: list[str], log_file: Any, log_budget: list[int], label: str) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=e2e.preexec,
        )
        self.pid = self.proc.pid
        self.socks_port: int | None = None
        self.api_port: int | None = None
        self.ready_at: float | None = None
        self.damage_warnings: list[str] = []
        self.flagged: list[str] = []
        self.warnings = 0
        self.lines = collections.deque(maxlen=40)
        self._ready = threading.Event()
        self._log_file = log_file
        self._log_budget = log_budget
        self._log_file.write(f"===== {label} pid {self.pid}\n")
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if self._log_budget[0] > 0:
                self._log_file.write(line)
                self._log_budget[0] -= len(line)
            line = line.rstrip("\n")
            self.lines.append(line)
            if " WARNING " in line:
                self.warnings += 1
            if DAMAGE_RE.search(line):
                self.damage_warnings.append(line[:600])
            if FLAG_RE.search(line) and len(self.flagged) < 20:
                self.flagged.append(line[:300])
            if self.socks_port is None and (m := e2e.LISTEN_RE.search(line)):
                self.socks_port = int(m.group(2))
            if self.api_port is None and (m := CONTROL_RE.search(line)):
                self.api_port = int(m.group(2))
            if self.socks_port and self.api_port and not self._ready.is_set():
                self.ready_at = time.monotonic()
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> bool:
        self._ready.wait(timeout)
        return self.ready_at is not None and self.proc.poll() is None

    def sinks(self) -> list[dict[str, Any]] | None:
        """``GET /api/v1/sinks`` items, or None (retried a few times past a 429)."""
        for _ in range(5):
            c = http.client.HTTPConnection("127.0.0.1", self.api_port or 0, timeout=3)
            try:
                c.request("GET", "/api/v1/sinks")
                r = c.getresponse()
                body = r.read()
            except OSError:
                return None
            finally:
                c.close()
            if r.status == 429:
                time.sleep(0.05)
                continue
            try:
                doc = json.loads(body)
            except ValueError:
                return None
            result = doc.get("result", doc) if isinstance(doc, dict) else None
            if isinstance(result, dict) and isinstance(result.get("sinks"), list):
                return result["sinks"]
            return None
        return None

    def kill9(self, timeout: float = 10.0) -> int | None:
        """SIGKILL this engine (its pid only) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self._thread.join(2)

    def terminate(self, grace: float = 15.0) -> tuple[int | None, bool]:
        """SIGTERM, then SIGKILL after ``grace``; (exit status, killed)."""
        killed = e2e.stop_child(self.proc, grace)
        self._thread.join(2)
        return self.proc.returncode, killed


# --------------------------------------------------------------------------- oracle


def read_jsonl(path: Path) -> dict[str, Any]:
    """Complete lines of the JSONL file: event_id -> body, with counts of what else was there."""
    data = path.read_bytes() if path.exists() else b""
    pieces = data.split(b"\n")
    tail = pieces.pop()  # bytes after the last newline: an unfinished line (if any)
    bodies: dict[str, bytes] = {}
    lines = duplicates = torn = 0
    mismatched: list[str] = []
    torn_examples: list[str] = []
    types: collections.Counter[str] = collections.Counter()
    for raw in pieces:
        if not raw:
            continue
        lines += 1
        try:
            doc = json.loads(raw)
            event_id = str(doc["event_id"])
        except (ValueError, KeyError, TypeError):
            torn += 1
            if len(torn_examples) < 5:
                torn_examples.append(raw[:120].decode("utf-8", "replace"))
            continue
        if event_id in bodies:
            duplicates += 1
            if bodies[event_id] != raw:
                mismatched.append(event_id)
            continue
        bodies[event_id] = raw
        types[str(doc.get("event_type"))] += 1
    return {
        "bodies": bodies,
        "bytes": len(data),
        "lines": lines,
        "duplicate_lines": duplicates,
        "torn_lines": torn,
        "torn_examples": torn_examples,
        "unfinished_tail_bytes": len(tail),
        "mismatched_duplicates": mismatched,
        "event_types": dict(types),
    }


# The on-disk format (connector/segments.py, connector/ledger.py), re-implemented here.
SEG_HEADER = struct.Struct("<IIQI")  # magic | length | record id | crc32
SEG_MAGIC = 0x31525753
LEDGER_SLOT = struct.Struct("<IQQ")  # magic | generation | acked id; then crc32 u32
LEDGER_MAGIC = 0x31475753


def read_sink_outbox(sink_dir: Path) -> dict[str, Any]:
    """The webhook sink's outbox as the killed engine left it, read independently of the
    engine's code: the ACK ledger's acked id and every intact record (id -> body), in order.
    A segment is read up to its first invalid record (a torn write); bytes left unread are
    counted."""
    acked = 0
    try:
        raw = (sink_dir / "ledger").read_bytes()
    except FileNotFoundError:
        raw = b""
    best = (-1, 0)
    for i in range(2):
        slot = raw[i * 512 : i * 512 + LEDGER_SLOT.size + 4]
        if len(slot) < LEDGER_SLOT.size + 4:
            continue
        magic, generation, acked_id = LEDGER_SLOT.unpack_from(slot)
        (crc,) = struct.unpack_from("<I", slot, LEDGER_SLOT.size)
        if magic == LEDGER_MAGIC and zlib.crc32(slot[: LEDGER_SLOT.size]) == crc:
            best = max(best, (generation, acked_id))
    acked = best[1]
    records: dict[int, bytes] = {}
    unread: list[tuple[str, int, int]] = []
    segs = sorted(sink_dir.glob("seg-*.log"))
    for seg in segs:
        data = seg.read_bytes()
        pos = 0
        while pos + SEG_HEADER.size <= len(data):
            magic, length, record_id, crc = SEG_HEADER.unpack_from(data, pos)
            end = pos + SEG_HEADER.size + length
            if magic != SEG_MAGIC or end > len(data):
                break
            payload = data[pos + SEG_HEADER.size : end]
            if zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", length, record_id))) != crc:
                break
            records[record_id] = payload
            pos = end
        if pos < len(data):
            unread.append((seg.name, pos, len(data) - pos))
    ids = sorted(records)
    gaps = sum(1 for a, b in itertools.pairwise(ids) if b != a + 1)
    return {
        "acked": acked,
        "records": records,
        "unread": unread,
        "gaps": gaps,
        "segments": len(segs),
    }


def _epoch_seq(event_id: str) -> tuple[str, int] | None:
    epoch, _, seq = event_id.partition("-")
    return (epoch, int(seq)) if seq.isdigit() else None


def _completed_flow(body: bytes, *, crashed: bool = False) -> str | None:
    """The flow id of a flow.completed body (with ``crashed``: only an engine_crashed one)."""
    if b'"flow.completed"' not in body:
        return None
    try:
        event = json.loads(body)
        payload = event["payload"]
        if event["event_type"] != "flow.completed":
            return None
        if crashed and payload.get("outcome") != "engine_crashed":
            return None
        return str(payload["flow_id"])
    except (ValueError, KeyError, TypeError):
        return None


class Oracle:
    """What the webhook sink must deliver, from two independent sources.

    1. Outbox snapshots: after each kill, every intact record in the webhook sink's segment
       files (committed or merely written: recovery delivers both) must be delivered with
       the same bytes, and every record at or below the durable ACK must already have been
       answered 2xx when the snapshot was taken (an ACK never precedes its 2xx).
    2. The JSONL reference: the intake commits a prefix of each engine's event sequence to
       every sink, so every JSONL event of an engine epoch whose sequence is at or below the
       highest one the webhook sink is known to have held (in a snapshot or a request) must
       be delivered. JSONL events past that point were read by the JSONL sink's feed later
       in the same intake round than the webhook's and died with the engine before the
       webhook's next round: they never were the webhook's (counted as "ahead").
    """

    def __init__(self) -> None:
        self.expected: dict[str, bytes] = {}  # from the outbox snapshots
        self.held_max: dict[str, int] = {}  # epoch -> highest sequence the webhook held
        self.acked_without_2xx: list[str] = []
        self.snapshot_mismatch: list[str] = []
        self.snapshots: list[dict[str, Any]] = []

    def _held(self, event_id: str) -> None:
        es = _epoch_seq(event_id)
        if es is not None:
            self.held_max[es[0]] = max(self.held_max.get(es[0], 0), es[1])

    def snapshot(self, sink_dir: Path, delivered: dict[str, list[bytes]], label: str) -> dict:
        snap = read_sink_outbox(sink_dir)
        pending = acked_checked = 0
        for record_id, body in snap["records"].items():
            try:
                event_id = str(json.loads(body)["event_id"])
            except (ValueError, KeyError, TypeError):
                self.snapshot_mismatch.append(f"{label}: record {record_id} is not an event")
                continue
            self._held(event_id)
            if event_id in self.expected and self.expected[event_id] != body:
                self.snapshot_mismatch.append(event_id)
            self.expected.setdefault(event_id, body)
            if record_id <= snap["acked"]:
                acked_checked += 1
                if body not in delivered.get(event_id, []):
                    self.acked_without_2xx.append(event_id)
            else:
                pending += 1
        info = {
            "label": label,
            "acked_id": snap["acked"],
            "records": len(snap["records"]),
            "pending_records": pending,
            "acked_records_checked": acked_checked,
            "segments": snap["segments"],
            "unread_bytes": snap["unread"],
            "id_gaps": snap["gaps"],
        }
        self.snapshots.append(info)
        return info

    def must_deliver(
        self,
        jsonl: dict[str, bytes],
        seen: set[str],
        delivered: dict[str, list[bytes]] | None = None,
    ) -> tuple[dict[str, bytes], int]:
        """Every event the webhook must deliver (id -> body) and how many JSONL events were
        ahead of it (never the webhook's).

        A crash completion (flow.completed, outcome engine_crashed, emitted at a start for
        the flows a sink's outbox shows open) goes only to the sinks that owe it: one the
        webhook never got is not owed when the webhook held or delivered another
        flow.completed of that flow (it took the real one before the kill the JSONL sink
        did not reach); counted as "ahead" too."""
        held = dict(self.held_max)
        for event_id in seen:
            es = _epoch_seq(event_id)
            if es is not None:
                held[es[0]] = max(held.get(es[0], 0), es[1])
        ended: set[str] = set()
        for body in [*self.expected.values(), *(bs[0] for bs in (delivered or {}).values())]:
            flow = _completed_flow(body)
            if flow is not None:
                ended.add(flow)
        out = dict(self.expected)
        ahead = 0
        for event_id, body in jsonl.items():
            es = _epoch_seq(event_id)
            crash = event_id not in out and _completed_flow(body, crashed=True) in ended
            if es is not None and es[1] <= held.get(es[0], 0) and not crash:
                out.setdefault(event_id, body)
            else:
                ahead += 1
        return out, ahead

    def verdict(self, jsonl: dict[str, bytes], receiver: Receiver) -> dict[str, Any]:
        delivered = receiver.snapshot()
        must, ahead = self.must_deliver(jsonl, receiver.seen_ids(), delivered)
        lost = sorted(e for e in must if e not in delivered)
        differs = sorted(
            e
            for e, b in must.items()
            if (e in delivered and delivered[e][0] != b) or (e in jsonl and jsonl[e] != b)
        )
        dup_differs = sorted(e for e, bs in delivered.items() if any(b != bs[0] for b in bs[1:]))
        jsonl_verified = sum(1 for e in jsonl if e in must)
        return {
            "expected": len(must),
            "expected_from_outbox_snapshots": len(self.expected),
            "expected_from_jsonl": jsonl_verified,
            "jsonl_only_expected": sum(1 for e in must if e not in self.expected),
            "jsonl_ahead_of_webhook": ahead,
            "delivered_unique": sum(1 for e in must if e in delivered),
            "delivered_total_2xx": sum(len(bs) for bs in delivered.values()),
            "delivered_not_expected": sum(1 for e in delivered if e not in must),
            "duplicates": sum(len(bs) - 1 for bs in delivered.values()),
            "events_delivered_more_than_once": sum(1 for bs in delivered.values() if len(bs) > 1),
            "max_copies": max((len(bs) for bs in delivered.values()), default=0),
            "lost": len(lost),
            "lost_examples": [
                {
                    "event_id": e,
                    "statuses_seen": receiver.statuses_of(e),
                    "in_outbox_snapshot": e in self.expected,
                    "in_jsonl": e in jsonl,
                }
                for e in lost[:20]
            ],
            "body_differs": len(differs),
            "body_differs_examples": differs[:10],
            "duplicates_not_identical": len(dup_differs),
            "duplicates_not_identical_examples": dup_differs[:10],
            "acked_before_2xx": len(self.acked_without_2xx),
            "acked_before_2xx_examples": self.acked_without_2xx[:10],
            "snapshot_mismatches": len(self.snapshot_mismatch),
            "snapshot_mismatch_examples": self.snapshot_mismatch[:10],
            "engine_epochs_in_jsonl": len({e.split("-", 1)[0] for e in jsonl}),
            **_completions(delivered),
        }


def _completions(delivered: dict[str, list[bytes]]) -> dict[str, Any]:
    """Every flow the webhook was told started has exactly one completion event (across
    kills: the next start completes a flow a kill left open, outcome engine_crashed)."""
    started: set[str] = set()
    ends: dict[str, set[str]] = {}
    crashed = 0
    for event_id, bodies in delivered.items():
        body = bodies[0]
        if b'"flow.started"' in body:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                event = json.loads(body)
                if event["event_type"] == "flow.started":
                    started.add(str(event["payload"]["flow_id"]))
        flow = _completed_flow(body)
        if flow is not None:
            ends.setdefault(flow, set()).add(event_id)
            crashed += _completed_flow(body, crashed=True) is not None
    never = sorted(started - ends.keys())
    twice = sorted(f for f, ids in ends.items() if len(ids) > 1)
    return {
        "flows_started": len(started),
        "flows_never_completed": len(never),
        "flows_never_completed_examples": never[:10],
        "flows_completed_twice": len(twice),
        "flows_completed_twice_examples": twice[:10],
        "crash_completions": crashed,
    }


# --------------------------------------------------------------------------- run


def make_config(receiver_url: str, jsonl_path: Path, outbox: Path) -> dict[str, Any]:
    return {
        "inbounds": [e2e.socks_inbound()],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "api": {
            "control": control_api(),
            "ipc": {"enabled": False},
            "event_sinks": [
                {"type": "webhook", "tag": "hook", "url": receiver_url, "events": EVENTS},
                {"type": "jsonl", "tag": "ref", "path": str(jsonl_path), "events": EVENTS},
            ],
            "outbox_path": str(outbox),
            "outbox_min_free_bytes": 0,
            "outbox_min_free_percent": 0,
            "dispatcher": {
                "request_timeout_ms": REQUEST_TIMEOUT_MS,
                "backoff_initial_ms": 20,
                "backoff_max_ms": int(BACKOFF_MAX_S * 1000),
            },
        },
    }


def recovery_of(sinks: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    if sinks is None:
        return None
    return {s.get("name", "?"): s.get("outbox_recovery") or {} for s in sinks}


def brief_sinks(sinks: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Each sink's pending, delivered and failed counts (from ``GET /api/v1/sinks``)."""
    if sinks is None:
        return None
    keys = ("pending", "total_delivered", "total_failed", "cursor_sequence")
    return {s.get("name", "?"): {k: s.get(k) for k in keys} for s in sinks}


def dump_stacks(pid: int) -> str | None:
    """``py-spy dump`` of the engine (when installed), to see where a stuck sink waits."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        p = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "py-spy dump timed out"
    return (p.stdout + p.stderr)[-20000:]


def offline_state(cmd_prefix: list[str], cfg: Path) -> dict[str, Any] | None:
    """``spliceway connector state --json CFG`` (the engine must be stopped)."""
    if cmd_prefix[:3] != [sys.executable, "-m", "spliceway"]:
        return None
    try:
        p = subprocess.run(
            [*cmd_prefix, "connector", "state", "--json", str(cfg)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr.strip()[-500:]}
    except (subprocess.TimeoutExpired, ValueError) as ex:
        return {"error": str(ex)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / f"{stamp}-fault-kill9.engine.log"
    tmp = Path(tempfile.mkdtemp(prefix="spliceway-kill9-"))
    outbox, jsonl_path, cfg = tmp / "outbox", tmp / "ref.jsonl", tmp / "engine.json"
    hook_dir = outbox / "sinks" / "t-hook"  # connector/outbox.py sink_dir_name("hook")
    receiver = Receiver(rng.randrange(1 << 30))
    oracle = Oracle()
    target = TargetServer()
    cfg.write_text(json.dumps(make_config(receiver.url, jsonl_path, outbox), indent=1))
    cmd, launch = e2e.spliceway_launch_cmd(cfg)
    log(f"fault_kill9: {args.rounds} rounds, seed {args.seed}, engine: {launch}, tmp {tmp}")
    rounds: list[dict[str, Any]] = []
    start_failures = 0
    consecutive_failures = 0
    log_budget = [LOG_CAP]
    started = time.monotonic()
    final: dict[str, Any] = {}
    try:
        with open(log_path, "w") as log_file:
            for i in range(1, args.rounds + 1):
                early = rng.random() < args.early_kill_fraction
                kill_after = rng.uniform(0.0, 0.3) if early else rng.uniform(0.3, 2.0)
                before = receiver.counters()["requests"]
                receiver.next_generation()
                eng = EngineProc(cmd, log_file, log_budget, f"round {i}")
                ok = eng.wait_ready(args.start_timeout)
                rec: dict[str, Any] = {"round": i, "pid": eng.pid, "ready": ok}
                if not ok:
                    start_failures += 1
                    consecutive_failures += 1
                    rec["exit"] = eng.kill9()
                    rec["last_lines"] = list(eng.lines)[-15:]
                    rounds.append(rec)
                    log(f"round {i}: engine did not start within {args.start_timeout} s")
                    if consecutive_failures >= MAX_CONSECUTIVE_START_FAILURES:
                        log("giving up: the engine failed to start repeatedly")
                        break
                    continue
                consecutive_failures = 0
                rec["restart_s"] = round(eng.ready_at - eng.t0, 3)  # type: ignore[operator]
                sinks = eng.sinks()
                rec["recovery"] = recovery_of(sinks)
                rec["pending_at_start"] = {s["name"]: s.get("pending") for s in sinks or []}
                load = Load(eng.socks_port, target.port, args.rate)  # type: ignore[arg-type]
                t_load = time.monotonic()
                time.sleep(max(0.0, kill_after - (time.monotonic() - eng.ready_at)))  # type: ignore[operator]
                rec["sinks_before_kill"] = brief_sinks(eng.sinks())
                rec["kill_phase"] = receiver.phase()
                rec["kill_after_ready_s"] = round(time.monotonic() - eng.ready_at, 3)  # type: ignore[operator]
                rec["exit"] = eng.kill9()
                rec["outbox_snapshot"] = oracle.snapshot(
                    hook_dir, receiver.snapshot(), f"round {i}"
                )
                rec.update(load.stop())
                rec["load_s"] = round(time.monotonic() - t_load, 3)
                rec["early_kill"] = early
                rec["requests"] = receiver.counters()["requests"] - before
                rec["damage_warnings"] = eng.damage_warnings
                rec["flagged"] = eng.flagged
                rounds.append(rec)
                states = {k: v.get("state") for k, v in (rec["recovery"] or {}).items()}
                log(
                    f"round {i:3d}: up in {rec['restart_s']:.2f} s, kill after "
                    f"{rec['kill_after_ready_s']:.2f} s ({rec['kill_phase']}), "
                    f"{rec['flows_ok']} flows, {rec['requests']} POSTs, recovery {states}, "
                    f"exit {rec['exit']}, hook outbox: "
                    f"{rec['outbox_snapshot']['pending_records']} pending"
                )
                time.sleep(0.05)

            # The last start: healthy receiver, no load; wait for every expected event.
            receiver.healthy = True
            receiver.next_generation()
            eng = EngineProc(cmd, log_file, log_budget, "final")
            ok = eng.wait_ready(args.start_timeout)
            final = {"pid": eng.pid, "ready": ok}
            if ok:
                final["restart_s"] = round(eng.ready_at - eng.t0, 3)  # type: ignore[operator]
                sinks = eng.sinks()
                final["recovery"] = recovery_of(sinks)
                final["pending_at_start"] = {s["name"]: s.get("pending") for s in sinks or []}
                deadline = time.monotonic() + args.drain_timeout
                drained = False
                while time.monotonic() < deadline and eng.proc.poll() is None:
                    got = receiver.snapshot()
                    expected, _ = oracle.must_deliver(
                        read_jsonl(jsonl_path)["bodies"], receiver.seen_ids(), got
                    )
                    sinks = eng.sinks() or []
                    pending = sum(int(s.get("pending") or 0) for s in sinks)
                    if sinks and not pending and all(e in got for e in expected):
                        drained = True
                        break
                    time.sleep(0.5)
                final["drained"] = drained
                final["drain_s"] = round(time.monotonic() - eng.ready_at, 3)  # type: ignore[operator]
                final["sinks_at_end"] = eng.sinks()
                if not drained:
                    final["stacks"] = dump_stacks(eng.pid)
            else:
                start_failures += 1
                final["last_lines"] = list(eng.lines)[-15:]
            final["exit"], final["killed_after_sigterm"] = eng.terminate()
            final["outbox_snapshot"] = oracle.snapshot(hook_dir, receiver.snapshot(), "final stop")
            final["damage_warnings"] = eng.damage_warnings
            final["flagged"] = eng.flagged
    finally:
        receiver.close()
        target.close()
    total_s = time.monotonic() - started
    final["offline_state"] = offline_state(cmd[:3], cfg)

    jsonl = read_jsonl(jsonl_path)
    verdict = oracle.verdict(jsonl["bodies"], receiver)
    jsonl.pop("bodies")
    up = [r for r in rounds if r.get("ready")]
    states: collections.Counter[str] = collections.Counter()
    for r in [*up, final]:
        for name, recovery in (r.get("recovery") or {}).items():
            states[f"{name}:{recovery.get('state')}"] += 1
    sums = {
        key: sum(
            int(v.get(key) or 0) for r in [*up, final] for v in (r.get("recovery") or {}).values()
        )
        for key in ("recovered_records", "lost_records", "damaged_regions", "truncated_bytes")
    }
    restart = [r["restart_s"] for r in up]
    result = {
        "meta": {
            "timestamp": stamp,
            "git": e2e.git_info(),
            "python": sys.version.split()[0],
            "machine": platform.node(),
            "cpus": os.cpu_count(),
            "launch": launch,
            "args": vars(args),
            "engine_log": str(log_path),
        },
        "rounds_requested": args.rounds,
        "rounds_run": len(rounds),
        "start_failures": start_failures,
        "early_kills": sum(1 for r in up if r.get("early_kill")),
        "kill_phases": dict(collections.Counter(r.get("kill_phase") for r in up)),
        "kill_exit_statuses": dict(collections.Counter(str(r.get("exit")) for r in up)),
        "flows_ok": sum(r.get("flows_ok", 0) for r in up),
        "flows_failed": sum(r.get("flows_failed", 0) for r in up),
        "restart_s": {
            "max": max(restart, default=None),
            "mean": round(sum(restart) / len(restart), 3) if restart else None,
            "final": final.get("restart_s"),
        },
        "recovery_states": dict(sorted(states.items())),
        "recovery_totals": sums,
        "damage_warnings": sum(len(r.get("damage_warnings") or []) for r in [*up, final]),
        "damage_warning_examples": [
            w for r in [*up, final] for w in r.get("damage_warnings") or []
        ][:5],
        "flagged_lines": [x for r in [*up, final] for x in r.get("flagged") or []][:10],
        "receiver": receiver.counters(),
        "jsonl": jsonl,
        "verdict": verdict,
        "outbox_snapshots": {
            "unread_bytes": [x for x in oracle.snapshots if x["unread_bytes"]],
            "id_gaps": sum(x["id_gaps"] for x in oracle.snapshots),
            "pending_max": max((x["pending_records"] for x in oracle.snapshots), default=0),
            "acked_records_checked": sum(x["acked_records_checked"] for x in oracle.snapshots),
        },
        "final": final,
        "total_s": round(total_s, 1),
        "rounds": rounds,
    }
    failed = (
        verdict["lost"]
        or verdict["body_differs"]
        or verdict["duplicates_not_identical"]
        or verdict["acked_before_2xx"]
        or verdict["snapshot_mismatches"]
        or verdict["flows_never_completed"]
        or verdict["flows_completed_twice"]
        or jsonl["mismatched_duplicates"]
        or final.get("outbox_snapshot", {}).get("pending_records", 1)
        or start_failures
        or not final.get("drained")
        or len(rounds) < args.rounds
    )
    result["ok"] = not failed
    out = RESULTS / f"{stamp}-fault-kill9.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    result["meta"]["result_file"] = str(out)
    if not args.keep_tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        result["meta"]["tmp"] = str(tmp)
    return result


def report(res: dict[str, Any]) -> str:
    v, j, f, r = res["verdict"], res["jsonl"], res["final"], res["restart_s"]
    snaps = res["outbox_snapshots"]
    torn = sum(u[2] for x in snaps["unread_bytes"] for u in x["unread_bytes"])
    hook_left = f.get("outbox_snapshot", {}).get("pending_records")
    killed = " (killed)" if f.get("killed_after_sigterm") else ""
    rows = [
        ("rounds (kill -9)", f"{res['rounds_run']} of {res['rounds_requested']}"),
        ("start failures", res["start_failures"]),
        ("early kills (0-0.3 s after start)", res["early_kills"]),
        ("kill phases (webhook sink)", res["kill_phases"]),
        ("flows driven (ok / failed)", f"{res['flows_ok']} / {res['flows_failed']}"),
        (
            "events the webhook must deliver",
            f"{v['expected']} (outbox snapshots "
            f"{v['expected_from_outbox_snapshots']}, JSONL {v['expected_from_jsonl']}, "
            f"JSONL only {v['jsonl_only_expected']})",
        ),
        ("delivered unique (2xx)", v["delivered_unique"]),
        ("LOST", v["lost"]),
        (
            "duplicates (extra 2xx copies)",
            f"{v['duplicates']} over "
            f"{v['events_delivered_more_than_once']} events, max {v['max_copies']} copies",
        ),
        ("duplicates not byte-identical", v["duplicates_not_identical"]),
        (
            "flows started / never completed / completed twice",
            f"{v['flows_started']} / {v['flows_never_completed']} / "
            f"{v['flows_completed_twice']} ({v['crash_completions']} crash completions)",
        ),
        ("body differs (snapshot/JSONL/receiver)", v["body_differs"]),
        (
            "ACK durable before its 2xx",
            f"{v['acked_before_2xx']} (of "
            f"{res['outbox_snapshots']['acked_records_checked']} acked records checked)",
        ),
        ("JSONL events ahead of the webhook", v["jsonl_ahead_of_webhook"]),
        ("2xx for events not expected", v["delivered_not_expected"]),
        ("engine epochs in JSONL", v["engine_epochs_in_jsonl"]),
        ("outbox snapshots: id gaps / torn bytes", f"{snaps['id_gaps']} / {torn}"),
        (
            "JSONL lines / duplicate / torn / tail",
            f"{j['lines']} / {j['duplicate_lines']} / "
            f"{j['torn_lines']} / {j['unfinished_tail_bytes']} B",
        ),
        ("receiver requests", res["receiver"]["requests"]),
        ("receiver statuses", res["receiver"]["statuses"]),
        ("recovery states (sink:state x starts)", res["recovery_states"]),
        ("recovery totals", res["recovery_totals"]),
        ("'recovered with damage' warnings", res["damage_warnings"]),
        ("restart s (max / mean / final)", f"{r['max']} / {r['mean']} / {r['final']}"),
        (
            "final drain",
            f"{'done' if f.get('drained') else 'NOT DONE'} in {f.get('drain_s')} s, "
            f"SIGTERM exit {f.get('exit')}{killed}, hook outbox after stop: {hook_left} pending",
        ),
        ("total run time s", res["total_s"]),
        ("RESULT", "PASS" if res["ok"] else "FAIL"),
    ]
    width = max(len(k) for k, _ in rows)
    meta = res["meta"]
    lines = [f"spliceway fault benchmark: kill -9  {meta['timestamp']}  git {meta['git']}"]
    lines += [f"  {k:<{width}}  {val}" for k, val in rows]
    off = f.get("offline_state")
    if isinstance(off, dict) and "sinks" in off:
        lines.append(
            "  offline state after stop: "
            + ", ".join(
                f"{s['name']} pending={s['pending']} dead={s['dead_letters']}" for s in off["sinks"]
            )
        )
    if v["lost_examples"]:
        lines.append(f"  lost event_ids (first): {v['lost_examples']}")
    if res["flagged_lines"]:
        lines.append("  flagged engine stderr lines:")
        lines += [f"    {x}" for x in res["flagged_lines"]]
    lines.append(f"  result: {res['meta']['result_file']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50, help="kill -9 rounds (default 50)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: time-based)")
    ap.add_argument("--rate", type=float, default=25.0, help="flows/s through socks5 (default 25)")
    ap.add_argument(
        "--early-kill-fraction",
        type=float,
        default=0.15,
        help="share of rounds killed 0-0.3 s after start (default 0.15)",
    )
    ap.add_argument("--start-timeout", type=float, default=10.0, help="s allowed per start")
    ap.add_argument("--drain-timeout", type=float, default=60.0, help="s allowed for final drain")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the outbox and JSONL file")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = int(time.time()) & 0xFFFFFF
    if not 1 <= args.rounds <= 1000 or not 0 < args.rate <= 500:
        ap.error("--rounds must be 1..1000 and --rate 0..500")
    res = run(args)
    print(report(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
