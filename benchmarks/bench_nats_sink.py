#!/usr/bin/env python3
"""NATS JetStream sink: events/s draining the durable outbox, against the webhook sink in the
same run.

    python benchmarks/bench_nats_sink.py [--quick] [--flows 20000] [--profile]

One engine (``python -m spliceway run -c <tmp config>``, launched as in run_e2e.py) with a
socks5 inbound, the control API, ``api.outbox_path`` in the run's temporary directory and
two sinks subscribed to every event type: a ``webhook`` sink whose port has no listener yet
and a ``nats`` sink whose ``nats-server`` is not started yet (both back off 50..200 ms,
bench_connector's dispatcher).  loadgen drives ``--flows`` short connections through the
socks5 inbound (3 events each), so both outboxes pile up a backlog (``pending`` in GET
/api/v1/sinks, waited until steady).  Then, one sink at a time in the same engine:

1. **webhook**: a ``hookserver`` (C, keep-alive HTTP/1.1, answers 200, records every
   event_id) starts on the webhook's port;
2. **nats**: ``nats-server -js`` starts on the NATS sink's port (tests/helpers/nats.py),
   the stream capturing the subject is created (file storage, 2 min duplicate window), and
   the clock starts once it exists.

For each: ``total_delivered`` polled every 0.25 s -> events/s over the steady part (10 % ..
90 % of the backlog), overall (backlog / time to deliver it all), median and worst second,
the engine's CPU s per 1,000 deliveries (utime+stime from /proc) and the receiver's CPU.
Afterwards (both sinks caught up): the stream's messages against the NATS sink's
``total_delivered``, unique ``Nats-Msg-Id`` headers (JetStream's duplicate window) and their
equality with each body's ``event_id``; the hookserver's ids (unique, duplicates,
contiguous sequences) against the webhook's ``total_delivered``; and that both sinks got
the same event ids.  Target: >= 10,000 events/s per sink for NATS.

``--profile`` runs ``py-spy record`` (raw collapsed stacks, all threads, non-blocking) on
the engine during the NATS drain and lists the hottest functions (the drain is slower
while it samples; use it in a separate run from the figures).

Prints a table and writes benchmarks/results/<timestamp>-nats-sink.json (every sample, the
config, the git revision) and the engine's log beside it.  Every server listens on
127.0.0.1; every loop is bounded in count and time; only processes this script started are
stopped, by pid.  See benchmarks/README.md ("NATS sink").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nats
from nats.js.api import AckPolicy, ConsumerConfig

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.append(str(BENCH.parent))  # for tests.helpers.nats

import bench_connector as bn  # noqa: E402  (engine, hookserver, backlog, drain maths, ids)
import bench_control as bc  # noqa: E402
import run_e2e as e2e  # noqa: E402
from run_e2e import log  # noqa: E402

from tests.helpers.nats import NatsServer, add_stream  # noqa: E402

TARGET_EVENTS_PER_S = 10000.0
SUBJECT = "spliceway.bench.events"
STREAM = "SPLICEWAY_BENCH"


async def _read_stream(url: str) -> dict:
    """Every message of the stream through an ephemeral pull consumer (no acks)."""
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream(timeout=10)
        info = await js.stream_info(STREAM)
        total = info.state.messages
        sub = await js.pull_subscribe(
            SUBJECT, stream=STREAM, config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        ids: list[str | None] = []
        body_mismatch = 0
        end = time.monotonic() + 300
        while len(ids) < total and time.monotonic() < end:
            for m in await sub.fetch(min(1024, total - len(ids)), timeout=10):
                mid = (m.headers or {}).get("Nats-Msg-Id")
                ids.append(mid)
                if json.loads(m.data).get("event_id") != mid:
                    body_mismatch += 1
        await sub.unsubscribe()
    finally:
        await nc.close()
    counts = collections.Counter(ids)
    return {
        "messages": total,
        "bytes": info.state.bytes,
        "first_seq": info.state.first_seq,
        "last_seq": info.state.last_seq,
        "read": len(ids),
        "unique_msg_ids": len(counts),
        "missing_msg_id_header": counts.get(None, 0),
        "duplicate_msg_ids": len(ids) - len(counts),
        "body_event_id_mismatch": body_mismatch,
        "ids": sorted(i for i in counts if i),
    }


class Bench(bn.Bench):
    """bench_connector's processes and backlog, plus a nats-server."""

    def __init__(self, args: argparse.Namespace, tools: dict[str, Path], tmp: Path) -> None:
        super().__init__(args, tools, tmp)
        self.nats: NatsServer | None = None
        self.spy: subprocess.Popen | None = None

    def our_pids(self) -> list[int]:
        proc = self.nats.proc if self.nats else None
        return super().our_pids() + ([proc.pid] if proc else [])

    def reap(self) -> None:
        if self.spy is not None:
            e2e.stop_child(self.spy, 10)
        super().reap()
        if self.nats is not None:
            self.nats.stop()

    def drain(self, e: bn.Engine, idx: int, start: Callable[[], int]) -> dict:
        """Sink ``idx``'s backlog is its pending now; ``start()`` brings its receiver up and
        returns the receiver's pid; the clock starts then.  total_delivered is polled every
        0.25 s until the backlog is delivered and pending is back to <= 2; the rates."""
        a = self.a
        s0 = e.sinks()[idx]
        d0, backlog = s0["total_delivered"], s0["pending"]  # nothing delivers before start()
        c0, m0, pt0 = e.cpu(), e2e.machine_cpu()[0], e2e.proc_table()
        receiver_pid = start()
        t0 = time.monotonic()
        r0 = e2e.pids_cpu_s([receiver_pid])
        samples: list[dict] = []
        series: list = []
        end = t0 + a.drain_timeout
        drained = False
        last_progress, last_n = time.monotonic(), -1
        while time.monotonic() < end:
            s = e.sinks()[idx]
            now = time.monotonic()
            n = s["total_delivered"] - d0
            samples.append({"t": round(1000 * (now - t0)), "requests": n})
            series.append([round(now - t0, 3), s["pending"], n, s["total_failed"]])
            if n != last_n:
                last_n, last_progress = n, now
            if n >= backlog and s["pending"] <= 2:
                drained = True
                break
            if now - last_progress > 30:
                break
            time.sleep(bn.POLL_S)
        c1, r1, m1 = e.cpu(), e2e.pids_cpu_s([receiver_pid]), e2e.machine_cpu()[0]
        pt1 = e2e.proc_table()
        delivered = samples[-1]["requests"] if samples else 0
        rates = bn.drain_rates(samples, backlog)
        return {
            "backlog": backlog,
            "drained": drained,
            "delivered": delivered,
            **rates,
            "engine_cpu_s": round(c1 - c0, 3),
            "engine_cpu_s_per_1k": round(1000 * (c1 - c0) / delivered, 4) if delivered else None,
            "receiver_cpu_s": round(r1 - r0, 3),
            "machine_cpu_s": round(m1 - m0, 2),
            "top_cpu": e2e.top_cpu(pt0, pt1, {os.getpid(), *self.our_pids()}),
            "series": series,
        }

    def start_profile(self, pid: int) -> Path | None:
        exe = shutil.which("py-spy") or self.a.py_spy
        if not exe or not Path(exe).exists():
            log("  --profile: py-spy not found (pip install py-spy, or --py-spy PATH)")
            return None
        out = self.tmp / "nats-drain.pyspy.txt"
        cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--threads"]
        cmd += ["--nonblocking", "--rate", str(self.a.profile_rate), "--output", str(out)]
        self.spy = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=e2e.preexec,
        )
        time.sleep(1.0)  # py-spy attaches
        return out

    def stop_profile(self, out: Path | None) -> dict | None:
        spy, self.spy = self.spy, None
        if spy is None or out is None:
            return None
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            e2e.stop_child(spy, 5)
            err = ""
        if not out.exists():
            return {"error": (err or "")[-500:]}
        return summarise_profile(out, self.a.profile_top)

    def run(self) -> dict:
        a = self.a
        hook_port = e2e.free_port()
        self.nats = NatsServer(self.tmp / "nats-store")
        sinks = [
            bn.webhook("hook", hook_port, []),
            {
                "type": "nats",
                "tag": "nats",
                "servers": [self.nats.url],
                "subject": SUBJECT,
                "events": [],
            },
        ]
        outbox = self.tmp / "outbox"
        outbox.mkdir()
        cfg = bn.engine_config(sinks, outbox)
        # No stats.sampled: after the flows, no event arrives, so the backlog is exact and
        # the stream and the receiver can be compared with the sinks' counts at the end.
        cfg["runtime"]["stats_interval_ms"] = 3_600_000
        out: dict = {"config": cfg, "outbox_fs": bn.fs_type(outbox)}
        e = self.engine("engine-nats", cfg)
        names = [s["name"] for s in e.sinks()]
        if names != ["hook", "nats"]:
            raise SystemExit(f"GET /sinks lists {names}, expected ['hook', 'nats']")
        try:
            log(f"  building a backlog: {a.flows} flows, webhook receiver and nats-server down ...")
            b = self.backlog(e, a.flows)
            out["backlog"] = b
            out["outbox_bytes"] = bn.du_bytes(outbox)
            log(
                f"  backlog: {b['flows']} flows at {b['conn_per_s']:.0f}/s, pending "
                f"{b['pending']} (steady: {b['steady']}), outbox {out['outbox_bytes'] >> 20} MiB; "
                f"last_error {[s['last_error'] for s in b['sinks']]}"
            )
            # ---- 1. webhook
            ids = self.tmp / "hook-ids.txt"
            hooks: list[bn.Hook] = []

            def start_hook() -> int:
                hooks.append(self.hook(hook_port, ids, a.drain_timeout + 600))
                return hooks[0].pid

            log("  draining the webhook sink into hookserver ...")
            out["webhook"] = w = self.drain(e, 0, start_hook)
            log(f"  webhook: {brief(w)}")
            hook = hooks[0]
            # ---- 2. nats
            nats_server = self.nats
            prof: list[Path | None] = []

            def start_nats() -> int:
                nats_server.start()
                if a.profile:  # attached before the stream exists: the whole drain is sampled
                    prof.append(self.start_profile(e.pid))
                add_stream(nats_server.url, STREAM, [SUBJECT])
                assert nats_server.proc is not None
                return nats_server.proc.pid

            log(f"  starting nats-server, creating stream {STREAM}, draining the nats sink ...")
            out["nats"] = n = self.drain(e, 1, start_nats)
            if a.profile:
                out["profile"] = self.stop_profile(prof[0] if prof else None)
            log(f"  nats: {brief(n)}")
            # ---- checks, once both sinks have caught up
            e.wait_idle()
            _, final, settled = self.wait_pending(e, 0, 60, stable_s=1.0)
            out["settled"] = settled
            out["sinks_final"] = [bn.sink_brief(s) for s in final]
            out["receiver"] = self.stop_hook(hook)
            out["hook_ids"] = bn.check_ids(ids, final[0]["total_delivered"], contiguous=True)
            stream = asyncio.run(_read_stream(self.nats.url))
            nats_ids = set(stream.pop("ids"))
            stream["nats_total_delivered"] = final[1]["total_delivered"]
            stream["messages_minus_delivered"] = stream["messages"] - final[1]["total_delivered"]
            stream["messages_minus_backlog"] = stream["messages"] - n["backlog"]
            out["stream"] = stream
            hook_ids = set(ids.read_text().split()) if ids.exists() else set()
            out["same_ids"] = {
                "in_nats_not_webhook": len(nats_ids - hook_ids),
                "in_webhook_not_nats": len(hook_ids - nats_ids),
            }
            log(f"  stream: {stream}; ids {out['same_ids']}")
        finally:
            out["engine_stop"] = self.stop_engine(e)
        return out


def brief(d: dict) -> str:
    return (
        f"backlog {d['backlog']}, drained={d['drained']}: steady {d['steady_per_s']} ev/s, "
        f"overall {d['overall_per_s']} ev/s (first after {d['t_first_s']} s, done at "
        f"{d['t_done_s']} s), engine {d['engine_cpu_s_per_1k']} CPU s/1k, receiver "
        f"{d['receiver_cpu_s']} s"
    )


def summarise_profile(path: Path, top: int) -> dict:
    """py-spy's raw output (``frame;frame;... count`` per line, the thread first): samples
    per thread, and per function the samples where it is on top (self) and anywhere
    (inclusive), over the busiest thread and over all threads."""
    threads: collections.Counter[str] = collections.Counter()
    self_all: collections.Counter[str] = collections.Counter()
    incl_all: collections.Counter[str] = collections.Counter()
    per_thread: dict[str, tuple[collections.Counter, collections.Counter]] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        total += n
        threads[thread] += n
        s, i = per_thread.setdefault(thread, (collections.Counter(), collections.Counter()))
        if frames:
            self_all[frames[-1]] += n
            s[frames[-1]] += n
        for f in set(frames):
            incl_all[f] += n
            i[f] += n
    out: dict = {
        "samples": total,
        "threads": [[t, c] for t, c in threads.most_common(12)],
        "self_all": [[f, c] for f, c in self_all.most_common(top)],
        "inclusive_all": [[f, c] for f, c in incl_all.most_common(top)],
        "per_thread": {},
    }
    for t, _ in threads.most_common(4):
        s, i = per_thread[t]
        out["per_thread"][t] = {
            "self": [[f, c] for f, c in s.most_common(top)],
            "inclusive": [[f, c] for f, c in i.most_common(top)],
        }
    return out


# --------------------------------------------------------------------------- report


def report(res: dict) -> str:
    meta = res["meta"]
    L = bc.header("NATS sink", meta)
    r = res.get("run") or {}
    b = r.get("backlog")
    if b:
        L += [
            "",
            f"backlog: {b['flows']} flows through the socks5 inbound ({b['conn_per_s']:.0f}/s, "
            f"{b['errors']} errors), pending per sink {b['pending']}, outbox "
            f"{r['outbox_bytes'] >> 20} MiB on {r['outbox_fs']}",
            "",
            f"   {'sink':<8}{'backlog':>8}{'steady ev/s':>12}{'overall':>9}{'median s':>9}"
            f"{'worst s':>8}{'first s':>8}{'done s':>7}{'eng s/1k':>9}{'recv cpu s':>11}",
        ]
        for name in ("webhook", "nats"):
            d = r.get(name)
            if not d:
                continue
            L.append(
                f"   {name:<8}{d['backlog']:>8}{bn.f0(d['steady_per_s']):>12}"
                f"{bn.f0(d['overall_per_s']):>9}{bn.f0(d['median_second_per_s']):>9}"
                f"{bn.f0(d['worst_second_per_s']):>8}{d['t_first_s'] or 0:>8.2f}"
                f"{d['t_done_s'] or 0:>7.2f}{d['engine_cpu_s_per_1k'] or 0:>9.3f}"
                f"{d['receiver_cpu_s']:>11.2f}"
            )
        n = r.get("nats") or {}
        if n.get("steady_per_s") is not None:
            L.append(
                f"   NATS target >= {TARGET_EVENTS_PER_S:.0f} ev/s: "
                + bc.ok((n["steady_per_s"] or 0) >= TARGET_EVENTS_PER_S)
                + " (steady); webhook/nats in the same engine and run"
            )
        L.append(
            "   steady = 80 % of the backlog / time from 10 % to 90 % delivered; overall = backlog"
            " / time to the last one; median/worst s = 1 s windows in the steady part; first s = "
            "first delivery after the receiver was up (for nats: after the stream existed)"
        )
    st = r.get("stream")
    if st:
        h = r.get("hook_ids") or {}
        L += [
            "",
            f"stream {STREAM}: {st['messages']} messages ({st['bytes'] >> 20} MiB, seq "
            f"{st['first_seq']}..{st['last_seq']}), {st['unique_msg_ids']} unique Nats-Msg-Id, "
            f"{st['duplicate_msg_ids']} duplicates, {st['missing_msg_id_header']} without the "
            f"header, {st['body_event_id_mismatch']} whose body's event_id differs; "
            f"messages - nats total_delivered = {st['messages_minus_delivered']}, "
            f"- backlog at drain start = {st['messages_minus_backlog']}",
            f"hookserver: {h.get('unique')} unique ids, {h.get('duplicates')} duplicates, "
            f"sequence gaps {h.get('seq_gaps')} (seq {h.get('first_seq')}..{h.get('last_seq')}), "
            f"unique - webhook total_delivered = {h.get('unique_minus_delivered')}",
            f"same ids in both sinks: {r['same_ids']}",
        ]
    prof = r.get("profile")
    if prof and "samples" in prof:
        L += ["", f"py-spy during the NATS drain: {prof['samples']} samples; threads:"]
        L += [f"   {c:>7}  {t}" for t, c in prof["threads"][:6]]
        for t, d in prof["per_thread"].items():
            L.append(f"   thread {t}: self")
            L += [f"     {c:>7}  {f}" for f, c in d["self"][:10]]
            L.append(f"   thread {t}: inclusive")
            L += [f"     {c:>7}  {f}" for f, c in d["inclusive"][:14]]
    L.extend(e2e.notes_section(res))
    return "\n".join(L)


def collect_notes(res: dict) -> list[str]:
    notes: list[str] = []
    r = res.get("run") or {}
    b = r.get("backlog") or {}
    if b and not b.get("steady"):
        notes.append("pending was still growing when the drains started")
    for name in ("webhook", "nats"):
        d = r.get(name) or {}
        if d and not d["drained"]:
            notes.append(f"{name}: the backlog did NOT drain within --drain-timeout")
        others = [t for t in d.get("top_cpu", []) if not t["ours"] and t["cpu_s"] > 0.5]
        if others:
            notes.append(
                f"{name} drain: other processes' CPU "
                + ", ".join(f"{t['name']} {t['cpu_s']:.1f} s" for t in others[:4])
            )
    st = r.get("stream") or {}
    for k in ("duplicate_msg_ids", "missing_msg_id_header", "body_event_id_mismatch"):
        if st.get(k):
            notes.append(f"stream: {k} = {st[k]}")
    if st and st.get("messages_minus_delivered"):
        notes.append(f"stream messages - nats total_delivered = {st['messages_minus_delivered']}")
    h = r.get("hook_ids") or {}
    for k in ("duplicates", "seq_gaps", "unique_minus_delivered"):
        if h.get(k):
            notes.append(f"hookserver: {k} = {h[k]}")
    if any((r.get("same_ids") or {}).values()):
        notes.append(f"the two sinks' ids differ: {r['same_ids']}")
    for s in r.get("sinks_final") or []:
        if s["replay_gaps"]:
            notes.append(f"{s['name']}: replay_gaps {s['replay_gaps']}")
    for name, st in sorted((res.get("engine_stops") or {}).items()):
        notes += e2e.stop_notes(st, f"{name}: ", "engine")
    return notes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5,000 flows")
    ap.add_argument("--flows", type=int, help="backlog flows (default 20000, quick 5000)")
    ap.add_argument("--backlog-max-seconds", type=float, default=120.0)
    ap.add_argument("--settle-timeout", type=float, default=120.0)
    ap.add_argument("--drain-timeout", type=float, default=300.0)
    ap.add_argument("--profile", action="store_true", help="py-spy record the NATS drain")
    ap.add_argument("--py-spy", default="", help="py-spy's path when it is not on PATH")
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--loadgen-threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--out", type=Path, default=e2e.RESULTS)
    a = ap.parse_args(argv)
    a.flows = a.flows or (5000 if a.quick else 20000)
    # bench_connector.Bench's other settings (no quiet waits here: one drain each)
    a.tick_ms, a.quiet_wait, a.quiet_threshold, a.quiet_budget = 100, 0.0, 0.1, 0.0
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    tools, stamp, base = bn.start_run(a, "nats-sink")
    t_start = time.monotonic()
    nats_version = subprocess.run(
        ["nats-server", "--version"], capture_output=True, text=True
    ).stdout.strip()
    res: dict = {
        "meta": {
            "timestamp": stamp,
            "quick": a.quick,
            "flows": a.flows,
            "profile": a.profile,
            "dispatcher": bn.DISPATCHER,
            "nats_server": nats_version,
            **e2e.host_meta(),
            "git": e2e.git_info(),
            "loadavg_before": os.getloadavg(),
        }
    }
    with tempfile.TemporaryDirectory(prefix="sw-bench-nats-") as tmpd:
        b = Bench(a, tools, Path(tmpd))
        old_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
        try:
            b.server = e2e.Server(tools["tinyserver"], None, 3600, a.server_threads)
            res["run"] = b.run()
        finally:
            b.close(base, res, old_term)
            spy = Path(tmpd) / "nats-drain.pyspy.txt"
            if spy.exists():
                shutil.copy(spy, f"{base}.pyspy.txt")
    return bn.publish_run(res, base, t_start, report, collect_notes)


if __name__ == "__main__":
    sys.exit(main())
