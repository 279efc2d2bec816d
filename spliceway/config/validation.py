"""The two validation passes over a document, and pydantic's errors as :class:`Detail` items.

The schema pass is :class:`~spliceway.config.models.Config`; the cross-check pass is
:mod:`spliceway.config.checks`. Both report every problem they find.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from spliceway.config.checks import _Checker
from spliceway.config.models import Config
from spliceway.config.problems import invalid
from spliceway.errors import Detail

#: Where pydantic inserts a discriminator tag into ``loc``: prefix pattern -> tags.
_UNION_TAGS: dict[tuple[str, ...], frozenset[str]] = {
    ("outbounds", "*"): frozenset({"direct", "block", "socks5", "http", "shadowsocks"}),
    ("outbound_groups", "*"): frozenset(
        {"selector", "url_test", "fallback", "relay", "load_balance"}
    ),
    ("api", "event_sinks", "*"): frozenset({"webhook", "jsonl", "nats"}),
    ("runtime", "dns", "answer"): frozenset({"real", "fake_ip"}),
}

_TYPE_MESSAGES = {
    "missing": "required key is missing",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "bool_type": "must be a boolean",
    "float_type": "must be a number",
}


def _render_loc(loc: tuple[int | str, ...]) -> str | None:
    out: list[str] = []
    pattern: list[str] = []
    for seg in loc:
        if isinstance(seg, int):
            out.append(f"[{seg}]")
            pattern.append("*")
            continue
        tags = _UNION_TAGS.get(tuple(pattern))
        if tags is not None and seg in tags:
            continue  # the discriminator segment pydantic inserts for unions
        out.append(f".{seg}" if out else seg)
        pattern.append(seg)
    return "".join(out) or None


def _join(path: str | None, key: str) -> str:
    return f"{path}.{key}" if path else key


def _details_from(exc: ValidationError) -> list[Detail]:
    details: list[Detail] = []
    errors = exc.errors(include_url=False)
    for err in errors:
        etype = err["type"]
        path = _render_loc(tuple(err["loc"]))
        ctx = err.get("ctx") or {}
        if etype == "extra_forbidden":
            message = f"unknown key {err['loc'][-1]!r}"
        elif etype in ("union_tag_not_found", "union_tag_invalid"):
            key = str(ctx.get("discriminator", "")).strip("'\"")
            path = _join(path, key)
            if etype == "union_tag_not_found":
                message = "required key is missing"
            else:
                message = f"must be one of {ctx.get('expected_tags')}"
        elif etype == "too_short" and ctx.get("min_length") == 1:
            # pydantic counts only the items that validated: skip when an item failed
            prefix = tuple(err["loc"])
            if any(tuple(o["loc"])[: len(prefix)] == prefix and o is not err for o in errors):
                continue
            message = "must not be empty"
        elif etype == "model_type" and path is None:
            message = "the configuration must be a JSON object"
        elif etype in _TYPE_MESSAGES:
            message = _TYPE_MESSAGES[etype]
        elif etype == "value_error":
            message = str(ctx.get("error", err["msg"]))
        else:
            message = err["msg"].replace("Input should be", "must be", 1)
            message = message.replace("Value should have", "must have", 1)
        details.append(Detail(message, path))
    return details


def _validate(doc: object) -> tuple[Config | None, list[Detail]]:
    details: list[Detail] = []
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(doc)
    except ValidationError as exc:
        details.extend(_details_from(exc))
    if isinstance(doc, Mapping):
        seen = set(details)
        details.extend(d for d in _Checker(doc).run() if d not in seen)
    return (None if details else cfg), details


def validate_document(doc: object) -> list[Detail]:
    """Every problem of ``doc`` (a decoded JSON document); empty when it is valid."""
    return _validate(doc)[1]


def parse_config(doc: object) -> Config:
    """Validate ``doc`` and return the :class:`Config`.

    Raises ``ApiError("invalid_argument", "configuration is invalid", cause=..., details=[...])``
    listing every problem.
    """
    if isinstance(doc, Config):
        return doc
    cfg, details = _validate(doc)
    if details or cfg is None:
        raise invalid(details or [Detail("configuration is invalid")])
    return cfg
