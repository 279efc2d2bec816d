"""Rule sets: the content of a rule provider (``providers.rules.<name>``) parsed into data.

Pure: bytes in, :class:`RuleSetData` out, no I/O. The engine reads the provider's file
(``spliceway.config.provider_paths.provider_content_path``) and hands the bytes here;
:func:`spliceway.routing.rules.compile_rules` and the C route table compile the result.

Formats (``format``): ``text`` is one entry per line (``#`` and ``//`` start a comment
line, blank lines are skipped, each line is trimmed); ``yaml`` is a document with a
``payload:`` list (mihomo also reads ``rules:``), read as mihomo's YAML reader reads it
(:mod:`spliceway.clash.yaml12`: ``no`` and ``on`` stay strings); ``mrs`` is mihomo's
binary format for ``domain`` and ``ipcidr`` sets (``rules/provider/mrs_reader.go``: zstd,
a ``MRS\x01`` header, then the succinct domain trie or the address ranges), read with
the ``zstandard`` package.

Behaviours, as mihomo reads them (``rules/provider/*_strategy.go``,
``component/trie/domain.go``):

- ``domain``: ``example.com`` is that name exactly; ``+.example.com`` the name and every
  name below it; ``.example.com`` only the names below it; a ``*`` label stands for
  exactly one label (``*.example.com``, ``a.*.example.com``, ``*`` alone: any one-label
  name). Entries are lowercased; one trailing dot is dropped; a non-ASCII entry is
  written in its IDNA (punycode) form, as names arrive. An entry with a ``/``, a space,
  an empty label or a ``*`` inside a label (``a*.example.com``) is skipped.
- ``ipcidr``: networks (``10.0.0.0/8``, ``2001:db8::/32``); a bare address is its /32 or
  /128. Host bits are ignored (``10.1.2.3/8`` is ``10.0.0.0/8``).
- ``classical``: Clash rule lines without a target (``DOMAIN-SUFFIX,example.com``,
  ``IP-CIDR,10.0.0.0/8,no-resolve``), read by :mod:`spliceway.clash.rule_lines`. Lines
  that are one domain, suffix, keyword or regex item, or one target network, are folded
  into the sets below; every other line stays a rule of its own (``classical``). A line
  spliceway cannot evaluate (``PROCESS-PATH``, ``UID``...) is skipped and counted.

A few bad entries in a big list are skipped and counted (:attr:`RuleSetData.skipped`, the
first :data:`MAX_REASONS` reasons kept); a body with no valid entry, binary junk, an HTML
page or a YAML document without ``payload`` raises :class:`RuleSetError`.

Speed (a 300,000-line set is re-read while the engine routes): the plain lines that make
up big lists (``name``, ``+.name``, ``.name``, networks) are read in bulk, a chunk of
lines at a time with whole-string operations, and the common YAML shape (``payload:``
then ``  - 'x'`` lines) without a YAML parser; every other line, and every other
document, is read the reference way, one entry at a time or by yaml12, with the same
result (the tests hold the two to each other). A body is parsed once while its set is in
use (:func:`parse_rule_set` remembers sets by content), and the sets of names are kept
out of the cyclic garbage collector's sight (:func:`_untracked`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import gc
import hashlib
import ipaddress
import operator
import re
import socket
import sys
import threading
import weakref
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Literal

from pydantic import ValidationError

from spliceway.clash import rule_lines, yaml12
from spliceway.config import SubRule
from spliceway.config.validators import ADDRESS_CONDITION_KEYS

__all__ = [
    "MAX_REASONS",
    "Behavior",
    "Cidr",
    "Format",
    "RuleSetData",
    "RuleSetError",
    "empty_rule_set",
    "parse_cidr",
    "parse_rule_set",
    "range_to_cidrs",
]

Behavior = Literal["domain", "ipcidr", "classical"]
Format = Literal["text", "yaml", "mrs"]

#: A network as ``(version, network address as an integer, prefix length)``, host bits
#: cleared: ``(4, 0x0A000000, 8)`` is 10.0.0.0/8.
Cidr = tuple[int, int, int]

#: How many skip reasons a :class:`RuleSetData` keeps (the count is exact).
MAX_REASONS = 5


class RuleSetError(ValueError):
    """A rule set body that yields nothing usable (the message says why)."""


@dataclass(frozen=True, slots=True, weakref_slot=True, eq=False)
class RuleSetData:
    """One parsed rule set: what its entries match. Immutable; compare by identity.

    The shape the route compilers read (Python's :func:`~spliceway.routing.rules.
    compile_rules` and the C route table):

    - ``exact``: names matched exactly (``example.com``);
    - ``suffix``: names matched with every name below them (``+.example.com``, Clash
      ``DOMAIN-SUFFIX``): ``example.com`` and ``a.example.com``, never
      ``badexample.com``;
    - ``subdomain``: names below which every name matches, the name itself not
      (``.example.com``);
    - ``wildcard``: patterns with ``*`` labels, each ``*`` exactly one label; a pattern
      written with a leading ``.`` (``.*.example.com``) matches one or more labels in
      front of the rest (as ``subdomain`` does), otherwise the label count is exact;
    - ``keyword``: substrings of the name; ``regex``: Python ``re`` patterns searched in
      the name, case-insensitive;
    - ``cidr``: networks the target's address is matched against (the client's when the
      rule says ``rule_set_ip_cidr_match_source``), sorted, duplicates removed;
    - ``classical``: Clash lines that are not one such item, as rule parts
      (:class:`spliceway.config.SubRule`, compiled as any rule's part is); the set
      matches when one of them does.

    Names are lowercase ASCII without a trailing dot. Every domain item is matched
    against the target host when it is a name and against the sniffed host, like the
    ``domain*`` conditions. ``resolves``: whether matching the set may need a domain
    target's address (a network that came without ``no-resolve``, or a classical part
    that resolves); a rule with ``no_resolve`` never resolves for it.
    """

    behavior: Behavior
    exact: frozenset[str] = frozenset()
    suffix: frozenset[str] = frozenset()
    subdomain: frozenset[str] = frozenset()
    wildcard: tuple[str, ...] = ()
    keyword: tuple[str, ...] = ()
    regex: tuple[str, ...] = ()
    cidr: tuple[Cidr, ...] = ()
    classical: tuple[SubRule, ...] = ()
    resolves: bool = False
    #: Entries accepted (lines, or payload items).
    count: int = 0
    #: Entries skipped (bad or unsupported), and the first few reasons.
    skipped: int = 0
    skip_reasons: tuple[str, ...] = field(default=())

    @property
    def has_domains(self) -> bool:
        """Whether any entry looks at the host name (domain items or classical parts)."""
        return bool(
            self.exact
            or self.suffix
            or self.subdomain
            or self.wildcard
            or self.keyword
            or self.regex
            or self.classical
        )

    def cidr_text(self) -> Iterator[str]:
        """The networks as text (``10.0.0.0/8``), in :attr:`cidr` order."""
        for version, value, prefix in self.cidr:
            address = ipaddress.IPv4Address(value) if version == 4 else ipaddress.IPv6Address(value)
            yield f"{address}/{prefix}"


def empty_rule_set(behavior: Behavior) -> RuleSetData:
    """A set with no entry (a provider never fetched yet): it matches nothing."""
    return RuleSetData(behavior=behavior)


# ---------------------------------------------------------------------------
# Entries
# ---------------------------------------------------------------------------

_BAD_LABEL_CHAR = re.compile(r"[\s/]")


def _ascii_name(text: str) -> str:
    """``text`` lowercased, in its IDNA form when it is not ASCII (ValueError if none)."""
    text = text.lower()
    if text.isascii():
        return text
    labels = []
    for label in text.split("."):
        if label.isascii():
            labels.append(label)
            continue
        try:
            labels.append(label.encode("idna").decode("ascii"))
        except UnicodeError:
            raise ValueError(f"{text!r} has no IDNA form") from None
    return ".".join(labels)


def _gc_untrack() -> Callable[[object], None] | None:
    """CPython's ``PyObject_GC_UnTrack`` (None elsewhere)."""
    if sys.implementation.name != "cpython":
        return None
    try:
        import ctypes

        untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    except (ImportError, AttributeError):
        return None
    untrack.argtypes = [ctypes.py_object]
    untrack.restype = None
    return untrack


_GC_UNTRACK = _gc_untrack()


def _untracked(names: frozenset[str]) -> frozenset[str]:
    """``names``, taken out of the cyclic garbage collector's sight.

    A set is a container the collector walks entry by entry in every collection of its
    generation: a 300,000-name set costs each of them 50-300 ms, on whichever thread
    allocates (the dispatcher, mostly), until it reaches the oldest generation, and in
    every full collection after that. A set of strings cannot be part of a reference
    cycle (strings hold no references), so it needs no collector: reference counting
    frees it. (The set read at start is out of sight already: ``spliceway run`` freezes
    what start-up built, ``gc.freeze``.)"""
    if _GC_UNTRACK is not None and gc.is_tracked(names):
        _GC_UNTRACK(names)
    return names


class _DomainSink:
    """Collects domain entries into exact / suffix / subdomain / wildcard."""

    def __init__(self) -> None:
        self.exact: set[str] = set()
        self.suffix: set[str] = set()
        self.subdomain: set[str] = set()
        self.wildcard: dict[str, None] = {}
        #: Names read in bulk, a list a chunk: hashed into the frozensets once, at the end.
        self.bulk: tuple[list[list[str]], list[list[str]], list[list[str]]] = ([], [], [])

    def add(self, entry: str) -> None:
        """Add one mihomo domain-set entry; ValueError says why it is refused."""
        text = entry
        if not text:
            raise ValueError("empty entry")
        if _BAD_LABEL_CHAR.search(text):
            raise ValueError(f"{entry!r} is not a domain (space or '/')")
        if text.endswith(".") and text != ".":
            text = text[:-1]
        plus = text.startswith("+.")
        dot = not plus and text.startswith(".")
        rest = text[2:] if plus else text[1:] if dot else text
        if not rest:
            raise ValueError(f"{entry!r} names no domain")
        name = _ascii_name(rest)
        labels = name.split(".")
        if any(not label for label in labels):
            raise ValueError(f"{entry!r} has an empty label")
        if any("*" in label and label != "*" for label in labels):
            raise ValueError(f"{entry!r}: '*' must be a whole label")
        if "*" in labels:
            if plus or not dot:
                self.wildcard[name] = None
            if plus or dot:
                self.wildcard["." + name] = None
        elif plus:
            self.suffix.add(name)
        elif dot:
            self.subdomain.add(name)
        else:
            self.exact.add(name)

    def add_suffix(self, name: str) -> None:
        """A Clash ``DOMAIN-SUFFIX`` value (already lowercase)."""
        self.suffix.add(name)

    def frozen(self) -> tuple[frozenset[str], frozenset[str], frozenset[str], tuple[str, ...]]:
        """``(exact, suffix, subdomain, wildcard)``, each name in the narrowest set."""
        bulk_exact, bulk_suffix, bulk_subdomain = self.bulk
        exact = frozenset(chain(self.exact, *bulk_exact))
        suffix = frozenset(chain(self.suffix, *bulk_suffix))
        subdomain = frozenset(chain(self.subdomain, *bulk_subdomain))
        # "x" and ".x" are "+.x"; a name in suffix is in no other set. (Copies only when
        # they change: a big set is rarely all three.)
        both = exact & subdomain
        if both:
            suffix = suffix | both
        if not exact.isdisjoint(suffix):
            exact = exact - suffix
        if not subdomain.isdisjoint(suffix):
            subdomain = subdomain - suffix
        return _untracked(exact), _untracked(suffix), _untracked(subdomain), tuple(self.wildcard)


def _v4(text: str) -> int | None:
    try:
        return int.from_bytes(socket.inet_pton(socket.AF_INET, text), "big")
    except OSError:
        return None


def _v6(text: str) -> int | None:
    if "%" in text:
        return None  # a scope id names no network
    try:
        return int.from_bytes(socket.inet_pton(socket.AF_INET6, text), "big")
    except OSError:
        return None


def parse_cidr(text: str) -> Cidr:
    """``10.0.0.0/8``, ``2001:db8::/32`` or a bare address as a :data:`Cidr`, host bits
    cleared; ValueError otherwise. (``inet_pton``: fast for big lists, and it refuses
    what Go's ``netip`` refuses: leading zeros, short forms such as ``10.1``.)"""
    address, slash, bits = text.partition("/")
    version, width = 4, 32
    value = _v4(address)
    if value is None:
        version, width = 6, 128
        value = _v6(address)
    if value is None:
        raise ValueError(f"{text!r} is not a network (e.g. '10.0.0.0/8')")
    if slash:
        if not bits.isascii() or not bits.isdigit() or len(bits) > 3 or int(bits) > width:
            raise ValueError(f"{text!r}: prefix length must be 0..{width}")
        prefix = int(bits)
    else:
        prefix = width
    host_bits = width - prefix
    return version, (value >> host_bits) << host_bits, prefix


def range_to_cidrs(version: int, first: int, last: int) -> Iterator[Cidr]:
    """The fewest CIDRs covering ``first..last`` (inclusive), in order."""
    width = 32 if version == 4 else 128
    while first <= last:
        # The largest block aligned at ``first`` that does not pass ``last``.
        size_bits = (first & -first).bit_length() - 1 if first else width
        while size_bits > 0 and first + (1 << size_bits) - 1 > last:
            size_bits -= 1
        yield version, first, width - size_bits
        first += 1 << size_bits


# ---------------------------------------------------------------------------
# Bodies
# ---------------------------------------------------------------------------


def _looks_binary(body: bytes) -> bool:
    head = body[:4096]
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as ex:
        # A multi-byte character cut at the 4 KiB boundary is not junk.
        return ex.start < len(head) - 4
    return False


def _looks_html(text: str) -> bool:
    head = text.lstrip()[:512].lower()
    return head.startswith(("<!doctype html", "<html", "<?xml", "<head", "<body"))


def _text_lines(text: str) -> Iterator[str]:
    """The reference reading of a text body: each line trimmed, comments and blank lines
    left out."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "//")):
            continue
        yield line


def _yaml_items(text: str) -> list[str]:
    try:
        doc = yaml12.load_document(text, duplicates="report").document
    except yaml12.YamlError as ex:
        raise RuleSetError(f"not a YAML document: {ex}") from None
    if not isinstance(doc, dict):
        raise RuleSetError("a yaml rule set is a mapping with a `payload:` list")
    payload = doc.get("payload", doc.get("rules"))
    if payload is None:
        raise RuleSetError("a yaml rule set needs a `payload:` list (none found)")
    if not isinstance(payload, list):
        raise RuleSetError("`payload` must be a list of entries")
    items = []
    for item in payload:
        # Numbers and the like are entries as mihomo's decoder turns them into text.
        if isinstance(item, bool):
            items.append("true" if item else "false")
        elif isinstance(item, str | int | float):
            items.append(str(item).strip())
        else:
            items.append(repr(item))
    return [i for i in items if i]


# ---------------------------------------------------------------------------
# Fast paths: the same entries, read in bulk
# ---------------------------------------------------------------------------
#
# A body is read as runs, in order: ``(chunk, [])``, a chunk of *clean* lines (printable
# ASCII without spaces, one entry per line, ``\n`` between them, none empty, no comment)
# that a builder reads with a few string operations for the whole chunk; or ``("",
# items)``, entries read one at a time as the reference reads them. Any line with
# something else (a space, a tab, another line break, a control character, non-ASCII)
# is read the reference way; so are, inside a builder, the clean lines its bulk reading
# does not cover (a domain's ``*``, ``/`` or empty label, a network that does not parse).
# Whatever a line gives (an entry, a skip and its reason) is the same either way; only
# lines read one at a time can be skipped or give wildcards, and those are read in order,
# so the counts, the first reasons and the wildcard order are the reference's too.

_Run = tuple[str, list[str]]

#: A character that makes its line unclean.
_NOT_CLEAN = re.compile(r"[^\n!-~]")
_CLEAN_BYTES = bytes(range(0x21, 0x7F)) + b"\n"
_COMMENT_LINES = re.compile(r"^(?:#|//)[^\n]*\n", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n\n+")
#: Clean text a builder reads at once: each bulk step holds the GIL for about a
#: millisecond, so the interpreter can switch threads between chunks.
_CHUNK_CHARS = 1 << 16


def _tidy(chunk: str, comments: bool) -> str:
    """Clean lines without their blank lines (and comment lines, with ``comments``)."""
    if comments and ("#" in chunk or "//" in chunk):
        chunk = _COMMENT_LINES.sub("", chunk + "\n")
    if "\n\n" in chunk:
        chunk = _BLANK_LINES.sub("\n", chunk)
    return chunk.strip("\n")


def _clean_chunks(text: str, start: int, end: int, comments: bool) -> Iterator[_Run]:
    """``text[start:end]`` (whole clean lines) in chunks of about :data:`_CHUNK_CHARS`."""
    while start < end:
        stop = end
        if end - start > _CHUNK_CHARS:
            stop = text.find("\n", start + _CHUNK_CHARS, end)
            if stop < 0:
                stop = end
        chunk = _tidy(text[start:stop], comments)
        if chunk:
            yield chunk, []
        start = stop + 1


def _unclean_finder(text: str) -> Callable[[int], int]:
    """A function giving the position of the next unclean character of ``text`` at or
    after a position (-1: none). A search for each distinct such character when there are
    few (a text that is all ASCII), one regex search otherwise."""
    if text.isascii():
        left = text.encode("ascii").translate(None, _CLEAN_BYTES)
        if not left:
            return lambda pos: -1
        chars = [chr(c) for c in set(left)]
        if len(chars) <= 8:
            nxt = dict.fromkeys(chars, -2)  # -2: not searched yet

            def find(pos: int) -> int:
                best = -1
                for ch, at in nxt.items():
                    if at != -1 and at < pos:
                        at = nxt[ch] = text.find(ch, pos)
                    if at >= 0 and (best < 0 or at < best):
                        best = at
                return best

            return find
    search = _NOT_CLEAN.search

    def find_re(pos: int) -> int:
        m = search(text, pos)
        return -1 if m is None else m.start()

    return find_re


def _runs(text: str, expand: Callable[[str], list[str]], comments: bool) -> Iterator[_Run]:
    """``text``'s entries as runs; an unclean line goes through ``expand`` (which returns
    its entries); with ``comments``, clean lines starting ``#`` or ``//`` are dropped."""
    n = len(text)
    pos = 0
    find = _unclean_finder(text)
    while pos < n:
        at = find(pos)
        if at < 0:
            yield from _clean_chunks(text, pos, n, comments)
            return
        line_start = text.rfind("\n", pos, at) + 1 or pos
        yield from _clean_chunks(text, pos, line_start, comments)
        line_end = text.find("\n", at)
        if line_end < 0:
            line_end = n
        items = expand(text[line_start:line_end])
        if items:
            yield "", items
        pos = line_end + 1


def _text_runs(text: str) -> Iterator[_Run]:
    if "\r" in text:
        text = text.replace("\r\n", "\n")  # a lone \r is a line break too: unclean
    return _runs(text, lambda line: list(_text_lines(line)), comments=True)


def _item_runs(items: str) -> Iterator[_Run]:
    """Entries a line each, ``items`` (each one entry, trimmed, blank lines none)."""
    return _runs(items, lambda item: [item], comments=False)


# YAML: the common shape (``payload:`` then one entry per line: ``  - 'x'``, ``  - "x"``
# or ``  - x``) read line by line; anything else (another key, flow style, anchors, tags,
# escapes, tabs, a plain scalar YAML 1.2 reads as a number, boolean or null...) by
# yaml12 as before.

#: A character the shortcut does not read (control characters, line breaks besides
#: \n, a BOM): the document goes to yaml12.
_YAML_ODD = re.compile(
    "[^\n -~\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]"
)
_YAML_ASCII_OK = bytes(range(0x20, 0x7F)) + b"\n"
_NOT_SINGLE = bytes(c for c in range(256) if c not in b"'\n")
_NOT_DOUBLE = bytes(c for c in range(256) if c not in b'"\n')
#: The characters of the plain scalars the shortcut reads (and line breaks).
_PLAIN_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+._/*:-" + b"\n"
_YAML_HEAD = re.compile(
    r"(?:[ ]*(?:#[^\n]*)?\n)*(?:---(?:[ ]+(?:#[^\n]*)?)?\n(?:[ ]*(?:#[^\n]*)?\n)*)?"
    r"(?:payload|rules):(?:[ ]+(?:#[^\n]*)?)?\n"
)
_YAML_FIRST_ITEM = re.compile(r"\n([ ]*)- ")
#: A plain scalar the shortcut reads: no indicator first, no ``: `` or `` #`` inside,
#: no ``:`` last.
_YAML_PLAIN = r"[A-Za-z0-9+._/](?:[A-Za-z0-9+._/*:-]*[A-Za-z0-9+._/*-])?"
_YAML_END = r"(?:[ ]+(?:#[^\n]*)?)?(?=\n)"
_YAML_OTHER_LINES = re.compile(r"\n[ ]*(?:#[^\n]*)?(?=\n)")
#: yaml12's scalars that are not strings (resolveMap), and a superset of its numbers
#: (ints and floats with ``_`` anywhere), for a plain scalar starting ``+.0-9``.
_YAML_NOT_STR = frozenset(
    {
        *("true", "True", "TRUE", "false", "False", "FALSE", "null", "Null", "NULL"),
        *(".nan", ".NaN", ".NAN", ".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"),
        *("-.inf", "-.Inf", "-.INF"),
    }
)
_YAML_NUMBERISH = re.compile(r"[-+]?[0-9_]*\.?[0-9_]*(?:[xXoObB][0-9a-fA-F_]*|[eE][-+0-9_]*)?")


@dataclass(frozen=True, slots=True)
class _YamlItemPatterns:
    single: re.Pattern[str]
    double: re.Pattern[str]
    plain: re.Pattern[str]
    mixed: re.Pattern[str]


_YAML_PATTERNS: dict[int, _YamlItemPatterns] = {}


def _yaml_patterns(indent: int) -> _YamlItemPatterns:
    patterns = _YAML_PATTERNS.get(indent)
    if patterns is None:
        lead = "\n" + " " * indent + "-[ ]+"
        single, double, plain = r"'([^'\n]*)'", r'"([^"\\\n]*)"', f"({_YAML_PLAIN})"
        patterns = _YamlItemPatterns(
            re.compile(lead + single + _YAML_END),
            re.compile(lead + double + _YAML_END),
            re.compile(lead + plain + _YAML_END),
            re.compile(lead + f"(?:{single}|{double}|{plain}){_YAML_END}"),
        )
        if len(_YAML_PATTERNS) < 64:
            _YAML_PATTERNS[indent] = patterns
    return patterns


def _plain_is_str(value: str) -> bool:
    """Whether yaml12 reads plain scalar ``value`` as a string (conservatively: False
    for anything that might be a number)."""
    if value in _YAML_NOT_STR:
        return False
    return value[0] not in "+.0123456789" or _YAML_NUMBERISH.fullmatch(value) is None


def _yaml_text_ok(text: str) -> bool:
    """Whether the shortcut may read ``text`` (no character it leaves to yaml12)."""
    if text.isascii():
        return not text.encode("ascii").translate(None, _YAML_ASCII_OK)
    return _YAML_ODD.search(text) is None


def _uniform_yaml_values(body: str, indent: int) -> str | None:
    """Every line of ``body`` (``\n`` first and last) one item ``- <scalar>`` at
    ``indent``, every scalar written the same way (``'x'``, ``"x"``, or plain), nothing
    else (no comment, no blank line): the scalars, a line each (``\n`` first and last),
    with a few whole-text operations."""
    lines = body.count("\n") - 1
    prefix = "\n" + " " * indent + "- "
    if body.count(prefix) != lines:
        return None
    inner = body.replace(prefix, "\n")  # a prefix can only start a line: no \n inside one
    quote = inner[1]
    if quote in "'\"":
        if quote == '"' and "\\" in inner:
            return None  # an escape
        shape = inner.encode().translate(None, _NOT_SINGLE if quote == "'" else _NOT_DOUBLE)
        opened, closed = "\n" + quote, quote + "\n"
        if (
            shape != b"\n" + (quote * 2 + "\n").encode() * lines
            or inner.count(opened) != lines
            or inner.count(closed) != lines
        ):
            return None
        return inner.replace(opened, "\n").replace(closed, "\n")
    if not inner.isascii() or inner.encode("ascii").translate(None, _PLAIN_CHARS):
        return None
    if "\n\n" in inner or ":\n" in inner or any(f"\n{c}" in inner for c in "*:-"):
        return None  # an empty (null) item, a key, an alias, an indicator first
    if not _YAML_NOT_STR.isdisjoint(inner[1:-1].split("\n")):
        return None
    numberish = _YAML_NUMBERISH.fullmatch
    for value in inner[1:-1].split("\n"):
        if value[0] in "+.0123456789" and numberish(value) is not None:
            return None
    return inner


def _plain_yaml_items(text: str) -> str | None:
    """The entries of a yaml body of the common shape, as :func:`_yaml_items` reads
    them, a line each (blank lines are empty entries, which count as none); None when
    the body has another shape (yaml12 reads it)."""
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    if not _yaml_text_ok(text):
        return None
    head = _YAML_HEAD.match(text)
    if head is None:
        return None
    body = "\n" + text[head.end() :]
    if not body.endswith("\n"):
        body += "\n"
    first = _YAML_FIRST_ITEM.search(body)
    if first is None:
        return None
    joined = _uniform_yaml_values(body, len(first.group(1)))
    if joined is None:
        values = _mixed_yaml_values(body, len(first.group(1)))
        if values is None:
            return None
        joined = "\n".join(values)
    joined = joined.strip("\n")
    # An item is trimmed as yaml12's reading trims it (only an ASCII text without a
    # space has nothing to trim).
    if not joined.isascii() or " " in joined:
        joined = "\n".join(map(str.strip, joined.split("\n")))
    return joined


def _mixed_yaml_values(body: str, indent: int) -> list[str] | None:
    """The scalars of item lines at ``indent`` among comment and blank lines, each
    written its own way; None when a line is something else."""
    patterns = _yaml_patterns(indent)
    lines = body.count("\n") - 1
    values: list[str] = []
    for pattern in (patterns.single, patterns.double, patterns.plain):
        values = pattern.findall(body)
        if values:
            break
    if len(values) == lines or len(values) + len(_YAML_OTHER_LINES.findall(body)) == lines:
        if pattern is patterns.plain and not all(map(_plain_is_str, values)):
            return None
        return values
    # Items written more than one way: one pass, in order.
    found = patterns.mixed.findall(body)
    if len(found) + len(_YAML_OTHER_LINES.findall(body)) != lines:
        return None
    if not all(map(_plain_is_str, [p for _, _, p in found if p])):
        return None
    return [s or d or p for s, d, p in found]


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self.skipped = 0
        self.reasons: list[str] = []

    def skip(self, reason: str) -> None:
        self.skipped += 1
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)


def _domain_odd(line: str) -> bool:
    """A clean line the bulk domain reading leaves to _DomainSink.add: a wildcard, a
    ``/``, an empty label (``..``, a lone ``.``)."""
    return "*" in line or "/" in line or ".." in line or line == "."


_SUFFIX_LINES = re.compile(r"\n\+\.([^\n]+)")
_NOT_SUFFIX_LINES = re.compile(r"\n(?!\+\.)[^\n]+")
_SUBDOMAIN_LINES = re.compile(r"\n\.([^\n]+)")
_EXACT_LINES = re.compile(r"\n(?!\+\.|\.)([^\n]+)")


def _add_domain(sink: _DomainSink, item: str, counter: _Counter) -> None:
    try:
        sink.add(item)
    except ValueError as ex:
        counter.skip(str(ex))
    else:
        counter.count += 1


def _add_domain_chunk(sink: _DomainSink, chunk: str, counter: _Counter) -> None:
    """Clean lines: with no ``*``, ``/`` or empty label, a line is its name lowercased
    (one trailing dot dropped) in the set its prefix says (``+.``, ``.``, none)."""
    odd: list[str] = []
    if _domain_odd(chunk) or "\n.\n" in f"\n{chunk}\n":
        lines = chunk.split("\n")
        odd = [line for line in lines if _domain_odd(line)]
        chunk = "\n".join(line for line in lines if not _domain_odd(line))
    if chunk:
        # Every line led by "\n", one trailing dot dropped, no "\n" last.
        text = ("\n" + chunk.lower() + "\n").replace(".\n", "\n")[:-1]
        count = chunk.count("\n") + 1
        n_suffix, n_subdomain = text.count("\n+."), text.count("\n.")
        suffix: list[str] = []
        if n_suffix == count:
            suffix = text[3:].split("\n+.")  # a suffix list: one split
        elif n_suffix > count // 2:
            suffix = _NOT_SUFFIX_LINES.sub("", text)[3:].split("\n+.")
        elif n_suffix:
            suffix = _SUFFIX_LINES.findall(text)
        subdomain = _SUBDOMAIN_LINES.findall(text) if n_subdomain else []
        exact = _EXACT_LINES.findall(text) if n_suffix + n_subdomain < count else []
        if len(suffix) + len(subdomain) + len(exact) == count:
            for bulk, names in zip(sink.bulk, (exact, suffix, subdomain), strict=True):
                bulk.append(names)
            counter.count += count
        else:  # pragma: no cover - every clean line is one of the three
            odd = chunk.split("\n") + odd
    for item in odd:
        _add_domain(sink, item, counter)


def _domain_set(runs: Iterable[_Run], counter: _Counter) -> RuleSetData:
    sink = _DomainSink()
    for chunk, items in runs:
        if chunk:
            _add_domain_chunk(sink, chunk, counter)
        for item in items:
            _add_domain(sink, item, counter)
    exact, suffix, subdomain, wildcard = sink.frozen()
    return RuleSetData(
        behavior="domain", exact=exact, suffix=suffix, subdomain=subdomain, wildcard=wildcard
    )


_V6_KEY = 1 << 128
_V6_MASK = _V6_KEY - 1


def _cidr_key(cidr: Cidr) -> int:
    """A :data:`Cidr` as one integer that sorts as the tuple does (v4 first)."""
    version, value, prefix = cidr
    return ((_V6_KEY if version == 6 else 0) | value) << 8 | prefix


def _cidrs_of_keys(keys: Iterable[int]) -> tuple[Cidr, ...]:
    """Networks sorted, duplicates removed. Integers sort much faster than tuples, and
    a list sorted already (most are) costs one pass."""
    ordered = sorted(keys)
    ordered = list(dict.fromkeys(ordered))
    split = bisect.bisect_left(ordered, _V6_KEY << 8)
    v4, v6 = ordered[:split], ordered[split:]
    return (
        *zip(repeat(4, len(v4)), [k >> 8 for k in v4], [k & 0xFF for k in v4], strict=True),
        *zip(
            repeat(6, len(v6)), [k >> 8 & _V6_MASK for k in v6], [k & 0xFF for k in v6], strict=True
        ),
    )


def _unique_cidrs(items: Iterable[Cidr]) -> tuple[Cidr, ...]:
    return _cidrs_of_keys(map(_cidr_key, items))


_FROM_BIG = functools.partial(int.from_bytes, byteorder="big")
_NOT_SLASH_OR_NL = bytes(c for c in range(256) if c not in b"/\n")
#: array("I") holds 4-byte words on every platform CPython builds for; checked anyway.
_WORD = array("I").itemsize
_NET_MASKS = {
    width: tuple(((1 << width) - 1) ^ ((1 << (width - p)) - 1) for p in range(width + 1))
    for width in (32, 128)
}


def _cidr_lines_keys(lines: list[str]) -> list[int] | None:
    """The keys of ``lines`` when every one is a network :func:`parse_cidr` takes, read
    by it; None at the first that is not."""
    try:
        return [_cidr_key(parse_cidr(line)) for line in lines]
    except ValueError:
        return None


def _cidr_chunk_keys(chunk: str) -> list[int] | None:
    """The keys of clean lines when every one is a network as :func:`parse_cidr` reads
    it (None otherwise): with one ``/`` each, all of one family, read a column at a time
    (no object per line but the strings and integers themselves)."""
    count = chunk.count("\n") + 1
    shape = chunk.encode("ascii").translate(None, _NOT_SLASH_OR_NL)
    if shape != b"/\n" * (count - 1) + b"/" or "%" in chunk:
        return _cidr_lines_keys(chunk.split("\n"))  # bare addresses, or something to refuse
    parts = chunk.replace("\n", "/").split("/")
    addrs, bits = parts[0::2], parts[1::2]
    # 1 to 3 ASCII digits after the "/" (the chunk is ASCII).
    if min(map(len, bits)) < 1 or max(map(len, bits)) > 3 or not "".join(bits).isdigit():
        return _cidr_lines_keys(chunk.split("\n"))
    v6 = ":" in chunk
    width = 128 if v6 else 32
    prefixes = list(map(int, bits))
    if max(prefixes) > width:
        return _cidr_lines_keys(chunk.split("\n"))
    try:
        packed = list(
            map(socket.inet_pton, repeat(socket.AF_INET6 if v6 else socket.AF_INET), addrs)
        )
    except OSError:
        return _cidr_lines_keys(chunk.split("\n"))  # an address of the other family, or none
    values: Iterable[int]
    if v6:
        values = map(_FROM_BIG, packed)
    else:
        words = array("I", b"".join(packed)) if _WORD == 4 else None
        if words is not None and sys.byteorder == "little":
            words.byteswap()
        values = words.tolist() if words is not None else map(_FROM_BIG, packed)
    nets = map(operator.and_, values, map(_NET_MASKS[width].__getitem__, prefixes))
    keys = list(map(operator.or_, map(operator.lshift, nets, repeat(8)), prefixes))
    return [_V6_KEY << 8 | k for k in keys] if v6 else keys


def _ipcidr_set(runs: Iterable[_Run], counter: _Counter) -> RuleSetData:
    keys: list[int] = []
    for chunk, run_items in runs:
        items = run_items
        if chunk:
            got = _cidr_chunk_keys(chunk)
            if got is not None:
                keys += got
                counter.count += len(got)
                continue
            items = chunk.split("\n")
        for item in items:
            try:
                keys.append(_cidr_key(parse_cidr(item)))
            except ValueError as ex:
                counter.skip(str(ex))
            else:
                counter.count += 1
    return RuleSetData(behavior="ipcidr", cidr=_cidrs_of_keys(keys), resolves=bool(keys))


def _part_resolves(part: SubRule) -> bool:
    """mihomo's ``ShouldResolveIP`` for a classical line (no rule set inside one)."""
    if part.is_logical:
        return any(_part_resolves(p) for p in part.rules or ())
    return not part.no_resolve and any(
        getattr(part, key) is not None for key in ADDRESS_CONDITION_KEYS
    )


def _run_items(runs: Iterable[_Run]) -> Iterator[str]:
    for chunk, items in runs:
        if chunk:
            yield from chunk.split("\n")
        yield from items


def _classical_set(runs: Iterable[_Run], counter: _Counter) -> RuleSetData:
    sink = _DomainSink()
    keywords: dict[str, None] = {}
    regexes: dict[str, None] = {}
    cidrs: list[Cidr] = []
    parts: list[SubRule] = []
    resolves = False
    for item in _run_items(runs):
        parsed = rule_lines.parse_rule_line(item, with_target=False, in_rule_set=True)
        if isinstance(parsed, rule_lines.Unsupported):
            counter.skip(f"{item!r}: {parsed.reason}")
            continue
        folded = rule_lines.single_item(parsed)
        if folded is None:
            try:
                part = SubRule.model_validate(parsed.rule)
            except ValidationError as ex:
                counter.skip(f"{item!r}: {ex.errors()[0]['msg']}")
                continue
            counter.count += 1
            parts.append(part)
            resolves = resolves or _part_resolves(part)
            continue
        counter.count += 1
        key, value, no_resolve = folded
        if key == "domain":
            sink.exact.add(value)
        elif key == "domain_suffix":
            sink.add_suffix(value)
        elif key == "domain_keyword":
            keywords[value] = None
        elif key == "domain_regex":
            regexes[value] = None
        else:  # ip_cidr
            cidrs.append(parse_cidr(value))
            resolves = resolves or not no_resolve
    exact, suffix, subdomain, wildcard = sink.frozen()
    return RuleSetData(
        behavior="classical",
        exact=exact,
        suffix=suffix,
        subdomain=subdomain,
        wildcard=wildcard,
        keyword=tuple(keywords),
        regex=tuple(regexes),
        cidr=_unique_cidrs(cidrs),
        classical=tuple(parts),
        resolves=resolves,
    )


_BUILDERS = {"domain": _domain_set, "ipcidr": _ipcidr_set, "classical": _classical_set}

# ---------------------------------------------------------------------------
# mrs: mihomo's binary rule sets (rules/provider/mrs_reader.go)
# ---------------------------------------------------------------------------

_MRS_MAGIC = b"MRS\x01"
_MRS_BEHAVIOR = {"domain": 0, "ipcidr": 1}
#: Largest decompressed mrs body read (a zstd bomb stops here).
MRS_MAX_BYTES = 64 * 1024 * 1024
_V4_MAPPED = 0xFFFF << 32


class _Reader:
    """Big-endian reads off a byte string, each failing with a RuleSetError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise RuleSetError(f"mrs: truncated ({what})")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def int64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "big", signed=True)

    def length(self, what: str, unit: int) -> int:
        n = self.int64(what)
        if n < 1 or n * unit > len(self.data) - self.at:
            raise RuleSetError(f"mrs: invalid {what} length {n}")
        return n


def _zstd_decompress(body: bytes) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise RuleSetError(
            "format 'mrs' needs the zstandard package (pip install zstandard), or fetch "
            "the provider's text/yaml form"
        ) from None
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        out = reader.read(MRS_MAX_BYTES + 1)
    except zstandard.ZstdError as ex:
        raise RuleSetError(f"mrs: not zstd-compressed ({ex})") from None
    if len(out) > MRS_MAX_BYTES:
        raise RuleSetError(f"mrs: decompresses to more than {MRS_MAX_BYTES} bytes")
    return out


def _mrs_domain_keys(r: _Reader) -> Iterator[str]:
    """The keys of mihomo's succinct ``DomainSet`` (``component/trie/domain_set.go``).

    Its nodes are numbered in breadth-first order; ``labelBitmap`` lists, node after
    node, a 0 per child (edge ``k`` carries ``labels[k]`` to node ``k + 1``) and a 1
    closing the node; ``leaves`` marks the nodes where a key ends. Keys are stored
    reversed (``moc.elpmaxe``)."""
    if r.take(1, "domain set version") != b"\x01":
        raise RuleSetError("mrs: unknown domain set version")
    leaves = [r.int64("leaves") for _ in range(r.length("leaves", 8))]
    words = [r.int64("label bitmap") for _ in range(r.length("label bitmap", 8))]
    labels = r.take(r.length("labels", 1), "labels")
    parent = [0]
    node = edge = 0
    for word in words:
        word &= 0xFFFFFFFFFFFFFFFF
        for bit in range(64):
            if (word >> bit) & 1:
                node += 1
            else:
                if edge >= len(labels) or node >= len(parent):
                    break
                parent.append(node)
                edge += 1
    for node_id in range(len(parent)):
        word = node_id >> 6
        if word >= len(leaves) or not (leaves[word] >> (node_id & 63)) & 1:
            continue
        chars = bytearray()
        at = node_id
        while at:
            chars.append(labels[at - 1])
            at = parent[at]
        # Walking up reads the reversed key backwards: the domain as written.
        yield chars.decode("utf-8", errors="replace")


def _mrs_cidrs(r: _Reader) -> Iterator[Cidr]:
    """The ranges of mihomo's ``IpCidrSet`` (``component/cidr/ipcidr_set_bin.go``)."""
    if r.take(1, "ipcidr set version") != b"\x01":
        raise RuleSetError("mrs: unknown ipcidr set version")
    for _ in range(r.length("ranges", 32)):
        first = int.from_bytes(r.take(16, "range"), "big")
        last = int.from_bytes(r.take(16, "range"), "big")
        if first >> 32 == 0xFFFF and last >> 32 == 0xFFFF:  # Unmap(): IPv4
            yield from range_to_cidrs(4, first - _V4_MAPPED, last - _V4_MAPPED)
        elif first <= last:
            yield from range_to_cidrs(6, first, last)
        else:
            raise RuleSetError("mrs: a range ends before it starts")


def _mrs_items(body: bytes, behavior: Behavior) -> tuple[int, list[str] | list[Cidr]]:
    """``(the header's entry count, the keys or networks)`` of an mrs body."""
    if behavior not in _MRS_BEHAVIOR:
        raise RuleSetError("format 'mrs' holds domain or ipcidr sets only (mihomo's too)")
    r = _Reader(_zstd_decompress(body))
    if r.take(4, "magic") != _MRS_MAGIC:
        raise RuleSetError("mrs: not a mihomo rule set (no MRS magic)")
    kind = r.take(1, "behavior")[0]
    if kind != _MRS_BEHAVIOR[behavior]:
        names = {v: k for k, v in _MRS_BEHAVIOR.items()}
        raise RuleSetError(
            f"mrs: the file holds a {names.get(kind, f'#{kind}')} set, not {behavior}"
        )
    count = r.int64("count")
    extra = r.int64("extra")
    if extra < 0:
        raise RuleSetError("mrs: invalid extra length")
    r.take(extra, "extra")
    if behavior == "domain":
        # "+.x" in a DomainSet is what mihomo's trie made of ".x": the names below x.
        keys = ["." + k[2:] if k.startswith("+.") else k for k in _mrs_domain_keys(r)]
        return count, keys
    return count, list(_mrs_cidrs(r))


def _parse_mrs(body: bytes, behavior: Behavior) -> RuleSetData:
    count, items = _mrs_items(body, behavior)
    counter = _Counter()
    if behavior == "domain":
        data = _domain_set([("", items)], counter)  # type: ignore[list-item]
    else:
        cidrs = _unique_cidrs(items)  # type: ignore[arg-type]
        counter.count = len(cidrs)
        data = RuleSetData(behavior="ipcidr", cidr=cidrs, resolves=bool(cidrs))
    if counter.count == 0:
        raise RuleSetError(f"no valid {behavior} entry in the mrs rule set")
    if count > 0:
        counter.count = count  # the entries as written (a "+.x" is two keys in the trie)
    return _with_counts(data, counter)


def _with_counts(data: RuleSetData, counter: _Counter) -> RuleSetData:
    return dataclasses.replace(
        data, count=counter.count, skipped=counter.skipped, skip_reasons=tuple(counter.reasons)
    )


#: Sets parsed, by content (sha256 of the body, behavior, format), for as long as anything
#: holds them: a provider's refresh parses a new body to check it, and the reload that
#: follows reads the same bytes from the file and gets the same set, not a second parse.
_MEMO: weakref.WeakValueDictionary[tuple[bytes, str, str], RuleSetData] = (
    weakref.WeakValueDictionary()
)
_MEMO_LOCK = threading.Lock()


def parse_rule_set(body: bytes, behavior: Behavior, fmt: Format) -> RuleSetData:
    """Parse a rule provider's content (see the module). Raises :class:`RuleSetError`
    for a body with no usable entry, binary junk, an HTML page, a YAML document without
    ``payload``, a damaged ``mrs`` file.

    The same bytes read the same way give the same (immutable) object while it is in
    use anywhere: a set is parsed once however many readers ask for it."""
    if behavior not in _BUILDERS:
        raise RuleSetError(f"unknown behavior {behavior!r} (domain, ipcidr or classical)")
    if fmt not in ("text", "yaml", "mrs"):
        raise RuleSetError(f"unknown format {fmt!r} (text, yaml or mrs)")
    key = (hashlib.sha256(body).digest(), behavior, fmt)
    with _MEMO_LOCK:
        data = _MEMO.get(key)
    if data is None:
        data = _parse(body, behavior, fmt)
        with _MEMO_LOCK:
            data = _MEMO.setdefault(key, data)
    return data


def _parse(body: bytes, behavior: Behavior, fmt: Format, *, fast: bool = True) -> RuleSetData:
    """:func:`parse_rule_set` without the memo; ``fast=False`` reads every entry the
    reference way, one at a time (what the tests compare the fast paths with)."""
    if fmt == "mrs":
        return _parse_mrs(body, behavior)
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:]
    if _looks_binary(body):
        raise RuleSetError("the content is binary, not a text or yaml rule set")
    text = body.decode("utf-8", errors="replace")
    if _looks_html(text):
        raise RuleSetError("the content is an HTML page (an error page?), not a rule set")
    runs: Iterable[_Run]
    if fmt == "yaml":
        plain = _plain_yaml_items(text) if fast else None
        runs = _item_runs(plain) if plain is not None else [("", _yaml_items(text))]
    else:
        runs = _text_runs(text) if fast else [("", list(_text_lines(text)))]
    counter = _Counter()
    data = _BUILDERS[behavior](runs, counter)
    if counter.count == 0:
        first = f": {counter.reasons[0]}" if counter.reasons else ""
        raise RuleSetError(
            f"no valid {behavior} entry in the rule set ({counter.skipped} skipped{first})"
        )
    return _with_counts(data, counter)
