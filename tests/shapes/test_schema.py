"""What the wire-shape generator makes of a declaration (spliceway.shapes.schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

import pytest
from pydantic import Field
from typing_extensions import TypedDict

from spliceway.shapes.schema import OPAQUE, UNIX_MS_MARK, Ref, catalogue_rows, json_schema

UnixMs = Annotated[int, Field(ge=0), UNIX_MS_MARK]


class Inner(TypedDict):
    """An inner object."""

    a: Annotated[str, Field(description="A.")]
    b: NotRequired[Annotated[int | None, Field(description="B.")]]


class Outer(TypedDict):
    """An outer object."""

    at: Annotated[UnixMs, Field(description="When.")]
    seen: Annotated[UnixMs | None, Field(description="Last seen.")]
    kind: Annotated[Literal["x", "y"], Ref("Kind"), Field(description="Its kind.")]
    fixed: Annotated[Literal["v1"], Field(description="Always v1.")]
    inner: Annotated[Inner, Field(description="Nested.")]
    maybe: Annotated[Inner | None, Field(description="Nested or null.")]
    opaque: NotRequired[Annotated[Inner, OPAQUE, Field(description="Not expanded.")]]
    tags: Annotated[list[str], Field(description="Tags.")]
    labels: Annotated[dict[str, str], Field(description="Labels.")]
    payload: Annotated[dict[str, Any], Field(description="Anything.")]


def test_json_schema() -> None:
    schema = json_schema(Outer)
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    assert schema["required"] == [
        "at", "seen", "kind", "fixed", "inner", "maybe", "tags", "labels", "payload"
    ]  # fmt: skip
    assert props["at"] == {"type": "integer", "minimum": 0, "description": "When."}
    assert props["seen"] == {"type": ["integer", "null"], "minimum": 0, "description": "Last seen."}
    assert props["kind"] == {"$ref": "#/components/schemas/Kind", "description": "Its kind."}
    assert props["fixed"] == {"const": "v1", "description": "Always v1."}
    assert props["inner"]["required"] == ["a"]
    assert props["inner"]["properties"]["b"] == {"type": ["integer", "null"], "description": "B."}
    assert props["maybe"]["anyOf"][1] == {"type": "null"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "Tags."}
    assert props["labels"]["additionalProperties"] == {"type": "string"}
    assert props["payload"] == {"type": "object", "description": "Anything."}


def test_catalogue_rows() -> None:
    rows = [(r.name, r.type, r.required) for r in catalogue_rows(Outer)]
    assert rows == [
        ("at", "integer (UNIX ms)", True),
        ("seen", "integer or null", True),
        ("kind", "string", True),
        ("fixed", "string", True),
        ("inner", "object", True),
        ("inner.a", "string", True),
        ("inner.b", "integer or null", False),
        ("maybe", "object or null", True),
        ("opaque", "object", False),
        ("tags", "list of string", True),
        ("labels", "object of string", True),
        ("payload", "object", True),
    ]


def test_a_documented_shape_needs_descriptions() -> None:
    class Bare(TypedDict):
        x: int

    with pytest.raises(TypeError, match="no description"):
        list(catalogue_rows(Bare))
