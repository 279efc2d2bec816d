"""Cost of one flow actor: pykka ThreadingActor versus spliceway's LoopActor.

Measures start+stop latency and the RSS each live actor adds, with N actors
alive at once. Run: python benchmarks/bench_actor_start.py [N]
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pykka
from run_e2e import proc_rss_kib

from spliceway.actors.dispatcher import Dispatcher, LoopActor


class Threaded(pykka.ThreadingActor):
    def on_receive(self, message):
        return message


class Looped(LoopActor):
    def on_receive(self, message):
        return message


def measure(name: str, start, n: int) -> None:
    gc.collect()
    before = proc_rss_kib(os.getpid())
    t0 = time.perf_counter()
    refs = [start() for _ in range(n)]
    for r in refs:
        r.ask(1, timeout=10)
    t1 = time.perf_counter()
    after = proc_rss_kib(os.getpid())
    threads = threading.active_count()
    for r in refs:
        r.stop(timeout=10)
    t2 = time.perf_counter()
    print(
        f"{name:14s} n={n}: start+first ask {1e6 * (t1 - t0) / n:7.1f} us/actor, "
        f"stop {1e6 * (t2 - t1) / n:7.1f} us/actor, RSS {(after - before) / n:6.2f} KiB/actor, "
        f"threads alive {threads}"
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    dispatcher = Dispatcher()
    dispatcher.start()
    measure("LoopActor", lambda: Looped.start(dispatcher), n)
    measure("ThreadingActor", Threaded.start, n)
    dispatcher.stop()


if __name__ == "__main__":
    main()
