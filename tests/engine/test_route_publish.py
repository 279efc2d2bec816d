"""The route publisher compiles every C table from one engine generation, never a mix.

``RoutePublisher.publish`` runs on the dispatcher (reloads, ``mode.set``, group changes)
and on the process-lookup worker thread (this host's addresses changed). A reload
publishes a new generation while a publish on the worker may be compiling: each table
must still be compiled from the rules, the routing state and the outbounds of one
generation, which its Python mirror (what C got, with the epoch C's records name)
records by serial.
"""

from __future__ import annotations

import threading
from typing import Any

from spliceway import Engine
from spliceway.engine.generation import Generation
from spliceway.engine.route_publish import Mirror
from tests.conftest import base_config

#: Reloads per test: each installs a new generation (bounded; about 2 s in all).
RELOADS = 30
#: Publishes the worker-side thread may make while the reloads run (bounded loop).
MAX_PUBLISHES = 200_000


def _document(name: str) -> dict[str, Any]:
    """A configuration whose one rule routes to an outbound only it defines."""
    return base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "block", "protocol": "block"},
            # A proxy C dials itself: the table holds it as a target of its own.
            {"tag": f"up-{name}", "protocol": "socks5", "server": "127.0.0.1", "port": 9},
        ],
        rules=[{"domain_suffix": [f"{name}.example"], "outbound": f"up-{name}"}],
    )


def _assert_of_one_generation(mirror: Mirror, g: Generation) -> None:
    """The table of ``mirror`` holds ``g``'s rules, routing state and outbounds only."""
    assert mirror.outbounds is g.outbounds
    assert mirror.routes.ruleset is g.route_state.ruleset
    # The targets were resolved against the same outbounds the rules name.
    ruled = {d.target for d in mirror.routes.rule_decisions if d.action == "route"}
    assert ruled == {r.outbound for r in g.config.rules}
    for tag, chain in zip(mirror.routes.targets, mirror.chains, strict=True):
        assert chain[-1] in g.outbounds, (tag, chain)


def test_every_table_published_during_reloads_belongs_to_one_generation() -> None:
    documents = [_document("a"), _document("b")]
    with Engine(documents[0]) as engine:
        core = engine.core
        generations: dict[int, Generation] = {core.generation.serial: core.generation}
        stop = threading.Event()
        published = 0

        def publish_like_the_lookup_worker() -> None:
            # What ProcessLookup's worker runs when this host's addresses change.
            nonlocal published
            for _ in range(MAX_PUBLISHES):
                if stop.is_set():
                    return
                core.routes.publish()
                published += 1

        worker = threading.Thread(target=publish_like_the_lookup_worker, name="spliceway-proc")
        worker.start()
        try:
            for n in range(RELOADS):
                result = engine.execute("config.apply_runtime", {"config": documents[(n + 1) % 2]})
                assert result["applied"] is True
                g = core.generation
                generations[g.serial] = g
        finally:
            stop.set()
            worker.join(10)
        assert not worker.is_alive()
        assert published > 0
        assert len(generations) == RELOADS + 1
        seen: set[int] = set()
        for epoch in range(1, core.routes.epoch + 1):
            mirror = core.routes.mirror(epoch)
            assert mirror.routes.epoch == epoch
            g = generations.get(mirror.generation)
            assert g is not None, f"table {epoch} names generation {mirror.generation}"
            _assert_of_one_generation(mirror, g)
            seen.add(mirror.generation)
        # Every generation got its table (the publish after each install).
        assert seen == set(generations)
        # The table C routes by now is the last generation's.
        assert core.routes.mirror(core.routes.epoch).generation == core.generation.serial


def test_mode_set_publishes_a_generation_of_its_own() -> None:
    with Engine(_document("a")) as engine:
        core = engine.core
        before = core.generation
        engine.execute("mode.set", {"mode": "direct"})
        after = core.generation
        assert after.serial > before.serial
        assert after.route_state.mode == "direct"
        # The same tables under the new routing state.
        assert after.outbounds is before.outbounds and after.policies is before.policies
        mirror = core.routes.mirror(core.routes.epoch)
        assert mirror.generation == after.serial
        _assert_of_one_generation(mirror, after)
