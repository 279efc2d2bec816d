"""Nothing is silently ignored on the query endpoints.

Each query of the table declares its parameters (path parameters included); any
other parameter, a parameter given twice, or a blank one that is not valid, is
400 ``invalid_argument`` naming it. ``GET /api/v1/events`` filters by ``types``,
``since`` and ``limit`` (checked here against the real ring after real flows).
Real engines, their real Waitress listener, ``http.client``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from spliceway.control.queries import EVENTS_LIMIT_MAX, QUERIES
from spliceway.errors import ApiError
from tests.api.conftest import control_config, send
from tests.api.test_openapi import DOC
from tests.conftest import wait_until
from tests.helpers.flows import socks_fetch

API = "/api/v1"


def get(base_url: str, path: str, method: str = "GET") -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one request (as curl sends it: no Origin)."""
    headers = {"Content-Type": "application/json"} if method == "POST" else {}
    body = b'{"method": "tun.stop", "params": {}}' if method == "POST" else None
    status, answer_headers, answer = send(base_url, method, path, body=body, headers=headers)
    assert answer_headers["access-control-allow-origin"] == "*"
    return status, answer


def bad(base_url: str, path: str, field: str, method: str = "GET") -> str:
    """Assert 400 invalid_argument with ``field_path`` ``field``; the message."""
    status, body = get(base_url, path, method)
    assert status == 400, body
    assert body["error"]["code"] == "invalid_argument", body
    assert body["error"]["field_path"] == field, body
    message: str = body["error"]["message"]
    return message


def result(base_url: str, path: str) -> Any:
    status, body = get(base_url, path)
    assert status == 200, body
    return body["result"]


# -- unknown, repeated and blank parameters -----------------------------------------------

#: Every GET endpoint, its path, and what it accepts (listed in the message).
ENDPOINTS = [
    ("health", f"{API}/health", ()),
    ("capabilities", f"{API}/capabilities", ()),
    ("config", f"{API}/config", ()),
    ("runtime", f"{API}/runtime", ()),
    ("stats", f"{API}/stats", ()),
    ("flows", f"{API}/flows", ("limit", "inbound_tag", "principal_key")),
    ("flow", f"{API}/flows/no-such-flow", ("flow_id",)),
    ("policies", f"{API}/policies", ()),
    ("policy", f"{API}/policies/no-such-policy", ("policy_tag",)),
    ("providers", f"{API}/providers", ()),
    ("sinks", f"{API}/sinks", ()),
    ("tun_status", f"{API}/tun_status", ()),
    ("events", f"{API}/events", ("types", "since", "limit")),
    ("stream", f"{API}/events/stream", ("types", "since")),
    ("openapi", f"{API}/openapi.json", ()),
]


@pytest.mark.parametrize(("name", "path", "accepted"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_unknown_parameter_is_named(
    base_url: str, name: str, path: str, accepted: tuple[str, ...]
) -> None:
    message = bad(base_url, f"{path}?verbose=1", "verbose")
    assert "unknown parameter 'verbose'" in message
    if accepted:
        assert f"it accepts: {', '.join(accepted)}" in message
    else:
        assert "it accepts none" in message
    # A blank value is a parameter too, not nothing.
    assert "'verbose'" in bad(base_url, f"{path}?verbose=", "verbose")
    assert "'verbose'" in bad(base_url, f"{path}?verbose", "verbose")


def test_commands_take_no_query_parameters(base_url: str) -> None:
    assert "it accepts none" in bad(base_url, f"{API}/commands?dry_run=1", "dry_run", "POST")


def test_the_table_declares_what_the_document_documents() -> None:
    """One declaration: the OpenAPI parameters of each query are the table's."""
    paths = {
        "flows": f"{API}/flows",
        "flow": f"{API}/flows/{{flow_id}}",
        "policy": f"{API}/policies/{{policy_tag}}",
    }
    for name, spec in QUERIES.items():
        item = DOC["paths"][paths.get(name, f"{API}/{name}")]
        documented = [
            p["name"] for p in (*item.get("parameters", ()), *item["get"].get("parameters", ()))
        ]
        assert sorted(documented) == sorted(spec.params), name
        assert "400" in item["get"]["responses"], name


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (f"{API}/flows?limit=1&limit=2", "limit"),
        (f"{API}/flows?inbound_tag=a&inbound_tag=a", "inbound_tag"),
        (f"{API}/events?types=flow.completed&types=engine.started", "types"),
        (f"{API}/events?since=1&since=1", "since"),
        (f"{API}/events/stream?since=1&since=2", "since"),
        (f"{API}/health?x=1&x=2", "x"),
    ],
)
def test_repeated_parameter_is_named(base_url: str, path: str, field: str) -> None:
    message = bad(base_url, path, field)
    assert f"'{field}' is given 2 times" in message


def test_path_parameter_given_again_in_the_query(base_url: str) -> None:
    assert "both in the path and in the query" in bad(
        base_url, f"{API}/flows/abc?flow_id=def", "flow_id"
    )


def test_blank_values_are_checked_not_dropped(base_url: str) -> None:
    bad(base_url, f"{API}/flows?limit=", "limit")
    bad(base_url, f"{API}/events?limit=", "limit")
    bad(base_url, f"{API}/events?since=", "since")
    bad(base_url, f"{API}/events/stream?since=", "since")
    # A blank types means every type, as on the stream.
    assert result(base_url, f"{API}/events?types=")["events"]


def test_engine_query_checks_the_same_declarations(engine: Any) -> None:
    with pytest.raises(ApiError) as info:
        engine.query("health", {"verbose": True})
    assert (info.value.code, info.value.field_path) == ("invalid_argument", "verbose")
    with pytest.raises(ApiError) as info:
        engine.query("flows", {"limit": 5, "state": "active"})
    assert info.value.field_path == "state" and "limit, inbound_tag, principal_key" in str(
        info.value
    )
    # Path parameters are declared parameters of their queries.
    with pytest.raises(ApiError) as info:
        engine.query("flow", {"flow_id": "nope"})
    assert info.value.code == "not_found"
    assert engine.query("flows", {"limit": "3"}) == {"active_flows": []}


# -- events: types, since, limit ----------------------------------------------------------


@pytest.fixture
def busy(make_engine: Callable[..., Any], origin: tuple[str, int]) -> tuple[Any, str]:
    """An engine after 6 real flows through its socks inbound (all completed)."""
    engine = make_engine(control_config())
    for size in range(1, 7):
        socks_fetch(engine, origin, size * 100)
    wait_until(lambda: len(completed(engine.query("events")["events"])) == 6, what="6 flows")
    return engine, str(engine.control_url)


def completed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event_type"] == "flow.completed"]


def test_events_filter_exactly(busy: tuple[Any, str]) -> None:
    engine, base_url = busy
    ring = engine.query("events")
    done = completed(ring["events"])
    # After the first flow's completion: the 3 oldest completions after it, in order.
    since = done[0]["sequence"]
    page = result(base_url, f"{API}/events?types=flow.completed&since={since}&limit=3")
    assert page["events"] == done[1:4]
    assert [e["payload"]["record"]["traffic"]["bytes_down"] for e in page["events"]] == [
        e["payload"]["record"]["traffic"]["bytes_down"] for e in done[1:4]
    ]
    # The bounds describe the ring, not the page.
    assert page["oldest_sequence"] == ring["oldest_sequence"] == 1
    assert page["capacity"] == ring["capacity"]
    assert page["latest_sequence"] >= ring["latest_sequence"] >= done[-1]["sequence"]
    # Since alone: every event after it; since in between two completions: the later ones.
    assert result(base_url, f"{API}/events?since={since}")["events"][0]["sequence"] == since + 1
    between = done[2]["sequence"] - 1
    got = result(base_url, f"{API}/events?types=flow.completed&since={between}")["events"]
    assert got == done[2:]
    # Several types, and * for all.
    both = result(base_url, f"{API}/events?types=flow.started,flow.completed&since={since}&limit=4")
    expected = [
        e
        for e in ring["events"]
        if e["sequence"] > since and e["event_type"] in ("flow.started", "flow.completed")
    ][:4]
    assert both["events"] == expected
    assert result(base_url, f"{API}/events?types=*&limit=1")["events"] == ring["events"][:1]
    # Nothing after the latest event.
    assert result(base_url, f"{API}/events?since=99999999")["events"] == []


def test_events_page_forward_with_since(busy: tuple[Any, str]) -> None:
    engine, base_url = busy
    done = completed(engine.query("events")["events"])
    pages: list[list[dict[str, Any]]] = []
    since = 0
    for _ in range(10):  # bounded: 6 events in pages of 4
        page = result(base_url, f"{API}/events?types=flow.completed&since={since}&limit=4")[
            "events"
        ]
        if not page:
            break
        pages.append(page)
        since = page[-1]["sequence"]
    assert [len(p) for p in pages] == [4, 2]
    assert [e for p in pages for e in p] == done


def test_engine_query_events_takes_ints_and_numeric_strings(busy: tuple[Any, str]) -> None:
    engine, _ = busy
    done = completed(engine.query("events")["events"])
    since = done[1]["sequence"]
    as_ints = engine.query("events", {"types": "flow.completed", "since": since, "limit": 2})
    as_text = engine.query("events", {"types": "flow.completed", "since": str(since), "limit": "2"})
    as_list = engine.query("events", {"types": ["flow.completed"], "since": since, "limit": 2})
    assert as_ints["events"] == as_text["events"] == as_list["events"] == done[2:4]
    for bad_params, field in (
        ({"limit": True}, "limit"),
        ({"since": -1}, "since"),
        ({"since": 1.0}, "since"),
        ({"types": 5}, "types"),
        ({"types": "flow.bogus"}, "types"),
    ):
        with pytest.raises(ApiError) as info:
            engine.query("events", bad_params)
        assert (info.value.code, info.value.field_path) == ("invalid_argument", field), bad_params


@pytest.mark.parametrize("limit", ["0", "-1", str(EVENTS_LIMIT_MAX + 1), "abc", "1.5", "%C2%B2"])
def test_events_limit_out_of_bounds(base_url: str, limit: str) -> None:
    assert f"1..{EVENTS_LIMIT_MAX}" in bad(base_url, f"{API}/events?limit={limit}", "limit")


def test_events_limit_bounds_accepted(base_url: str) -> None:
    one = result(base_url, f"{API}/events?limit=1")
    assert [e["event_type"] for e in one["events"]] == ["engine.started"]
    everything = result(base_url, f"{API}/events?limit={EVENTS_LIMIT_MAX}")
    assert everything["events"][0] == one["events"][0]


@pytest.mark.parametrize("since", ["-1", "abc", "1.5", "%EF%BC%91", "+1"])
def test_events_bad_since(base_url: str, since: str) -> None:
    assert "since" in bad(base_url, f"{API}/events?since={since}", "since")


@pytest.mark.parametrize("types", ["flow.bogus", "flow.completed,nope", "FLOW.COMPLETED"])
def test_events_bad_types(base_url: str, types: str) -> None:
    assert "unknown event type" in bad(base_url, f"{API}/events?types={types}", "types")
