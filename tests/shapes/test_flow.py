"""The FlowRecord model against what ``FlowState.render`` produces, and against the
OpenAPI component and catalogue table generated from it."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import TypeAdapter, ValidationError

from spliceway.api.openapi import openapi_document
from spliceway.events.catalogue import FLOW_RECORD_FIELDS
from spliceway.flows.records import Failure, FlowState, Traffic, state_from_record
from spliceway.shapes.flow import FlowRecord
from spliceway.shapes.schema import catalogue_rows

_DOC = openapi_document()
#: The document's FlowRecord, its ``#/components/...`` references resolved in the document.
_SCHEMA: dict[str, Any] = {
    "$ref": "#/components/schemas/FlowRecord",
    "components": _DOC["components"],
}
_ADAPTER: TypeAdapter[FlowRecord] = TypeAdapter(FlowRecord)


def _opening() -> FlowState:
    return FlowState("f1", "mixed-in", "mixed", "127.0.0.1", 40000, 1_000, "rule", revision=1)


def _relayed() -> FlowState:
    s = _opening()
    s.set_process(4242, "curl", "/usr/bin/curl")
    s.revision, s.state = 2, "active"
    s.target_host, s.target_port = "example.com", 443
    s.resolved_ip, s.sniffed_host = "93.184.216.34", "example.com"
    s.labels = {"team": "a"}
    # An HTTP CONNECT on a mixed inbound, to a fake-ip address mapped back, by alice.
    s.client_protocol, s.fake_ip, s.principal_key = "http_connect", "198.18.0.5", "alice"
    s._fixed = None  # as set_process does: the inbound object changes
    s.route_action, s.route_target = "route", "proxy"
    s.matched_rule = {"index": 0, "condition": "domain_suffix=example.com"}
    s.selection_chain = ["proxy", "direct"]
    s.outbound_tag, s.outbound_protocol = "direct", "direct"
    s.remote_host, s.remote_port = "93.184.216.34", 443
    s.traffic = Traffic(10, 20, 30, 40, 50, 60)
    s.upload_bps, s.download_bps, s.sampled_at_unix_ms = 8, 16, 1_500
    s.last_activity_at_unix_ms = 1_400
    return s


def _completed() -> FlowState:
    s = _relayed()
    s.revision, s.state = 3, "completed"
    s.ended_at_unix_ms = 2_000
    s.outcome, s.close_reason = "failed", "upstream_error"
    s.failure = Failure("relay", "upstream_reset", "reset", {"host": "93.184.216.34", "port": 443})
    return s


@pytest.mark.parametrize("make", [_opening, _relayed, _completed])
def test_render_is_a_flow_record(make: Any) -> None:
    record = make().render()
    assert _ADAPTER.validate_python(record, strict=True) == record
    jsonschema.validate(record, _SCHEMA, cls=jsonschema.Draft202012Validator)


def test_the_clients_protocol_fake_ip_and_principal_are_in_the_record_only_when_known() -> None:
    opening = _opening().render()
    assert opening["inbound"] == {"tag": "mixed-in", "protocol": "mixed"}
    assert "fake_ip" not in opening["target"]
    assert "principal_key" not in opening
    relayed = _relayed().render()
    assert relayed["inbound"] == {
        "tag": "mixed-in",
        "protocol": "mixed",
        "client_protocol": "http_connect",
    }
    assert relayed["target"]["fake_ip"] == "198.18.0.5"
    assert relayed["target"]["host"] == "example.com"
    assert relayed["principal_key"] == "alice"


@pytest.mark.parametrize("make", [_opening, _relayed])
def test_state_from_record_keeps_the_clients_protocol_fake_ip_and_principal(make: Any) -> None:
    record = make().render()
    assert state_from_record(record).render() == record


@pytest.mark.parametrize("spoken", ["socks5", "http", "http_connect", "tun"])
def test_each_client_protocol_is_one_the_schema_allows(spoken: str) -> None:
    s = _relayed()
    s.client_protocol, s._fixed = spoken, None
    record = s.render()
    assert _ADAPTER.validate_python(record, strict=True) == record
    jsonschema.validate(record, _SCHEMA, cls=jsonschema.Draft202012Validator)
    s.client_protocol, s._fixed = "mixed", None  # an inbound's protocol, not a client's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(s.render(), _SCHEMA, cls=jsonschema.Draft202012Validator)


def test_the_schema_refuses_what_the_model_does_not_declare() -> None:
    record: dict[str, Any] = dict(_completed().render())
    record["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, _SCHEMA, cls=jsonschema.Draft202012Validator)
    missing = dict(_opening().render())
    del missing["traffic"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(missing, _SCHEMA, cls=jsonschema.Draft202012Validator)
    with pytest.raises(ValidationError):
        _ADAPTER.validate_python(missing, strict=True)


def test_every_key_render_can_produce_is_in_the_catalogue() -> None:
    documented = {f.name for f in FLOW_RECORD_FIELDS}
    assert documented == {row.name for row in catalogue_rows(FlowRecord)}

    def paths(doc: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for key, value in doc.items():
            out.add(prefix + key)
            # Into the objects the table expands (not labels, path.outbound, ...).
            nested = any(name.startswith(f"{prefix}{key}.") for name in documented)
            if isinstance(value, dict) and nested:
                out |= paths(value, f"{prefix}{key}.")
        return out

    assert paths(dict(_completed().render())) <= documented
