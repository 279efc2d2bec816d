"""What the wire-shape models are written in, and what is generated from them.

A wire shape is a ``TypedDict`` whose keys carry their meaning in
``Annotated[..., Field(description=..., ge=..., ...)]`` (pydantic's ``Field``, so
``pydantic.TypeAdapter`` validates against the same declaration). Two things are
generated from one:

- :func:`json_schema` (and :func:`component`, a shape with its docstring as its
  description): the JSON Schema the OpenAPI document publishes, in the
  document's own style (objects closed, ``nullable`` as a type list where it can be,
  named components as ``$ref``);
- :func:`catalogue_rows`: the rows of the field tables in docs/events.md (key path,
  type in words, description, whether the key is always present).

The markers below say what a type annotation alone cannot: :class:`Ref` (the value is
a named OpenAPI component), :data:`UNIX_MS_MARK` (an integer that is a UNIX time in
milliseconds) and :data:`OPAQUE` (an object documented on its own row, its keys not
listed in the catalogue).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import typing_extensions
from pydantic.fields import FieldInfo

Schema = dict[str, Any]

#: Where ``$ref`` points: the OpenAPI document's schema components.
COMPONENTS = "#/components/schemas/"


@dataclass(frozen=True, slots=True)
class Ref:
    """The value's schema is the named component (``{"$ref": ...}``), not inlined."""

    name: str


@dataclass(frozen=True, slots=True)
class _Mark:
    name: str


#: An integer that is a UNIX time in milliseconds (``integer (UNIX ms)`` in the docs).
UNIX_MS_MARK = _Mark("unix_ms")
#: An object the catalogue documents on its own row, without rows for its keys.
OPAQUE = _Mark("opaque")

_UNIX_MS_TEXT = "UNIX time in milliseconds"
_NONE = type(None)
_REQUIRED_WRAPPERS = {
    typing.Required,
    typing.NotRequired,
    typing_extensions.Required,
    typing_extensions.NotRequired,
}


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a catalogue field table."""

    #: Key path: ``a.b`` for key ``b`` of object ``a``.
    name: str
    #: JSON type in words (``integer``, ``string or null``, ``list of string``...).
    type: str
    description: str
    #: False when the key is present only in some cases.
    required: bool


def is_typeddict(tp: Any) -> bool:
    """Whether ``tp`` is a TypedDict class."""
    return typing_extensions.is_typeddict(tp)


def _unwrap_required(tp: Any) -> tuple[Any, bool]:
    """``(T, False)`` for ``NotRequired[T]``, ``(T, True)`` for ``T`` or ``Required[T]``."""
    required = True
    while get_origin(tp) in _REQUIRED_WRAPPERS:
        required = get_origin(tp) not in (typing.NotRequired, typing_extensions.NotRequired)
        tp = get_args(tp)[0]
    return tp, required


def _hints(td: type) -> dict[str, tuple[Any, bool]]:
    # Read from the annotations, not ``__required_keys__``: under postponed evaluation
    # (``from __future__ import annotations``) the class cannot see ``NotRequired``.
    hints = typing_extensions.get_type_hints(td, include_extras=True)
    return {name: _unwrap_required(tp) for name, tp in hints.items()}


def fields(td: type) -> dict[str, Any]:
    """The keys of TypedDict ``td`` and their annotations, in declaration order."""
    return {name: tp for name, (tp, _) in _hints(td).items()}


def required_keys(td: type) -> frozenset[str]:
    """The keys of TypedDict ``td`` that are always present."""
    return frozenset(name for name, (_, required) in _hints(td).items() if required)


def keys(td: type) -> tuple[str, ...]:
    """The keys of TypedDict ``td``, in declaration order."""
    return tuple(fields(td))


def _split(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``Annotated[T, m...]`` as ``(T, (m...))``; anything else as ``(tp, ())``."""
    if get_origin(tp) is typing.Annotated:
        base, *meta = get_args(tp)
        return base, tuple(meta)
    return tp, ()


def _optional_inner(tp: Any) -> Any | None:
    """``X`` when ``tp`` is ``X | None``, else None."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not _NONE]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0]
    return None


def nullable(schema: Schema) -> Schema:
    """``schema`` or JSON ``null``: a type list where that is enough, else ``anyOf``."""
    kind = schema.get("type")
    if isinstance(kind, str) and kind != "object" and not {"enum", "const"} & set(schema):
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


_CONSTRAINTS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Ge, "ge", "minimum"),
    (annotated_types.Le, "le", "maximum"),
    (annotated_types.MinLen, "min_length", "minLength"),
)


def _apply(schema: Schema, meta: tuple[Any, ...]) -> Schema:
    """``schema`` with the constraints, description and extras of ``meta`` applied."""
    for m in meta:
        if isinstance(m, Ref):
            schema = {"$ref": f"{COMPONENTS}{m.name}"}
        elif m is UNIX_MS_MARK:
            schema = {**schema, "description": _UNIX_MS_TEXT}
        elif isinstance(m, FieldInfo):
            for c in m.metadata:
                for kind, attr, key in _CONSTRAINTS:
                    if isinstance(c, kind):
                        schema = {**schema, key: getattr(c, attr)}
            if m.description is not None:
                schema = {**schema, "description": m.description}
            if isinstance(m.json_schema_extra, dict):
                schema = {**schema, **m.json_schema_extra}
    return schema


def json_schema(tp: Any) -> Schema:
    """The JSON Schema of annotation ``tp`` (a TypedDict, or any type used in one)."""
    base, meta = _split(tp)
    inner = _optional_inner(base)
    if inner is not None:
        schema = nullable(json_schema(inner))
    elif is_typeddict(base):
        schema = object_schema(base)
    else:
        schema = _plain(base)
    return _apply(schema, meta)


def _plain(tp: Any) -> Schema:
    origin = get_origin(tp)
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if origin is Literal:
        values = list(get_args(tp))
        return {"const": values[0]} if len(values) == 1 else {"type": "string", "enum": values}
    if origin is list:
        return {"type": "array", "items": json_schema(get_args(tp)[0])}
    if origin is dict:
        value = get_args(tp)[1]
        if value is Any:
            return {"type": "object"}
        return {"type": "object", "additionalProperties": json_schema(value)}
    raise TypeError(f"no JSON Schema for {tp!r}")


def object_schema(
    td: type, *, description: str | None = None, extra: Schema | None = None
) -> Schema:
    """The closed object schema of TypedDict ``td`` (``additionalProperties: false``)."""
    always = required_keys(td)
    annotations = fields(td)
    out: Schema = {"type": "object"}
    if description is not None:
        out["description"] = description
    out["properties"] = {name: json_schema(tp) for name, tp in annotations.items()}
    required = [name for name in annotations if name in always]
    if required:
        out["required"] = required
    out["additionalProperties"] = False
    return {**out, **(extra or {})}


def component(td: type, *, extra: Schema | None = None) -> Schema:
    """``td`` as a named component: :func:`object_schema` described by its docstring."""
    return object_schema(td, description=" ".join((td.__doc__ or "").split()) or None, extra=extra)


def _word(tp: Any) -> str:
    base, meta = _split(tp)
    inner = _optional_inner(base)
    if inner is not None:
        return f"{_word(_split(inner)[0])} or null"
    if is_typeddict(base):
        return "object"
    origin = get_origin(base)
    word: str
    if base is str:
        word = "string"
    elif base is bool:
        word = "boolean"
    elif base is int:
        word = "integer (UNIX ms)" if UNIX_MS_MARK in meta else "integer"
    elif base is float:
        word = "number"
    elif origin is Literal:
        word = _word(type(get_args(base)[0]))
    elif origin is list:
        word = f"list of {_word(get_args(base)[0])}"
    elif origin is dict:
        value = get_args(base)[1]
        word = "object" if value is Any else f"object of {_word(value)}"
    else:
        raise TypeError(f"no words for {tp!r}")
    return word


def _description(meta: tuple[Any, ...]) -> str | None:
    for m in reversed(meta):
        if isinstance(m, FieldInfo) and m.description is not None:
            return m.description
    return None


def catalogue_rows(td: type, prefix: str = "") -> Iterator[Row]:
    """Rows for every key of ``td`` and, depth first, of the objects it holds
    (not those that may be null, are components, or are marked :data:`OPAQUE`)."""
    always = required_keys(td)
    for name, tp in fields(td).items():
        base, meta = _split(tp)
        description = _description(meta)
        if description is None:
            raise TypeError(f"{td.__name__}.{name} has no description")
        path = f"{prefix}{name}"
        yield Row(path, _word(tp), description, name in always)
        flat = any(isinstance(m, Ref) or m is OPAQUE for m in meta)
        if is_typeddict(base) and not flat:
            yield from catalogue_rows(base, f"{path}.")
