"""Python's cost per flow the C path runs, without sockets: records in, events out.

A started engine's relay bridge is fed synthetic C lifecycle records (STARTED, then
ROUTED) and a relay completion for each flow, on the dispatcher thread, exactly as
``RelayBridge`` delivers real ones; each flow then has its FlowActor, its record and
its flow.started, flow.routed and flow.completed events. What is measured is the
dispatcher thread's CPU time per flow, in batches of the given size (the bridge
drains records in batches under load). ``--profile`` prints a cProfile table.

Run: python benchmarks/bench_flow_records.py [--flows 20000] [--batch 64] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

from spliceway import Engine
from spliceway.native.conn import ROUTED, STARTED, ConnRecord
from spliceway.native.relay import Cause, Completion, Counters

CONFIG = {
    "inbounds": [{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}],
    "outbounds": [{"tag": "direct", "protocol": "direct"}],
    "runtime": {"log_level": "warn"},
    "api": {"control": {"enabled": False}, "ipc": {"enabled": False}},
}


def record(kind: int, flow: int, epoch: int, handle: int = 0) -> ConnRecord:
    """A C record of a socks5 flow to 127.0.0.1:8080 routed by the final rule to direct."""
    routed = kind != STARTED
    return ConnRecord(
        flow, int(time.time() * 1000), handle, epoch if routed else 0, kind, 0, 0xFFFFFFFF,
        -1, 0 if routed else -1, 1 if routed else 0, 23, 12 if routed else 2, 0, 0, 0, 0, 0,
        0, 8080, 40000 + flow % 20000, 8080 if routed else 0, "socks5", 0, "127.0.0.1",
        "127.0.0.1" if routed else None, False, routed, "" if routed else "127.0.0.1",
    )  # fmt: skip


def run(engine: Engine, flows: int, batch: int) -> float:
    """Feed ``flows`` synthetic flows; the dispatcher's CPU seconds it took."""
    core = engine.core
    bridge = core.bridge
    epoch = core.routes._epoch
    counters = Counters(100, 1024, 1024, 100, int(time.time() * 1000))

    def one_batch(first: int) -> None:
        ids = range(first, first + batch)
        for i in ids:
            bridge._on_record(record(STARTED, i, epoch))
        for i in ids:
            bridge._on_record(record(ROUTED, i, epoch, handle=(1 << 40) + i))
        for i in ids:
            bridge._deliver(Completion((1 << 40) + i, Cause.DONE, 0, None, counters))

    def timed() -> float:
        t0 = time.thread_time()
        for first in range(1, flows + 1, batch):
            one_batch(first)
        return time.thread_time() - t0

    return core.dispatcher.run_sync(timed, timeout=600)


def main(argv: list[str] | None = None) -> int:
    """Measure and print µs of dispatcher CPU per flow."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flows", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    engine = Engine(CONFIG)
    engine.start()
    try:
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 50, 100)  # as `spliceway run` does
        run(engine, 2000, args.batch)  # warm-up
        cpu = run(engine, args.flows, args.batch)
        print(f"{1e6 * cpu / args.flows:.1f} us of dispatcher CPU per flow ({args.flows} flows)")
        if args.profile:
            prof = cProfile.Profile()
            engine.core.dispatcher.run_sync(prof.enable)
            run(engine, args.flows, args.batch)
            engine.core.dispatcher.run_sync(prof.disable)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
            print(out.getvalue())
        if len(engine.core.flows):
            print(f"warning: {len(engine.core.flows)} flows still open", file=sys.stderr)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
