"""YAML read the way mihomo reads it: ``gopkg.in/yaml.v3``, close to the YAML 1.2 core schema.

PyYAML implements YAML 1.1, where ``yes``, ``no``, ``on``, ``off``, ``y`` and ``n`` are
booleans, ``1:20`` is a sexagesimal integer and ``=`` a value key. A Clash document read
that way changes meaning: a password ``no`` becomes ``False``, a proxy named ``on``
becomes ``True``. :func:`load` keeps PyYAML's parser (the C one when present: thousands
of rule lines) and replaces how plain scalars are resolved with a port of yaml.v3's
``resolve``:

- booleans are ``true``/``True``/``TRUE`` and ``false``/``False``/``FALSE`` only;
- null is the empty scalar, ``~``, ``null``/``Null``/``NULL``;
- integers as Go's ``strconv.ParseInt(s, 0, 64)`` after dropping ``_`` (``0x1F``,
  ``0o17``, ``0b101``, and a leading ``0`` for octal, which yaml.v3 still decodes),
  then unsigned 64-bit; no sexagesimal;
- floats ``1.5``, ``.5``, ``1e3``, ``.inf``, ``-.inf``, ``.nan`` (and case variants);
- everything else (timestamps included, which are kept as their text) is a string.

Merge keys (``<<``) work as in yaml.v3: the mapping's own keys win, and of the mappings
it merges the one listed first wins. A key given twice in one mapping is an error, as
in yaml.v3 (mihomo refuses such a file), unless the caller asks for the duplicates to be
reported instead (the last one then wins). Errors carry the line and column; a document
whose aliases expand it beyond yaml.v3's limits ("excessive aliasing") is refused, so a
small hostile file cannot make its reader walk billions of nodes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["Duplicate", "Loaded", "YamlError", "go_parse_int", "load", "load_document"]

_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_MERGE = "tag:yaml.org,2002:merge"

#: yaml.v3's ``resolveMap``: the scalars resolved by lookup.
_BY_TEXT: dict[str, tuple[str, Any]] = {
    **dict.fromkeys(("true", "True", "TRUE"), (_BOOL, True)),
    **dict.fromkeys(("false", "False", "FALSE"), (_BOOL, False)),
    **dict.fromkeys(("", "~", "null", "Null", "NULL"), (_NULL, None)),
    **dict.fromkeys((".nan", ".NaN", ".NAN"), (_FLOAT, math.nan)),
    **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), (_FLOAT, math.inf)),
    **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), (_FLOAT, -math.inf)),
    "<<": (_MERGE, None),
}
#: yaml.v3's ``resolveTable``: what a scalar's first character says it might be.
_HINTS: dict[str, str] = {
    **dict.fromkeys("+-", "S"),
    **dict.fromkeys("0123456789", "D"),
    **dict.fromkeys("yYnNtTfFoO~", "M"),
    ".": ".",
}
_YAML_STYLE_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_GO_INT = re.compile(
    r"(?P<sign>[-+]?)(?:0[xX](?P<hex>[0-9a-fA-F]+)|0[oO](?P<oct>[0-7]+)|0[bB](?P<bin>[01]+)"
    r"|(?P<octal0>0[0-7]*)|(?P<dec>[1-9][0-9]*))"
)
_GO_FLOAT_DOT = re.compile(r"\.[0-9]+([eE][-+]?[0-9]+)?")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64_MAX = (1 << 64) - 1

# yaml.v3's limits on alias expansion (decode.go allowedAliasRatio).
_ALIAS_RANGE_LOW = 400_000
_ALIAS_RANGE_HIGH = 4_000_000
#: yaml.v3's parser refuses deeper nesting ("exceeded max depth of 10000").
_MAX_DEPTH = 10_000


class YamlError(ValueError):
    """The text is not a YAML document mihomo would read; ``line`` and ``column`` are
    1-based (``None`` when the problem has no single place)."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(f"{where}{problem}")
        self.problem = problem
        self.line = line
        self.column = column


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A key given twice in one mapping: where its second occurrence is (1-based), and
    the line of the first."""

    key: str
    line: int
    column: int
    first_line: int


@dataclass(frozen=True, slots=True)
class Loaded:
    """A decoded document and the duplicate keys found (empty unless asked to report)."""

    document: Any
    duplicates: tuple[Duplicate, ...] = field(default=())


def go_parse_int(text: str) -> int | None:
    """Go's ``strconv.ParseInt(text, 0, 64)``, falling back to ``ParseUint`` as yaml.v3
    does: ``0x``/``0o``/``0b`` prefixes, a leading ``0`` for octal, an optional sign;
    ``None`` when Go would refuse it. mihomo's weak typing (``port: "443"``) parses
    strings with the same rule."""
    m = _GO_INT.fullmatch(text)
    if m is None:
        return None
    if m.group("hex") is not None:
        value = int(m.group("hex"), 16)
    elif m.group("oct") is not None:
        value = int(m.group("oct"), 8)
    elif m.group("bin") is not None:
        value = int(m.group("bin"), 2)
    elif m.group("octal0") is not None:
        value = int(m.group("octal0"), 8)
    else:
        value = int(m.group("dec"))
    if m.group("sign") == "-":
        value = -value
    if _INT64[0] <= value <= _INT64[1]:
        return value
    # ParseUint takes no sign.
    return value if not m.group("sign") and value <= _UINT64_MAX else None


def _plain_float(text: str) -> float | None:
    """The float yaml.v3 reads from an unquoted scalar that is not in the lookup table."""
    if text.startswith("."):
        # strconv.ParseFloat on ".5", ".5e3"; it refuses what overflows.
        candidate = text if _GO_FLOAT_DOT.fullmatch(text) else None
    else:
        plain = text.replace("_", "")
        candidate = plain if _YAML_STYLE_FLOAT.fullmatch(plain) else None
    if candidate is None:
        return None
    value = float(candidate)
    return None if math.isinf(value) else value


def _resolve_plain(text: str) -> str:
    """yaml.v3's ``resolve`` for an untagged plain scalar: the tag it decodes as."""
    if text in _BY_TEXT:
        return _BY_TEXT[text][0]
    hint = _HINTS.get(text[0]) if text else None
    if hint is None or hint == "M":
        return _STR
    if hint == ".":
        return _FLOAT if _plain_float(text) is not None else _STR
    if go_parse_int(text.replace("_", "")) is not None:
        return _INT
    if _plain_float(text) is not None:
        return _FLOAT
    return _STR


_BaseLoader: type[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Yaml12Loader(_BaseLoader):
    """PyYAML's safe loader (the C parser when built) with yaml.v3's scalar resolution,
    merge rules and duplicate-key check."""

    # No implicit resolvers of YAML 1.1: resolve() below decides every plain scalar.
    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 (PyYAML's class table)

    def __init__(self, stream: str, report_duplicates: bool) -> None:
        super().__init__(stream)
        self._report_duplicates = report_duplicates
        self.duplicates: list[Duplicate] = []
        self._flattened: set[int] = set()
        self._flattening: set[int] = set()

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        if kind is ScalarNode and implicit[0]:
            return _resolve_plain(value)
        if kind is ScalarNode:
            return _STR
        return str(super().resolve(kind, value, implicit))

    def construct_yaml_int(self, node: ScalarNode) -> int:
        text = str(self.construct_scalar(node))
        value = go_parse_int(text.replace("_", ""))
        if value is None:
            raise _error_at(f"cannot decode {text!r} as an integer", node)
        return value

    def construct_yaml_float(self, node: ScalarNode) -> float:
        text = str(self.construct_scalar(node))
        if text in _BY_TEXT and _BY_TEXT[text][0] == _FLOAT:
            return float(_BY_TEXT[text][1])
        number = go_parse_int(text.replace("_", ""))
        value = float(number) if number is not None else _plain_float(text)
        if value is None:
            raise _error_at(f"cannot decode {text!r} as a float", node)
        return value

    def construct_yaml_bool(self, node: ScalarNode) -> bool:
        text = str(self.construct_scalar(node))
        if text in _BY_TEXT and _BY_TEXT[text][0] == _BOOL:
            return bool(_BY_TEXT[text][1])
        raise _error_at(f"cannot decode {text!r} as a boolean", node)

    def flatten_mapping(self, node: MappingNode) -> None:
        if id(node) in self._flattened:
            return  # an anchored mapping merged or aliased again: already done
        if id(node) in self._flattening:
            # `&a {<<: *a}` would recurse without end.
            raise _error_at("a mapping merges itself (through an alias of its own anchor)", node)
        self._check_duplicates(node)
        self._flattening.add(id(node))
        try:
            merged: list[list[tuple[Node, Node]]] = []
            own: list[tuple[Node, Node]] = []
            for key, value in node.value:
                if key.tag == _MERGE:
                    merged.extend(self._merge_sources(node, value))
                else:
                    own.append((key, value))
        finally:
            self._flattening.discard(id(node))
        if merged:
            # Later pairs win when the dict is built: the mapping listed last goes first,
            # the mapping's own keys after them all (yaml.v3: own keys, then merges in
            # order, each key set once).
            node.value = [pair for pairs in reversed(merged) for pair in pairs] + own
        self._flattened.add(id(node))

    def _merge_sources(self, node: MappingNode, value: Node) -> list[list[tuple[Node, Node]]]:
        sources = value.value if isinstance(value, SequenceNode) else [value]
        out = []
        for source in sources:
            if not isinstance(source, MappingNode):
                raise _error_at("map merge requires map or sequence of maps as the value", source)
            self.flatten_mapping(source)
            out.append(list(source.value))
        return out

    def _check_duplicates(self, node: MappingNode) -> None:
        first: dict[str, Node] = {}
        keep: dict[str, int] = {}
        found = False
        for index, (key, _) in enumerate(node.value):
            if not isinstance(key, ScalarNode):
                continue
            if key.value in first:
                dup = Duplicate(
                    key=key.value,
                    line=key.start_mark.line + 1,
                    column=key.start_mark.column + 1,
                    first_line=first[key.value].start_mark.line + 1,
                )
                if not self._report_duplicates:
                    raise YamlError(
                        f"mapping key {key.value!r} already defined at line {dup.first_line}",
                        dup.line,
                        dup.column,
                    )
                self.duplicates.append(dup)
                found = True
            else:
                first[key.value] = key
            keep[key.value] = index
        if found:
            # The last occurrence wins: drop the earlier ones so the merge order above
            # does not bring them back.
            node.value = [
                pair
                for index, pair in enumerate(node.value)
                if not isinstance(pair[0], ScalarNode) or keep[pair[0].value] == index
            ]


_Yaml12Loader.add_constructor(_INT, _Yaml12Loader.construct_yaml_int)
_Yaml12Loader.add_constructor(_FLOAT, _Yaml12Loader.construct_yaml_float)
_Yaml12Loader.add_constructor(_BOOL, _Yaml12Loader.construct_yaml_bool)


def _error_at(problem: str, node: Node) -> YamlError:
    return YamlError(problem, node.start_mark.line + 1, node.start_mark.column + 1)


def _children(node: Node) -> Iterator[Node]:
    if isinstance(node, SequenceNode):
        yield from node.value
    elif isinstance(node, MappingNode):
        for key, value in node.value:
            yield key
            yield value


def _check_aliasing(root: Node) -> None:
    """Refuse a document nested deeper than yaml.v3's parser allows, or that aliases
    expand as yaml.v3 refuses it ("document contains excessive aliasing"): the expanded
    node count against the distinct nodes."""
    size: dict[int, int] = {}
    stack: list[tuple[Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if done:
            size[id(node)] = 1 + sum(size[id(c)] for c in _children(node))
            continue
        if id(node) in size:
            continue
        if depth > _MAX_DEPTH:
            raise _error_at(f"exceeded max depth of {_MAX_DEPTH}", node)
        size[id(node)] = 0  # on the path: a cycle counts as nothing more
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in _children(node) if id(c) not in size)
    expanded = size[id(root)]
    aliased = expanded - len(size)
    if aliased <= 100 or expanded <= 1000:
        return
    if expanded <= _ALIAS_RANGE_LOW:
        allowed = 0.99
    elif expanded >= _ALIAS_RANGE_HIGH:
        allowed = 0.10
    else:
        span = _ALIAS_RANGE_HIGH - _ALIAS_RANGE_LOW
        allowed = 0.99 - 0.89 * (expanded - _ALIAS_RANGE_LOW) / span
    if aliased / expanded > allowed:
        raise YamlError(
            f"document contains excessive aliasing ({len(size)} nodes expand to {expanded})"
        )


def load_document(text: str | bytes, *, duplicates: Literal["error", "report"] = "error") -> Loaded:
    """Decode the first YAML document of ``text`` as yaml.v3 would (see the module).

    ``duplicates="error"`` refuses a key given twice in a mapping (yaml.v3's "mapping key
    already defined"); ``"report"`` keeps the last one and lists them in
    :attr:`Loaded.duplicates`. Raises :class:`YamlError` with the line and column of the
    problem.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as ex:
            raise YamlError(f"not UTF-8 (byte offset {ex.start})") from None
    text = text.removeprefix("\ufeff")
    loader = _Yaml12Loader(text, duplicates == "report")
    try:
        node = loader.get_node() if loader.check_node() else None
        if node is None:
            return Loaded(None)
        _check_aliasing(node)
        document = loader.construct_document(node)
    except yaml.MarkedYAMLError as ex:
        mark = ex.problem_mark or ex.context_mark
        problem = ex.problem or ex.context or str(ex)
        if mark is None:
            raise YamlError(problem) from None
        raise YamlError(problem, mark.line + 1, mark.column + 1) from None
    except yaml.YAMLError as ex:
        raise YamlError(str(ex)) from None
    except RecursionError:
        raise YamlError("nested too deeply") from None
    finally:
        loader.dispose()
    return Loaded(document, tuple(loader.duplicates))


def load(text: str | bytes) -> Any:
    """The first document of ``text``, decoded as yaml.v3 would; a duplicate key is an
    error (:class:`YamlError`, with line and column)."""
    return load_document(text).document
