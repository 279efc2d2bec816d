"""The relay's thread-safety: adds, closes, counter reads and shutdown from many threads."""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable

import pytest

from spliceway.native.relay import Cause, Completion, RelayError
from tests.csrc import test_relay as base
from tests.csrc.test_relay import Env, Link, recv_exact, run

make_env = base.make_env  # the fixture, shared with test_relay.py

THREADS = 8


def run_threads(target: Callable[[int], None]) -> None:
    """Runs target(i) for i < THREADS on threads of their own (see run)."""
    run(*(functools.partial(target, i) for i in range(THREADS)))


def test_concurrent_add_close_and_counters(make_env: Callable[..., Env]) -> None:
    env = make_env(loops=2)
    per_thread = 40
    links = [[env.link() for _ in range(per_thread)] for _ in range(THREADS)]
    handles: list[list[int]] = [[] for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS)

    def worker(i: int) -> None:
        barrier.wait(10)
        for j, link in enumerate(links[i]):
            h = env.add(link, idle_timeout_ms=0 if j % 3 else 30_000)
            handles[i].append(h)
            if j % 2:
                assert env.relay.request_close(h) is True
            else:
                c = env.relay.counters(h)
                assert c is not None
                assert c[:4] == (0, 0, 0, 0)
        assert len(env.relay.counters_many(handles[i])) == per_thread

    run_threads(worker)
    all_handles = [h for hs in handles for h in hs]
    assert len(set(all_handles)) == THREADS * per_thread

    closed = {h for hs in handles for h in hs[1::2]}
    done = env.completions(closed)
    assert all(c.cause is Cause.CLOSED for c in done.values())

    # The survivors still relay, exactly.
    survivors = [
        (h, link)
        for i in range(THREADS)
        for h, link in zip(handles[i][::2], links[i][::2], strict=True)
    ]
    for k, (_h, link) in enumerate(survivors):
        link.client.sendall(b"u" * (k + 1))
        link.server.sendall(b"d" * (2 * k + 1))
    for k, (_h, link) in enumerate(survivors):
        assert recv_exact(link.server, k + 1) == b"u" * (k + 1)
        assert recv_exact(link.client, 2 * k + 1) == b"d" * (2 * k + 1)
        link.client.close()
        link.server.close()
    done = env.completions([h for h, _ in survivors])
    for k, (h, _link) in enumerate(survivors):
        assert done[h].cause is Cause.DONE
        assert done[h].counters[:4] == (k + 1, 2 * k + 1, 2 * k + 1, k + 1)
    assert env.relay.active_count() == 0


def test_many_threads_close_the_same_flow(make_env: Callable[..., Env]) -> None:
    env = make_env(loops=2)
    for _round in range(20):
        link = env.link()
        h = env.add(link)
        barrier = threading.Barrier(THREADS)
        results: list[bool] = []

        def closer(
            _i: int,
            h: int = h,
            barrier: threading.Barrier = barrier,
            results: list[bool] = results,
        ) -> None:
            barrier.wait(10)
            results.append(env.relay.request_close(h))

        run_threads(closer)
        assert any(results)  # at least the first one found it open
        assert env.completion(h).cause is Cause.CLOSED
        assert env.relay.request_close(h) is False


def test_close_races_adds_and_waiters(make_env: Callable[..., Env]) -> None:
    env = make_env(loops=2)
    per_thread = 30
    links: list[list[Link]] = [[env.link() for _ in range(per_thread)] for _ in range(THREADS)]
    added: list[list[int]] = [[] for _ in range(THREADS)]
    refused: list[int] = []
    reaped: list[Completion] = []
    barrier = threading.Barrier(THREADS + 2)

    def adder(i: int) -> None:
        barrier.wait(10)
        for link in links[i]:
            try:
                added[i].append(env.add(link, idle_timeout_ms=50))
            except RelayError as e:
                # A refused add leaves the fds with us.
                os.close(link.cfd)
                os.close(link.ufd)
                refused.append(e.errno)

    def reaper() -> None:
        barrier.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = env.relay.wait(None)
            reaped.extend(got)
            if not got and env.relay.closed:
                return

    def closer() -> None:
        barrier.wait(10)
        time.sleep(0.002)
        env.relay.close()

    workers = [threading.Thread(target=adder, args=(i,)) for i in range(THREADS)]
    workers += [threading.Thread(target=reaper), threading.Thread(target=closer)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(30)
    assert not any(t.is_alive() for t in workers)

    reaped.extend(env.relay.drain())
    handles = [h for hs in added for h in hs]
    assert len(handles) + len(refused) == THREADS * per_thread
    assert set(refused) <= {errno.ESHUTDOWN}
    by_handle = {c.handle: c for c in reaped}
    assert len(by_handle) == len(reaped), "a flow completed twice"
    assert set(by_handle) == set(handles), "every added flow completes exactly once"
    assert {c.cause for c in reaped} <= {Cause.SHUTDOWN, Cause.IDLE}
    assert env.relay.active_count() == 0


@pytest.mark.parametrize("loops", [1, 3])
def test_churn_with_concurrent_samplers(make_env: Callable[..., Env], loops: int) -> None:
    env = make_env(loops=loops, capacity=64)
    stop = threading.Event()
    live: list[int] = []
    lock = threading.Lock()

    def sampler(_i: int) -> None:
        while not stop.is_set():
            with lock:
                snapshot = list(live)
            for c in env.relay.counters_many(snapshot):
                # A recycled slot must never leak another flow's numbers.
                assert c is None or (c.client_rx <= 3 and c.upstream_tx <= 3)
            # Give the GIL up between samples: two threads spinning on it starved the
            # churning thread (74-89 s for 200 flows); C still runs both concurrently.
            time.sleep(0.0002)

    samplers = [threading.Thread(target=sampler, args=(i,)) for i in range(2)]
    for t in samplers:
        t.start()
    try:
        for _round in range(10):
            batch = [env.link() for _ in range(20)]
            hs = [env.add(link) for link in batch]
            with lock:
                live[:] = hs
            for link in batch:
                link.client.sendall(b"abc")
            for link in batch:
                assert recv_exact(link.server, 3) == b"abc"
            for h in hs[::2]:
                env.relay.request_close(h)
            for link in batch[1::2]:
                link.client.close()
                link.server.close()
            done = env.completions(hs)
            assert all(c.counters.client_rx == 3 for c in done.values())
            for link in batch[::2]:
                link.client.close()
                link.server.close()
    finally:
        stop.set()
        for t in samplers:
            t.join(10)
