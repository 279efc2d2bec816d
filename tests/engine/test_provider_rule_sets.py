"""Rule providers and geodata downloads through the engine's refresh: fetched, checked by
routing's own readers, cached atomically, kept on failure; a real engine and origin."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway.native import route_sets
from spliceway.routing import geodata, ruleset
from tests.conftest import base_config, wait_until
from tests.engine.test_providers import events, status, update
from tests.events.test_catalogue import check_event
from tests.helpers.provider_origin import Answer, ProviderOrigin, provider_origin

DOMAINS = b"# ads\nads.example\n+.tracker.example\nbad/entry\n"


@pytest.fixture
def origin() -> Iterator[ProviderOrigin]:
    with provider_origin() as server:
        yield server


def _mmdb(path: Path, code: str) -> bytes:
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(IPSet(["1.0.0.0/24"]), {"country": {"iso_code": code}})
    writer.to_db_file(str(path))
    return path.read_bytes()


def _geosite(*names: str) -> bytes:
    message = geodata.GeoSiteListMessage()
    for name in names:
        entry = message.entry.add()
        entry.country_code = name.upper()
        domain = entry.domain.add()
        domain.type = 2  # Domain: the name and every name below it
        domain.value = f"{name}.example"
    return message.SerializeToString()


def test_a_rule_provider_is_fetched_checked_and_cached(make_engine, origin, tmp_path) -> None:
    origin.serve("/ads.txt", Answer(DOMAINS))
    config = base_config(
        providers={
            "rules": {
                "ads": {"url": origin.url("/ads.txt"), "behavior": "domain", "format": "text"}
            }
        },
        runtime={"providers_cache_dir": str(tmp_path / "cache")},
    )
    engine = make_engine(config)
    state = status(engine, "ads", "rules")
    assert (state["rules"], state["skipped"]) == (2, 1)
    assert (state["behavior"], state["format"]) == ("domain", "text")
    assert Path(state["path"]).read_bytes() == DOMAINS
    (updated,) = events(engine, "provider.updated")
    assert check_event(updated) == []
    assert updated["payload"]["kind"] == "rules"
    assert (updated["payload"]["rules"], updated["payload"]["skipped"]) == (2, 1)
    # A rule set under the same configuration: the reload is forced, and says routing.
    (changed,) = events(engine, "config.changed")
    assert changed["payload"]["trigger"] == "provider"
    assert "routing" in changed["payload"]["changed_components"]

    for body, message in (
        (b"<!DOCTYPE html><html>login</html>", "HTML page"),
        (b"\x00\x01\x02\x03" * 50, "binary"),
        (b"only/bad\nentries here\n", "no valid domain entry"),
    ):
        origin.serve("/ads.txt", Answer(body))
        (result,) = update(engine, name="ads")
        assert result["outcome"] == "failed" and message in result["error"], result
        assert Path(state["path"]).read_bytes() == DOMAINS
        failed = events(engine, "provider.failed")[-1]
        assert check_event(failed) == [] and failed["payload"]["kind"] == "rules"
    origin.serve("/ads.txt", Answer(b"payload:\n  - other.example\n"))
    config["providers"]["rules"]["ads"]["format"] = "yaml"
    engine.execute("config.apply_runtime", {"config": config})
    assert update(engine, name="ads")[0]["outcome"] == "updated"
    assert status(engine, "ads", "rules")["rules"] == 1


def test_geodata_is_downloaded_only_when_configured_and_checked_first(
    make_engine, origin, tmp_path
) -> None:
    geoip, geosite = tmp_path / "Country.mmdb", tmp_path / "geosite.dat"
    first = _mmdb(tmp_path / "first.mmdb", "CN")
    geoip.write_bytes(first)
    origin.serve("/Country.mmdb", Answer(_mmdb(tmp_path / "second.mmdb", "JP")))
    origin.serve("/geosite.dat", Answer(_geosite("google", "apple")))
    config = base_config(
        runtime={
            "providers_cache_dir": str(tmp_path / "cache"),
            "geodata": {
                "geoip_path": str(geoip),
                "geoip_url": origin.url("/Country.mmdb"),
                "geosite_path": str(geosite),
                "geosite_url": origin.url("/geosite.dat"),
            },
        }
    )
    engine = make_engine(config)
    # Never downloaded on a schedule or at start: only by providers.update.
    assert origin.count("/Country.mmdb") == origin.count("/geosite.dat") == 0
    listed = {s["name"]: s for s in engine.query("providers")["providers"]}
    assert (
        listed["geoip"]["kind"] == "geodata" and listed["geoip"]["next_update_at_unix_ms"] is None
    )
    results = {r["name"]: r for r in update(engine)}
    assert results["geoip"]["outcome"] == results["geosite"]["outcome"] == "updated"
    assert geodata.GeoIp.open(str(geoip)).lookup("1.0.0.1").countries == ("jp",)
    assert geodata.GeoSite.open(str(geosite)).names() == frozenset({"google", "apple"})
    assert update(engine, name="geoip")[0]["outcome"] == "unchanged"

    good = geoip.read_bytes()
    origin.serve("/Country.mmdb", Answer(b"\x00not a maxmind database" * 100))
    origin.serve("/geosite.dat", Answer(b"\xff\xff\xff garbage"))
    results = {r["name"]: r for r in update(engine, kind="geodata")}
    assert results["geoip"]["outcome"] == "failed"
    assert "not a usable geoip database" in results["geoip"]["error"]
    assert results["geosite"]["outcome"] == "failed"
    assert geoip.read_bytes() == good
    assert geodata.GeoSite.open(str(geosite)).names() == frozenset({"google", "apple"})
    # Nothing left beside the files.
    assert sorted(
        p.name for p in tmp_path.iterdir() if p.name.startswith(("Country", "geosite"))
    ) == [
        "Country.mmdb",
        "geosite.dat",
    ]


def test_without_urls_nothing_is_downloaded(make_engine, tmp_path) -> None:
    config: dict[str, Any] = base_config(
        runtime={"geodata": {"geoip_path": str(tmp_path / "Country.mmdb")}}
    )
    engine = make_engine(config)
    assert engine.query("providers")["providers"] == []
    assert update(engine) == []


def test_a_refreshed_rule_set_routes_new_flows_at_once(make_engine, origin, tmp_path) -> None:
    origin.serve("/ads.txt", Answer(b"+.ads.example\n"))
    config = base_config(
        providers={
            "rules": {
                "ads": {"url": origin.url("/ads.txt"), "behavior": "domain", "format": "text"}
            }
        },
        rules=[{"rule_set": ["ads"], "action": "block"}],
        runtime={"providers_cache_dir": str(tmp_path / "cache")},
    )
    engine = make_engine(config)

    def action(host: str) -> str:
        trace = engine.execute("diagnostics.trace_route", {"target": host, "port": 443})
        return "block" if "block" in trace["route_action"] else "final"

    assert action("x.ads.example") == "block"
    assert action("x.other.example") == "final"
    origin.serve("/ads.txt", Answer(b"+.other.example\n"))
    assert update(engine, name="ads")[0]["outcome"] == "updated"
    assert action("x.ads.example") == "final"
    assert action("x.other.example") == "block"
    # A bad body keeps routing by the last good set.
    origin.serve("/ads.txt", Answer(b"<html>error</html>"))
    assert update(engine, name="ads")[0]["outcome"] == "failed"
    assert action("x.other.example") == "block"


def test_a_path_rule_provider_is_counted_from_the_running_tables(make_engine, tmp_path) -> None:
    listed = tmp_path / "list.txt"
    listed.write_text("a.example\nb.example\nbad entry\n")
    config = base_config(
        providers={
            "rules": {"mine": {"path": str(listed), "behavior": "domain", "format": "text"}}
        },
        rules=[{"rule_set": ["mine"], "action": "block"}],
    )
    engine = make_engine(config)
    state = status(engine, "mine", "rules")
    assert (state["rules"], state["skipped"], state["last_error"]) == (2, 1, None)
    listed.write_text("<html>oops</html>")
    (result,) = update(engine, name="mine")
    assert result["outcome"] == "failed" and "HTML" in result["error"]
    listed.unlink()
    (result,) = update(engine, name="mine")
    assert result["outcome"] == "failed" and "No such file" in result["error"]


def test_a_refresh_parses_once_and_builds_the_c_sets_off_the_dispatcher(
    make_engine, origin, tmp_path, monkeypatch
) -> None:
    """The refresh's check parses the new body (on the refresher's thread); the reload
    reads the same bytes from the cached file and gets that set, parsed no second time;
    its C set is built before the install, so the dispatcher only swaps tables. Once the
    new table is in, the replaced set is freed (the table mirrors do not keep it)."""
    origin.serve("/ads.txt", Answer(b"+.ads.example\n"))
    config = base_config(
        providers={
            "rules": {
                "ads": {"url": origin.url("/ads.txt"), "behavior": "domain", "format": "text"}
            }
        },
        rules=[{"rule_set": ["ads"], "action": "block"}],
        runtime={"providers_cache_dir": str(tmp_path / "cache")},
    )
    engine = make_engine(config)
    old = weakref.ref(engine.core.generation.parts.rule_sets["ads"])
    new_body = b"+.other.example\nexact.example\n"
    parsed: list[tuple[str, Any]] = []
    folded: list[tuple[str, Any]] = []
    parse, fold = ruleset._parse, route_sets._fold

    def parse_spy(body: bytes, *args: Any, **kwargs: Any) -> Any:
        data = parse(body, *args, **kwargs)
        if body == new_body:
            parsed.append((threading.current_thread().name, data))
        return data

    def fold_spy(data: Any, match_source: bool) -> Any:
        folded.append((threading.current_thread().name, data))
        return fold(data, match_source)

    monkeypatch.setattr(ruleset, "_parse", parse_spy)
    monkeypatch.setattr(route_sets, "_fold", fold_spy)
    origin.serve("/ads.txt", Answer(new_body))
    assert update(engine, name="ads")[0]["outcome"] == "updated"
    ((thread, data),) = parsed
    assert thread.startswith("ProviderRefresherActor")
    assert engine.core.generation.parts.rule_sets["ads"] is data
    assert data.suffix == {"other.example"} and data.exact == {"exact.example"}
    assert [name for name, d in folded if d is data] == [thread]
    # The old set is gone once nothing routes by it (a mirror keeps no rule set).
    wait_until(lambda: old() is None, what="the replaced rule set freed")
