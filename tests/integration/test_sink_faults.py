"""Event sinks under faults: receivers that fail, refuse, redirect, hang or reset; the
engine killed with SIGKILL (also between a 2xx and its durable ACK); a torn and corrupted
outbox; a full disk (a real tmpfs) and a ring that evicts while the disk is full.

Every test checks the oracle: each event the engine emitted that the sink selects (read
from the ring, or from the durable outbox bytes) was delivered at least once, every copy
byte-identical with the same event_id; and the exact counters of GET /sinks.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from spliceway.connector.outbox import OutboxStore
from tests.conftest import wait_until
from tests.helpers.flows import curl
from tests.helpers.receiver import Receiver, Reply, group_bodies
from tests.helpers.sinks import (
    EngineProcess,
    assert_at_least_once,
    durable_acked_id,
    expected_body,
    flip_byte,
    flows,
    freeze_process,
    read_ledger_slots,
    read_records,
    ring_events,
    segment_files,
    sink_config,
    sink_dir,
    status_of,
    unread_bytes_from,
    wait_completed,
    webhook,
)
from tests.helpers.upstreams import refused_port

MIB = 1024 * 1024


def hook(engine, name: str = "hook") -> dict:
    return status_of(engine.query("sinks"), name)


def wait_idle(engine, name: str = "hook", timeout: float = 10) -> dict:
    """The sink's item once nothing is pending or in flight."""

    def idle() -> dict | None:
        item = hook(engine, name)
        return item if item["pending"] == 0 and "delivery" not in item else None

    return wait_until(idle, timeout, f"sink {name} idle")


def wait_durable(engine, name: str = "hook", completed: int = 0) -> dict:
    """The ring once it holds ``completed`` flow.completed events and sink ``name``'s
    cursor reached its latest sequence (all accepted)."""

    ring = wait_completed(engine, completed)
    latest = ring["latest_sequence"]
    wait_until(lambda: hook(engine, name)["cursor_sequence"] >= latest, 10, "the cursor")
    return ring


def group_first(requests) -> dict[str, bytes]:
    """The first body of each event_id among ``requests``."""
    out: dict[str, bytes] = {}
    for event_id, bodies in group_bodies(r.body for r in requests).items():
        out[event_id] = bodies[0]
    return out


def expected_from(ring: dict, types: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {e["event_id"]: expected_body(e) for e in ring_events(ring, types)}


# -- answers ----------------------------------------------------------------------------


def test_500_then_429_with_retry_after_then_200(make_engine, tmp_path):
    """A 5xx and a 429 are retried; Retry-After: 1 holds the next attempt back for a
    second (the jittered backoff alone is at most 100 ms); the third attempt is delivered;
    total_failed counts both failures; last_error shows the failure, then clears."""
    with Receiver() as rx:
        rx.script(Reply(500), Reply(429, headers={"Retry-After": "1"}), Reply(200))
        cfg = sink_config(
            [webhook("hook", rx.url)],
            tmp_path / "outbox",
            dispatcher={"backoff_initial_ms": 50, "backoff_max_ms": 2000},
        )
        engine = make_engine(cfg)
        first = rx.wait_for(2)
        waiting = wait_until(
            lambda: (s := hook(engine))["last_error"] == "HTTP 429" and s,
            2,
            "the retry after the 429",
        )
        assert waiting["delivery"]["retry_pending"] == 1
        assert waiting["total_failed"] == 2
        assert waiting["total_delivered"] == 0
        assert waiting["last_failure_at_unix_ms"] is not None
        assert (
            waiting["delivery"]["next_retry_at_unix_ms"] >= waiting["last_failure_at_unix_ms"] + 990
        )
        requests = rx.wait_for(3)
        assert requests[2].at - requests[1].at >= 0.98, "Retry-After: 1 was not honoured"
        assert requests[1].at - first[0].at < 0.5, "the 500 was followed by a short backoff"
        item = wait_idle(engine)
        assert item["total_delivered"] == 1
        assert item["total_failed"] == 2
        assert item["last_error"] is None
        assert item["last_success_at_unix_ms"] >= item["last_failure_at_unix_ms"]
        assert item["total_dead_lettered"] == item["total_discarded"] == item["dead_letters"] == 0
        ring = engine.query("events")
        assert_at_least_once(rx.bodies_by_event_id(), expected_from(ring))
        assert len({r.body for r in requests}) == 1, "the retries carry the same bytes"
        assert len(rx.requests) == 3


@pytest.mark.parametrize(
    ("on_exhausted", "dead", "discarded"),
    [("retry_forever", 1, 0), ("dead_letter", 1, 0), ("discard", 0, 1)],
)
def test_400_is_never_retried(make_engine, origin, tmp_path, on_exhausted, dead, discarded):
    """A 400 gets exactly one request; under retry_forever and dead_letter the event becomes
    a durable dead letter (with its status and exact body), under discard it is counted
    as discarded; the events after it are delivered."""
    outbox = tmp_path / "outbox"
    with Receiver() as rx:
        rx.script(Reply(400, body=b"no"))
        cfg = sink_config(
            [webhook("hook", rx.url)], outbox, dispatcher={"on_exhausted": on_exhausted}
        )
        engine = make_engine(cfg)
        flows(engine, origin, 2)
        ring = wait_durable(engine, completed=2)
        events = ring_events(ring)
        assert len(events) == 7
        rx.wait_for(len(events))
        item = wait_idle(engine)
        assert item["total_delivered"] == len(events) - 1
        assert item["total_failed"] == 1
        assert item["total_dead_lettered"] == dead
        assert item["dead_letters"] == dead
        assert item["total_discarded"] == discarded
        assert item["last_error"] is None
        delivered = rx.bodies_by_event_id()
        assert_at_least_once(delivered, expected_from(ring))
        assert all(len(b) == 1 for b in delivered.values()), "a rejected event was retried"
        assert len(rx.requests) == len(events)
        engine.stop()
    rejected = events[0]
    store = OutboxStore(str(outbox), readonly=True)
    try:
        letters = list(store.open_sink("hook").iter_dead_letters())
    finally:
        store.close()
    assert len(letters) == dead
    if dead:
        meta, body = letters[0]
        assert body == expected_body(rejected)
        assert meta["status"] == 400
        assert meta["reason"] == "HTTP 400"
        assert meta["attempts"] == 1


@pytest.mark.parametrize("on_exhausted", ["retry_forever", "dead_letter", "discard"])
def test_retry_budget_then_on_exhausted(make_engine, tmp_path, on_exhausted):
    """retry_threshold 3 and a receiver answering 500: after exactly 3 attempts the event is
    dead-lettered or discarded; under retry_forever it is attempted again and delivered."""
    with Receiver() as rx:
        rx.script(Reply(500), Reply(500), Reply(500))
        cfg = sink_config(
            [webhook("hook", rx.url)],
            tmp_path / "outbox",
            dispatcher={"retry_threshold": 3, "on_exhausted": on_exhausted},
        )
        engine = make_engine(cfg)
        rx.wait_for(3)
        item = wait_until(
            lambda: (s := hook(engine))["total_failed"] == 3 and "delivery" not in s and s,
            5,
            "the event settled",
        )
        delivered = 1 if on_exhausted == "retry_forever" else 0
        requests = rx.wait_for(3 + delivered)
        assert len({r.body for r in requests}) == 1
        assert item["total_delivered"] == delivered
        assert (
            item["total_dead_lettered"] == item["dead_letters"] == (on_exhausted == "dead_letter")
        )
        assert item["total_discarded"] == (on_exhausted == "discard")
        assert item["pending"] == 0
        assert_at_least_once(
            group_bodies(r.body for r in requests), expected_from(engine.query("events"))
        )
        assert len(rx.requests) == 3 + delivered


def test_retry_after_is_capped_at_backoff_max(make_engine, tmp_path):
    """A 503 with Retry-After: 30 waits at most backoff_max_ms (300 ms), not 30 s."""
    with Receiver() as rx:
        rx.script(Reply(503, headers={"Retry-After": "30"}))
        cfg = sink_config(
            [webhook("hook", rx.url)],
            tmp_path / "outbox",
            dispatcher={"backoff_initial_ms": 50, "backoff_max_ms": 300},
        )
        engine = make_engine(cfg)
        requests = rx.wait_for(2, timeout=5)
        assert 0.25 <= requests[1].at - requests[0].at < 1.5
        item = wait_idle(engine)
        assert item["total_failed"] == 1 and item["total_delivered"] == 1


def test_301_is_not_followed(make_engine, origin, tmp_path):
    """A redirect is a rejection: the Location is never requested, the event is
    dead-lettered after one request, later events are delivered."""
    with Receiver() as rx, Receiver() as elsewhere:
        rx.script(Reply(301, headers={"Location": elsewhere.url}))
        engine = make_engine(sink_config([webhook("hook", rx.url)], tmp_path / "outbox"))
        flows(engine, origin, 1)
        ring = wait_durable(engine, completed=1)
        events = ring_events(ring)
        rx.wait_for(len(events))
        item = wait_idle(engine)
        assert item["total_dead_lettered"] == item["dead_letters"] == 1
        assert item["total_failed"] == 1
        assert item["total_delivered"] == len(events) - 1
        assert elsewhere.requests == []
        assert elsewhere.connections == 0
        delivered = rx.bodies_by_event_id()
        assert_at_least_once(delivered, expected_from(ring))
        assert len(rx.requests) == len(events)


def test_hung_receiver_times_out_and_is_retried(make_engine, tmp_path):
    """A receiver that reads the request and never answers costs request_timeout_ms per
    attempt; the attempt fails as a timeout and is retried; once the receiver answers, the
    same bytes are delivered."""
    with Receiver() as rx:
        rx.script(Reply(hang=True), Reply(hang=True))
        cfg = sink_config(
            [webhook("hook", rx.url)], tmp_path / "outbox", dispatcher={"request_timeout_ms": 300}
        )
        engine = make_engine(cfg)
        rx.wait_for(2)
        failing = hook(engine)
        assert failing["last_error"] == "timeout after 300 ms"
        assert failing["total_failed"] == 1
        requests = rx.wait_for(3)
        for earlier, later in itertools.pairwise(requests):
            assert later.at - earlier.at >= 0.29
        item = wait_idle(engine)
        assert item["total_failed"] == 2
        assert item["total_delivered"] == 1
        assert item["last_error"] is None
        assert_at_least_once(rx.bodies_by_event_id(), expected_from(engine.query("events")))
        assert len(rx.requests) == 3


def test_reset_mid_response_is_retried(make_engine, tmp_path):
    """Half a status line, then a TCP reset: the attempt fails and the event is
    delivered by the retry, with the same bytes."""
    with Receiver() as rx:
        rx.script(Reply(reset=True))
        engine = make_engine(sink_config([webhook("hook", rx.url)], tmp_path / "outbox"))
        requests = rx.wait_for(2)
        item = wait_idle(engine)
        assert item["total_failed"] == 1
        assert item["total_delivered"] == 1
        assert requests[0].body == requests[1].body
        assert_at_least_once(rx.bodies_by_event_id(), expected_from(engine.query("events")))
        assert len(rx.requests) == 2
        assert rx.connections == 2


def test_a_hung_sink_does_not_hold_up_another(make_engine, origin, tmp_path):
    """One receiver hangs for good: the other sink delivers every event meanwhile, while
    the hung one is still in flight with its backlog pending; stop does not wait for it."""
    with Receiver() as stuck, Receiver() as rx:
        stuck.default = Reply(hang=True)
        cfg = sink_config(
            [webhook("stuck", stuck.url), webhook("hook", rx.url)],
            tmp_path / "outbox",
            dispatcher={"request_timeout_ms": 60000},
        )
        engine = make_engine(cfg)
        stuck.wait_for(1)
        flows(engine, origin, 3)
        ring = wait_durable(engine, "stuck", completed=3)
        events = ring_events(ring)
        rx.wait_for(len(events))
        item = wait_idle(engine)
        assert item["total_delivered"] == len(events)
        assert_at_least_once(rx.bodies_by_event_id(), expected_from(ring))
        blocked = hook(engine, "stuck")
        assert blocked["delivery"]["in_flight"] == 1
        assert blocked["pending"] == len(events)
        assert blocked["total_delivered"] == blocked["total_failed"] == 0
        assert len(stuck.requests) == 1
        started = time.monotonic()
        engine.stop()
        assert time.monotonic() - started < 6, "stop waited for the hung receiver"


# -- SIGKILL ----------------------------------------------------------------------------


def _recovery_after_kill(item: dict) -> None:
    """A SIGKILL loses nothing committed: at most an uncommitted torn tail is cut."""
    recovery = item["outbox_recovery"]
    assert recovery["lost_records"] == 0, recovery
    assert recovery["damaged_regions"] == 0, recovery
    assert recovery["unreadable_segments"] == recovery["damaged_ledger_slots"] == 0, recovery
    if recovery["state"] == "repaired":
        assert recovery["truncated_bytes"] > 0, recovery
    else:
        assert recovery["state"] == "clean", recovery


def _accepted(engine: EngineProcess, sequence: int) -> bool:
    return engine.sink("hook")["cursor_sequence"] >= sequence


def _traffic(port: int, origin, stop: threading.Event) -> None:
    while not stop.is_set():
        curl("--socks5-hostname", f"127.0.0.1:{port}", f"http://127.0.0.1:{origin[1]}/")


def test_sigkill_at_random_moments_loses_no_accepted_event(tmp_path, origin):
    """Three runs of the program are killed with SIGKILL at a random moment while the
    receiver fails, hangs or is slow (so a backlog exists) and flows keep coming; a fourth
    run with a healthy receiver delivers every event any run had accepted, byte-identical
    across duplicates."""
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    note = f"(seed {seed})"
    outbox = tmp_path / "outbox"
    expected: dict[str, bytes] = {}
    answered: set[bytes] = set()  # bodies the receiver answered 200
    slow = Reply(200, before=lambda _request: time.sleep(0.02))
    modes = {"fail": Reply(503), "hang": Reply(hang=True), "slow": slow}
    with Receiver() as rx:
        cfg = sink_config(
            [webhook("hook", rx.url)],
            outbox,
            control=True,
            dispatcher={"request_timeout_ms": 300, "backoff_max_ms": 100},
        )
        for run in range(3):
            mode = rng.choice(sorted(modes))
            rx.default = modes[mode]
            first_request = len(rx.requests)
            engine = EngineProcess(cfg, tmp_path, f"run{run}")
            stop = threading.Event()
            traffic: threading.Thread | None = None
            try:
                engine.wait_started()
                _recovery_after_kill(engine.sink("hook"))
                for _ in range(rng.randint(2, 4)):
                    curl(
                        "--socks5-hostname",
                        f"127.0.0.1:{engine.socks_port}",
                        f"http://127.0.0.1:{origin[1]}/",
                    )
                ring = engine.get("events")
                wait_until(partial(_accepted, engine, ring["latest_sequence"]), 10, note)
                expected.update({e["event_id"]: expected_body(e) for e in ring_events(ring)})
                assert engine.sink("hook")["pending"] > 0 or mode == "slow", note
                # More flows while the kill lands, after a random number of deliveries.
                traffic = threading.Thread(
                    target=_traffic, args=(engine.socks_port, origin, stop), daemon=True
                )
                traffic.start()
                rx.wait_for(len(rx.requests) + rng.randint(0, 3), timeout=20)
                engine.kill()
                # What the dead engine left: every record above the durable ACK is owed;
                # every record at or below it must have been answered 2xx already.
                acked = durable_acked_id(sink_dir(outbox, "hook") / "ledger")
                if mode == "slow":
                    answered.update(r.body for r in rx.requests[first_request:])
                for segment in segment_files(outbox, "hook"):
                    for record in read_records(segment, torn_tail=True):
                        if record.record_id > acked:
                            expected[json.loads(record.payload)["event_id"]] = record.payload
                        else:
                            assert record.payload in answered, f"ACKed, never answered {note}"
            finally:
                stop.set()
                if traffic is not None:
                    traffic.join(30)
                engine.close()
        rx.default = Reply(200)
        final = EngineProcess(cfg, tmp_path, "final")
        try:
            final.wait_started()
            item = final.sink("hook")
            _recovery_after_kill(item)
            wait_until(
                lambda: expected.keys() <= rx.bodies_by_event_id().keys(),
                20,
                f"every accepted event delivered {note}",
            )
            item = wait_until(
                lambda: (s := final.sink("hook"))["pending"] == 0 and s, 10, f"idle {note}"
            )
            assert item["total_dead_lettered"] == item["total_discarded"] == 0
            assert item["replay_gaps"] == 0
            assert_at_least_once(rx.bodies_by_event_id(), expected)
            assert final.stop() == 0
        finally:
            final.close()


def test_sigkill_between_the_2xx_and_the_durable_ack_redelivers(tmp_path, origin):
    """The receiver holds a request, the engine is frozen (SIGSTOP), the receiver's 200
    reaches the engine's socket unread, then SIGKILL: the next run delivers that event again
    with the same event_id and the same bytes; an event acknowledged before is not resent."""
    outbox = tmp_path / "outbox"
    held = threading.Event()
    pid: list[int] = []

    def freeze(_request) -> None:
        freeze_process(pid[0])
        held.set()

    with Receiver() as rx:
        cfg = sink_config([webhook("hook", rx.url)], outbox, control=True)
        first = EngineProcess(cfg, tmp_path, "first")
        pid.append(first.pid)
        client: subprocess.Popen | None = None
        try:
            first.wait_started()
            acked = rx.wait_for(1)[0]  # engine.started
            wait_until(lambda: first.sink("hook")["pending"] == 0, 10, "a durable ACK")
            rx.script(Reply(200, before=freeze))
            # The flow's client is frozen with the engine: it runs on its own and is
            # ended after the kill.
            client = subprocess.Popen(
                [
                    "curl",
                    "-sS",
                    "--max-time",
                    "10",
                    "--socks5-hostname",
                    f"127.0.0.1:{first.socks_port}",
                    f"http://127.0.0.1:{origin[1]}/",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            assert held.wait(10), "the flow's first event never reached the receiver"
            target = rx.requests[1]
            assert json.loads(target.body)["event_type"] == "flow.started"
            wait_until(lambda: unread_bytes_from(rx.port) > 0, 5, "the 200 in the engine's socket")
            assert len(rx.requests) == 2, "the frozen engine went on delivering"
            first.kill()
        finally:
            first.close()
            if client is not None:
                client.kill()
                client.wait()
        target_id = json.loads(target.body)["event_id"]
        second = EngineProcess(cfg, tmp_path, "second")
        try:
            second.wait_started()
            recovery = second.sink("hook")["outbox_recovery"]
            assert recovery["recovered_records"] >= 1
            _recovery_after_kill(second.sink("hook"))
            wait_until(
                lambda: len(rx.bodies_by_event_id().get(target_id, [])) >= 2,
                10,
                "the event redelivered",
            )
            copies = rx.bodies_by_event_id()[target_id]
            assert copies[0] == copies[1] == target.body
            assert len(rx.bodies_by_event_id()[json.loads(acked.body)["event_id"]]) == 1
            assert_at_least_once(rx.bodies_by_event_id(), {target_id: target.body})
            assert second.stop() == 0
        finally:
            second.close()


# -- a damaged outbox -------------------------------------------------------------------


def test_torn_and_corrupted_outbox_is_repaired_and_counted(make_engine, origin, tmp_path):
    """A backlog is left in the outbox (the receiver is down), then a record in the middle
    gets a flipped byte and the tail is cut mid-record. The next start delivers every intact
    event (the bytes the outbox held), counts the lost record and the truncated bytes, and
    runs on; the start after that finds nothing left to resend."""
    outbox = tmp_path / "outbox"
    down = f"http://127.0.0.1:{refused_port()}/hook"
    engine = make_engine(sink_config([webhook("hook", down)], outbox))
    flows(engine, origin, 3)
    ring = wait_durable(engine, completed=3)
    engine.stop()
    [segment] = segment_files(outbox, "hook")
    records = read_records(segment)
    bodies = [r.payload for r in records]
    events = ring_events(ring)
    assert bodies[: len(events)] == [expected_body(e) for e in events]
    assert json.loads(bodies[-1])["event_type"] == "engine.stopped"
    assert [r.record_id for r in records] == list(range(1, len(records) + 1))

    hit = records[len(records) // 2]
    flip_byte(segment, hit.offset + 20 + len(hit.payload) // 2)
    tail = records[-1]
    cut = tail.offset + (tail.end - tail.offset) // 2
    os.truncate(segment, cut)
    intact = {json.loads(r.payload)["event_id"]: r.payload for r in records if r not in (hit, tail)}
    gone = {json.loads(r.payload)["event_id"] for r in (hit, tail)}

    with Receiver() as rx:
        second = make_engine(sink_config([webhook("hook", rx.url)], outbox))
        recovery = hook(second)["outbox_recovery"]
        assert recovery == {
            "state": "repaired",
            "recovered_records": len(records) - 2,
            "lost_records": 1,
            "damaged_regions": 1,
            "truncated_bytes": cut - tail.offset,
            "damaged_ledger_slots": 0,
            "unreadable_segments": 0,
            "errors": [],
        }
        # ...and it runs on: its own events after the recovered ones.
        flows(second, origin, 1)
        ring2 = wait_durable(second, completed=1)
        own = expected_from(ring2)
        rx.wait_for(len(intact) + len(own))
        item = wait_idle(second)
        assert item["total_delivered"] == len(intact) + len(own)
        delivered = rx.bodies_by_event_id()
        assert_at_least_once(delivered, {**intact, **own})
        assert not gone & delivered.keys()
        assert all(len(b) == 1 for b in delivered.values())
        second.stop()
        before = len(rx.requests)

        third = make_engine(sink_config([webhook("hook", rx.url)], outbox))
        recovery = hook(third)["outbox_recovery"]
        assert recovery["state"] in ("clean", "repaired"), recovery
        assert recovery["recovered_records"] == 0, recovery
        assert recovery["lost_records"] == recovery["truncated_bytes"] == 0, recovery
        ring3 = wait_durable(third)
        rx.wait_for(before + len(ring_events(ring3)))
        wait_idle(third)
        later = group_bodies(r.body for r in rx.requests[before:])
        assert later.keys() == expected_from(ring3).keys(), "an old event was sent again"


def test_damaged_newest_ack_slot_falls_back_to_the_older_one(make_engine, origin, tmp_path):
    """The ledger's newest slot is damaged: the next start uses the older slot, reports the
    damaged slot, and delivers the events after the older ACK again (duplicates with the
    same bytes, never a loss)."""
    outbox = tmp_path / "outbox"
    with Receiver() as rx:
        cfg = sink_config([webhook("hook", rx.url)], outbox)
        engine = make_engine(cfg)
        rx.wait_for(1)
        wait_idle(engine)  # the ACK of engine.started is durable
        flows(engine, origin, 2)
        wait_durable(engine, completed=2)
        rx.wait_for(7)
        wait_idle(engine)
        engine.stop()
        first_run = len(rx.requests)
        slots = read_ledger_slots(sink_dir(outbox, "hook") / "ledger")
        (old_gen, old_acked), (new_gen, new_acked) = sorted(slots)
        assert new_gen == old_gen + 1 and new_acked == first_run > old_acked
        newest = slots.index((new_gen, new_acked))
        flip_byte(sink_dir(outbox, "hook") / "ledger", newest * 512 + 12)

        again = make_engine(cfg)
        recovery = hook(again)["outbox_recovery"]
        assert recovery["state"] == "repaired"
        assert recovery["damaged_ledger_slots"] == 1
        assert recovery["recovered_records"] == new_acked - old_acked
        assert recovery["lost_records"] == 0
        resent = new_acked - old_acked
        rx.wait_for(first_run + resent + 1)
        wait_idle(again)
        delivered = rx.bodies_by_event_id()
        assert_at_least_once(delivered, group_first(rx.requests[:first_run]))
        twice = [eid for eid, bodies in delivered.items() if len(bodies) == 2]
        assert len(twice) == resent


# -- a full disk ------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmpfs) -> Path:
    """A real 8 MiB tmpfs, unmounted after the test."""
    return tmpfs("8m")


def _fill(fs: Path, engine, name: str = "hook") -> Path:
    """A filler file that leaves exactly the outbox reserve free."""
    storage = hook(engine, name)["outbox_storage"]
    size = storage["available_bytes"] - storage["reserve_bytes"]
    assert size > 0
    filler = fs / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * size)
    left = hook(engine, name)["outbox_storage"]
    assert left["available_bytes"] == left["reserve_bytes"], left
    return filler


def test_full_disk_blocks_writes_keeps_acks_and_resumes(small_fs, make_engine, origin):
    """On a real 8 MiB tmpfs with a 4 MiB reserve: the disk filled to the reserve makes the
    outbox refuse new events (write_blocked, cursor and pending frozen, nothing dropped);
    ACKs still complete; once space returns every event is accepted and delivered."""
    with Receiver() as rx:
        rx.default = Reply(503)
        cfg = sink_config(
            [webhook("hook", rx.url)], small_fs / "outbox", outbox_min_free_bytes=4 * MIB
        )
        engine = make_engine(cfg)
        try:
            flows(engine, origin, 2)
            wait_durable(engine, completed=2)
            accepted = hook(engine)
            assert accepted["pending"] == 7
            assert accepted["outbox_storage"]["reserve_bytes"] == 4 * MIB
            assert accepted["outbox_storage"]["write_blocked"] is False
            filler = _fill(small_fs, engine)
            flows(engine, origin, 2)
            wait_until(lambda: engine.query("events")["latest_sequence"] == 13, 5, "13 events")
            blocked = wait_until(
                lambda: (s := hook(engine))["outbox_storage"]["write_blocked"] and s,
                5,
                "write_blocked",
            )
            assert blocked["cursor_sequence"] == accepted["cursor_sequence"] == 7
            assert blocked["pending"] == 7
            flows(engine, origin, 1)
            wait_until(lambda: engine.query("events")["latest_sequence"] == 16, 5, "3 events")
            still = hook(engine)
            assert still["cursor_sequence"] == 7 and still["pending"] == 7
            assert still["dead_letters"] == still["total_discarded"] == still["replay_gaps"] == 0
            assert still["total_delivered"] == 0

            # The receiver comes back: the 7 accepted events are delivered and their ACKs
            # written although the disk is full.
            rx.default = Reply(200)
            drained = wait_until(
                lambda: (s := hook(engine))["pending"] == 0 and s, 10, "ACKs on a full disk"
            )
            assert drained["total_delivered"] == 7
            assert drained["outbox_storage"]["write_blocked"] is True
            assert drained["cursor_sequence"] == 7
            assert drained["last_error"] is None

            filler.unlink()
            wait_until(
                lambda: hook(engine)["cursor_sequence"] == 16, 5, "writes resumed after the space"
            )
            ring = engine.query("events")
            rx.wait_for(16)
            item = wait_idle(engine)
            assert item["outbox_storage"]["write_blocked"] is False
            assert item["total_delivered"] == 16
            assert item["dead_letters"] == item["total_discarded"] == item["replay_gaps"] == 0
            delivered = rx.bodies_by_event_id()
            assert_at_least_once(delivered, expected_from(ring))
            assert len(delivered) == 16
        finally:
            engine.stop()


def test_ring_eviction_while_blocked_counts_replay_gaps(small_fs, make_engine, origin):
    """A ring of 16 events and a full disk: the events the ring evicts before the outbox
    could take them are counted as replay_gaps, exactly; every other event is delivered."""
    with Receiver() as rx:
        cfg = sink_config(
            [webhook("hook", rx.url)],
            small_fs / "outbox",
            outbox_min_free_bytes=4 * MIB,
            runtime={"event_ring_capacity": 16},
        )
        engine = make_engine(cfg)
        try:
            flows(engine, origin, 1)
            wait_durable(engine, completed=1)
            rx.wait_for(4)
            wait_idle(engine)
            filler = _fill(small_fs, engine)
            flows(engine, origin, 8)  # 24 events: 8 more than the ring holds
            wait_until(lambda: engine.query("events")["latest_sequence"] == 28, 5, "28 events")
            wait_until(lambda: hook(engine)["outbox_storage"]["write_blocked"], 5, "write_blocked")
            ring = engine.query("events")
            assert ring["oldest_sequence"] == 13
            assert hook(engine)["total_delivered"] == 4
            filler.unlink()
            wait_until(lambda: hook(engine)["cursor_sequence"] == 28, 5, "writes resumed")
            rx.wait_for(4 + 16)
            item = wait_idle(engine)
            assert item["replay_gaps"] == 8, "events 5..12 were evicted before they were written"
            assert item["total_delivered"] == 20
            assert item["dead_letters"] == item["total_discarded"] == 0
            delivered = rx.bodies_by_event_id()
            assert_at_least_once(delivered, expected_from(ring))
            sequences = sorted(json.loads(b[0])["sequence"] for b in delivered.values())
            assert sequences == [1, 2, 3, 4, *range(13, 29)]
        finally:
            engine.stop()


def _rejected_on_a_full_disk(
    small_fs: Path, make_engine, later: Reply
) -> tuple[Receiver, object, Path]:
    """An engine whose first event is answered 400 only once the disk is full (the
    request is held until the filler is written); ``later`` answers any further request.
    Returns the receiver (open), the engine and the filler."""
    rx = Receiver()
    rx.default = later
    go = threading.Event()
    rx.script(Reply(400, before=lambda _request: go.wait(10)))
    cfg = sink_config(
        [webhook("hook", rx.url)],
        small_fs / "outbox",
        outbox_min_free_bytes=4 * MIB,
        dispatcher={"backoff_initial_ms": 100},
    )
    engine = make_engine(cfg)
    rx.wait_for(1)
    filler = _fill(small_fs, engine)
    go.set()
    return rx, engine, filler


def test_full_disk_keeps_a_rejected_event_until_its_dead_letter_fits(small_fs, make_engine):
    """A 400 while the disk is full to the reserve: the dead letter cannot be written, so
    the event stays in the outbox (pending, the reason in last_error), never dropped; once
    space returns it becomes a durable dead letter."""
    rx, engine, filler = _rejected_on_a_full_disk(small_fs, make_engine, Reply(400))
    try:
        kept = wait_until(
            lambda: (
                (s := hook(engine))["last_error"]
                and s["last_error"].startswith("dead letter not written")
                and s
            ),
            5,
            "the dead letter refused",
        )
        assert kept["pending"] == 1
        assert kept["total_dead_lettered"] == kept["dead_letters"] == kept["total_discarded"] == 0
        assert kept["delivery"]["retry_pending"] == 1
        filler.unlink()
        item = wait_until(
            lambda: (s := hook(engine))["dead_letters"] == 1 and s, 5, "the dead letter written"
        )
        assert item["total_dead_lettered"] == 1
        assert item["total_delivered"] == 0
        wait_idle(engine)
        rejected = ring_events(engine.query("events"))[0]
        assert {r.body for r in rx.requests} == {expected_body(rejected)}
    finally:
        engine.stop()
        rx.close()


def test_full_disk_does_not_post_a_rejected_event_again(small_fs, make_engine):
    """A 4xx is never retried, also when its dead letter has to wait for disk space:
    exactly one request, total_failed 1."""
    rx, engine, filler = _rejected_on_a_full_disk(small_fs, make_engine, Reply(200))
    try:
        wait_until(
            lambda: (hook(engine)["last_error"] or "").startswith("dead letter not written"),
            5,
            "the dead letter refused",
        )
        # Several retry periods pass while the disk stays full.
        deadline = time.monotonic() + 0.5
        wait_until(lambda: time.monotonic() > deadline or len(rx.requests) > 1, 2)
        filler.unlink()
        item = wait_idle(engine)
        assert len(rx.requests) == 1, f"the rejected event was posted {len(rx.requests)} times"
        assert item["total_failed"] == 1
        assert item["total_delivered"] == 0, "a rejected event was counted as delivered"
        assert item["dead_letters"] == item["total_dead_lettered"] == 1
    finally:
        engine.stop()
        rx.close()


def test_replay_gaps_of_a_filtered_sink_count_only_its_events(small_fs, make_engine, origin):
    """A sink that takes only flow.completed loses, when the ring evicts while the disk is
    full, only the flow.completed events among the evicted ones: replay_gaps counts those
    (the reference is a live subscription, which saw every event)."""
    with Receiver() as rx:
        cfg = sink_config(
            [webhook("picky", rx.url, events=["flow.completed"])],
            small_fs / "outbox",
            outbox_min_free_bytes=4 * MIB,
            runtime={"event_ring_capacity": 16},
        )
        engine = make_engine(cfg)
        try:
            with engine.subscribe(since=0, timeout=5) as sub:
                flows(engine, origin, 1)
                rx.wait_for(1)
                wait_idle(engine, "picky")
                filler = _fill(small_fs, engine, "picky")
                flows(engine, origin, 8)
                seen: list[dict] = []
                while len(seen) < 28:
                    got = sub.get_many(timeout=5)
                    assert got, f"the subscription stopped at {len(seen)} events"
                    seen.extend(got)
            wait_until(
                lambda: hook(engine, "picky")["outbox_storage"]["write_blocked"], 5, "blocked"
            )
            oldest = engine.query("events")["oldest_sequence"]
            assert oldest == 13
            lost = [
                e
                for e in seen
                if e["event_type"] == "flow.completed" and 4 < e["sequence"] < oldest
            ]
            kept = [e for e in seen if e["event_type"] == "flow.completed" and e not in lost]
            filler.unlink()
            rx.wait_for(len(kept))
            item = wait_idle(engine, "picky")
            assert item["total_delivered"] == len(kept)
            assert_at_least_once(
                rx.bodies_by_event_id(), {e["event_id"]: expected_body(e) for e in kept}
            )
            assert item["replay_gaps"] == len(lost), f"{len(lost)} flow.completed evicted"
        finally:
            engine.stop()
