"""Reading a configuration file (JSON, or YAML with PyYAML), the embedded default, the schema.

Both decoders refuse a key given twice in one object, as a configuration that says two
things at once is a mistake the user should hear about.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from spliceway.config.models import Config
from spliceway.config.problems import invalid
from spliceway.config.validation import parse_config
from spliceway.errors import Detail

_NOT_JSON = "configuration file is not valid JSON"
_NOT_YAML = "configuration file is not valid YAML"


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_json(text: str, source: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        detail = Detail(f"{source}: line {exc.lineno}, column {exc.colno}: {exc.msg}")
        raise invalid([detail], "configuration file is not valid JSON") from None
    except _DuplicateKeyError as exc:
        detail = Detail(f"{source}: duplicate key {exc.args[0]!r} in an object")
        raise invalid([detail], "configuration file is not valid JSON") from None
    except RecursionError:
        raise invalid([Detail(f"{source}: nested too deeply")], _NOT_JSON) from None
    except ValueError as exc:
        raise invalid(
            [Detail(f"{source}: {exc}")], "configuration file is not valid JSON"
        ) from None


@functools.cache
def _yaml_loader() -> Any:
    """PyYAML's SafeLoader, except that a mapping may not give a key twice (as in JSON).

    The check runs on the composed nodes, before merge keys are applied, so ``<<``
    keeps its meaning: a mapping may override keys it merges in, and the mappings it
    merges may share keys (the first one listed wins). A key written twice in one
    mapping, ``<<`` included, is an error at the line and column of the second one.
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._flattening: set[int] = set()

        def compose_mapping_node(self, anchor: Any) -> Any:
            node = super().compose_mapping_node(anchor)
            first: dict[tuple[str, str], Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in first:
                    raise yaml.composer.ComposerError(
                        "while composing a mapping",
                        node.start_mark,
                        f"duplicate key {key_node.value!r} in a mapping "
                        f"(first given at line {first[key].line + 1})",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark
            return node

        def flatten_mapping(self, node: Any) -> None:
            # The merge-key rules themselves, not PyYAML's: 6.0.4 changed which of two
            # merged mappings wins a shared key (the later one), against the rule that
            # the one listed first wins; the same file must mean the same config on
            # every PyYAML this package allows.
            if id(node) in self._flattening:
                # An anchor merged into itself (`&a {<<: *a}`) would recurse without end.
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "a mapping merges itself (through an alias of its own anchor)",
                    node.start_mark,
                )
            self._flattening.add(id(node))
            try:
                merged = [
                    pairs
                    for key, value in node.value
                    if _is_merge(key)
                    for pairs in self._merged(node, value)
                ]
            finally:
                self._flattening.discard(id(node))
            own = [(key, value) for key, value in node.value if not _is_merge(key)]
            for key, _ in own:
                if key.tag == "tag:yaml.org,2002:value":
                    key.tag = "tag:yaml.org,2002:str"
            if merged:
                # Later pairs win when the dict is built: the mappings listed last go
                # first, and the mapping's own keys after them all.
                node.value = [pair for pairs in reversed(merged) for pair in pairs] + own

        def _merged(self, node: Any, value: Any) -> list[list[Any]]:
            """The flattened pairs of each mapping one ``<<`` names, in the order listed."""
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            out = []
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"expected a mapping or a list of mappings to merge, but found {source.id}",
                        source.start_mark,
                    )
                self.flatten_mapping(source)
                out.append(source.value)
            return out

    def _is_merge(key_node: Any) -> bool:
        return bool(key_node.tag == "tag:yaml.org,2002:merge")

    return UniqueKeyLoader


def _decode_yaml(text: str, source: str) -> Any:
    try:
        import yaml  # optional dependency
    except ImportError:
        detail = Detail(f"{source}: YAML configuration needs PyYAML (pip install pyyaml)")
        raise invalid([detail], "YAML configuration is not supported") from None
    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: no arbitrary objects
    except RecursionError:
        raise invalid([Detail(f"{source}: nested too deeply")], _NOT_YAML) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        detail = Detail(f"{source}: {where}{problem}")
        raise invalid([detail], "configuration file is not valid YAML") from None


def load_config_file(path: str | os.PathLike[str]) -> Config:
    """Read, decode and validate a configuration file (JSON; ``.yaml``/``.yml`` with PyYAML)."""
    return parse_config(read_config_document(path))


def read_config_document(path: str | os.PathLike[str]) -> Any:
    """A configuration file's document, decoded but not validated (``spliceway reload``
    sends it as it is, so the engine's source file gets the user's own document)."""
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        detail = Detail(f"cannot read {source}: {exc.strerror or exc}")
        raise invalid([detail], "configuration file cannot be read") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        detail = Detail(f"{source}: not UTF-8 (byte offset {exc.start})")
        raise invalid([detail], "configuration file is not valid UTF-8") from None
    if source.lower().endswith((".yaml", ".yml")):
        return _decode_yaml(text, source)
    return _decode_json(text, source)


def config_schema() -> dict[str, Any]:
    """The configuration's JSON Schema (draft 2020-12), as ``spliceway config-schema`` prints it."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **Config.model_json_schema(),
        "title": "spliceway configuration",
    }


@functools.cache
def default_config() -> Config:
    """The embedded default: mixed 127.0.0.1:7890, direct + block, a keyless control API."""
    text = resources.files("spliceway.config").joinpath("default_config.json").read_text("utf-8")
    return parse_config(_decode_json(text, "default_config.json"))
