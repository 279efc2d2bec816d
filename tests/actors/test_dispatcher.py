"""LoopActor keeps Pykka's semantics while sharing one dispatcher thread."""

from __future__ import annotations

import threading

import pykka
import pytest

from spliceway.actors.dispatcher import Dispatcher, LoopActor


class Counter(LoopActor):
    def __init__(self, dispatcher, log):
        super().__init__(dispatcher)
        self.log = log
        self.value = 0

    def on_start(self):
        self.log.append(("start", threading.current_thread().name))

    def on_receive(self, message):
        if message == "boom":
            raise RuntimeError("boom")
        self.value += message
        return self.value

    def add(self, n):
        self.value += n
        return self.value

    def on_stop(self):
        self.log.append(("stop", self.value))


@pytest.fixture
def dispatcher():
    d = Dispatcher("test-dispatcher")
    d.start()
    yield d
    pykka.ActorRegistry.stop_all(timeout=5)
    d.stop()


def test_messages_run_in_order_on_the_dispatcher_thread(dispatcher):
    log = []
    ref = Counter.start(dispatcher, log)
    for i in range(1, 101):
        ref.tell(i)
    assert ref.ask(0, timeout=5) == 5050
    assert ref.proxy().add(1).get(timeout=5) == 5051
    ref.stop(timeout=5)
    assert log == [("start", "test-dispatcher"), ("stop", 5051)]
    assert not ref.is_alive()


def test_many_actors_share_one_thread(dispatcher):
    before = threading.active_count()
    refs = [Counter.start(dispatcher, []) for _ in range(500)]
    assert [r.ask(1, timeout=5) for r in refs] == [1] * 500
    assert threading.active_count() == before
    for r in refs:
        r.stop(timeout=5)


def test_concurrent_tells_from_many_threads_are_all_handled(dispatcher):
    ref = Counter.start(dispatcher, [])
    barrier = threading.Barrier(8)

    def tell_many():
        barrier.wait()
        for _ in range(1000):
            ref.tell(1)

    threads = [threading.Thread(target=tell_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ref.ask(0, timeout=5) == 8000
    ref.stop(timeout=5)


def test_ask_failure_reaches_the_caller_and_actor_survives(dispatcher):
    ref = Counter.start(dispatcher, [])
    with pytest.raises(RuntimeError, match="boom"):
        ref.ask("boom", timeout=5)
    assert ref.ask(2, timeout=5) == 2
    ref.stop(timeout=5)


def test_tell_failure_stops_the_actor_and_pending_asks_fail(dispatcher):
    ref = Counter.start(dispatcher, [])
    ref.tell("boom")
    with pytest.raises(pykka.ActorDeadError):
        ref.ask(1, timeout=5)
    assert not ref.is_alive()
