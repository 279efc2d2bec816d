"""mihomo's weak typing: how it reads a field of a proxy, group or provider mapping.

mihomo decodes those mappings with its ``common/structure`` decoder in weakly typed mode:
``port: "443"`` is the integer 443 (Go's ``ParseInt(s, 0, 64)``: ``"0x1bb"`` too), a
number where a string is wanted is its decimal text, an integer where a boolean is
wanted is ``!= 0``, but a string is never a boolean (``udp: "true"`` is an error). A
key is found as written, else case-insensitively (and for proxies with ``_`` read as
``-``, so ``skip_cert_verify`` is ``skip-cert-verify``). A null value counts as absent.
These helpers reproduce that, so a file mihomo accepts reads the same here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from spliceway.clash.yaml12 import go_parse_int

__all__ = [
    "MISSING",
    "WeakTypeError",
    "go_format_float",
    "lookup",
    "unknown_keys",
    "weak_bool",
    "weak_int",
    "weak_str",
    "weak_str_list",
]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: What :func:`lookup` returns for a key that is absent or null.
MISSING: Any = _Missing()


class WeakTypeError(ValueError):
    """A field mihomo's decoder would refuse; the message says which and why."""


def _norm(key: str, dashes: bool) -> str:
    return (key.replace("_", "-") if dashes else key).lower()


def lookup(mapping: Mapping[Any, Any], key: str, *, dashes: bool = True) -> Any:
    """``mapping[key]`` as mihomo's decoder finds it: the key as written, else the first
    key equal to it ignoring case (and ``_`` versus ``-`` when ``dashes``); a null value
    or no such key gives :data:`MISSING`."""
    if key in mapping:
        value = mapping[key]
        return MISSING if value is None else value
    want = _norm(key, dashes)
    for candidate, value in mapping.items():
        if isinstance(candidate, str) and _norm(candidate, dashes) == want:
            return MISSING if value is None else value
    return MISSING


def unknown_keys(
    mapping: Mapping[Any, Any], known: Iterable[str], *, dashes: bool = True
) -> list[str]:
    """Keys of ``mapping`` that none of ``known`` reads (in the mapping's order)."""
    wanted = {_norm(k, dashes) for k in known}
    return [
        str(k)
        for k in mapping
        if not isinstance(k, str) or (k not in wanted and _norm(k, dashes) not in wanted)
    ]


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "[]interface {}"
    if isinstance(value, dict):
        return "map[string]interface {}"
    return type(value).__name__


def _refuse(key: str, want: str, value: Any) -> WeakTypeError:
    return WeakTypeError(
        f"'{key}' expected type '{want}', got unconvertible type '{_type_name(value)}'"
    )


def go_format_float(value: float) -> str:
    """Go's ``strconv.FormatFloat(value, 'E', -1, 64)`` (what mihomo makes of a float
    where a string is wanted): ``1.5`` is ``1.5E+00``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0E+00" if math.copysign(1.0, value) < 0 else "0E+00"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    text = "".join(map(str, digits))
    exp = int(exponent) + len(text) - 1
    mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}E{'+' if exp >= 0 else '-'}{abs(exp):02d}"


def weak_int(value: Any, key: str) -> int:
    """An integer field: an integer, a float (truncated) or a string Go's ``ParseInt``
    reads (``"443"``, ``"0x1bb"``); never a boolean."""
    if isinstance(value, bool):
        raise _refuse(key, "int", value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise WeakTypeError(f"cannot parse '{key}' as int: {value}")
        return int(value)
    if isinstance(value, str):
        parsed = go_parse_int(value.replace("_", ""))
        if parsed is None:
            raise WeakTypeError(f"cannot parse '{key}' as int: {value!r} is not a number")
        return parsed
    raise _refuse(key, "int", value)


def weak_str(value: Any, key: str) -> str:
    """A string field: a string, or a number's text (never a boolean, list or map)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise _refuse(key, "string", value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_format_float(value)
    raise _refuse(key, "string", value)


def weak_bool(value: Any, key: str) -> bool:
    """A boolean field: a boolean, or an integer (``!= 0``); a string is refused, as
    mihomo refuses ``udp: "true"``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value != 0
    raise _refuse(key, "bool", value)


def weak_str_list(value: Any, key: str) -> list[str]:
    """A list-of-strings field (each item as :func:`weak_str`; null items skipped, as
    mihomo's weak decoder leaves them zero and the callers ignore empty names)."""
    if not isinstance(value, list):
        raise WeakTypeError(f"'{key}' is not a slice")
    return [weak_str(item, f"{key}[{i}]") for i, item in enumerate(value) if item is not None]
