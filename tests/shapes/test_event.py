"""The event envelope model against the proto's ``message Event`` and the event log.

The gRPC stream carries the envelope as ``message Event``; the HTTP API, IPC and
sinks carry it as JSON of the shape :class:`spliceway.shapes.event.Envelope`
declares. These tests fail when the two disagree: a field added, removed, renamed,
reordered or retyped on one side only.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from google.protobuf.descriptor import FieldDescriptor
from pydantic import TypeAdapter

from spliceway.api.grpc_gen import control_pb2
from spliceway.events.log import EventLog
from spliceway.shapes.event import SCHEMA_ID, Envelope
from spliceway.shapes.schema import fields, required_keys

PROTO = Path(__file__).resolve().parents[2] / "api/proto/spliceway/v1/control.proto"

_FIELD = re.compile(
    r"^\s*(?P<label>optional\s+|repeated\s+)?(?P<type>map<\s*\w+\s*,\s*\w+\s*>|[\w.]+)\s+"
    r"(?P<name>\w+)\s*=\s*(?P<number>\d+)\s*;",
    re.MULTILINE,
)


def _message(name: str) -> list[tuple[str, str, bool]]:
    """``(name, type, optional)`` of each field of ``message <name>`` in the .proto."""
    text = PROTO.read_text()
    match = re.search(rf"^message {name} \{{(?P<body>.*?)^\}}", text, re.MULTILINE | re.DOTALL)
    assert match, f"no message {name} in {PROTO}"
    body = re.sub(r"//[^\n]*", "", match["body"])
    return [
        (m["name"], re.sub(r"\s+", "", m["type"]), (m["label"] or "").strip() == "optional")
        for m in _FIELD.finditer(body)
    ]


def _proto_type(annotation: Any) -> tuple[str, bool]:
    """The proto type an envelope key's annotation travels as, and whether it may be null."""
    base = annotation
    if get_origin(base) is typing.Annotated:
        base = get_args(base)[0]
    args = get_args(base)
    nullable = type(None) in args
    if nullable:
        (base,) = (a for a in args if a is not type(None))
        if get_origin(base) is typing.Annotated:
            base = get_args(base)[0]
    if get_origin(base) is Literal:
        base = type(get_args(base)[0])
    if base is str:
        return "string", nullable
    if base is int:
        return "int64", nullable
    if get_origin(base) is dict:
        value = get_args(base)[1]
        if value is str:
            return "map<string,string>", nullable
        if value is Any:
            return "google.protobuf.Struct", nullable
    raise AssertionError(f"no proto type for {annotation!r}")


def test_proto_event_matches_the_envelope_model() -> None:
    proto = _message("Event")
    model = fields(Envelope)
    assert [name for name, _, _ in proto] == list(model), "field names or order differ"
    for name, proto_type, optional in proto:
        expected_type, nullable = _proto_type(model[name])
        assert proto_type == expected_type, f"Event.{name}: {proto_type} vs {expected_type}"
        # A key the model lets be null is `optional` in the proto (presence), and only it.
        assert optional == nullable, f"Event.{name}: optional={optional}, nullable={nullable}"
    assert required_keys(Envelope) == set(model), "every envelope key is always present"


def test_generated_stubs_match_the_proto() -> None:
    descriptor = control_pb2.Event.DESCRIPTOR
    assert [f.name for f in descriptor.fields] == [name for name, _, _ in _message("Event")]
    presence = {f.name: f.has_presence for f in descriptor.fields}
    for name, _, optional in _message("Event"):
        if descriptor.fields_by_name[name].type != FieldDescriptor.TYPE_MESSAGE:
            assert presence[name] == optional, name


def test_the_log_emits_the_envelope_model() -> None:
    log = EventLog(capacity=8)
    flow = log.emit("engine.warning", {"code": "c", "message": "m"})
    labelled = log.emit(
        "engine.warning", {"code": "c", "message": "m"}, principal_key="alice", labels={"k": "v"}
    )
    adapter = TypeAdapter(Envelope)
    for envelope in (flow, labelled):
        assert list(envelope) == list(fields(Envelope))
        assert adapter.validate_python(envelope, strict=True) == envelope
        assert envelope["schema_id"] == SCHEMA_ID
