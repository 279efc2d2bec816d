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
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
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


class _DomainSink:
    """Collects domain entries into exact / suffix / subdomain / wildcard."""

    def __init__(self) -> None:
        self.exact: set[str] = set()
        self.suffix: set[str] = set()
        self.subdomain: set[str] = set()
        self.wildcard: dict[str, None] = {}

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
        both = self.exact & self.subdomain
        suffix = self.suffix | both
        exact = self.exact - suffix
        subdomain = self.subdomain - suffix
        return frozenset(exact), frozenset(suffix), frozenset(subdomain), tuple(self.wildcard)


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


def _unique_cidrs(items: Iterable[Cidr]) -> tuple[Cidr, ...]:
    return tuple(sorted(set(items)))


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


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self.skipped = 0
        self.reasons: list[str] = []

    def skip(self, reason: str) -> None:
        self.skipped += 1
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(reason)


def _domain_set(items: Iterable[str], counter: _Counter) -> RuleSetData:
    sink = _DomainSink()
    for item in items:
        try:
            sink.add(item)
        except ValueError as ex:
            counter.skip(str(ex))
        else:
            counter.count += 1
    exact, suffix, subdomain, wildcard = sink.frozen()
    return RuleSetData(
        behavior="domain", exact=exact, suffix=suffix, subdomain=subdomain, wildcard=wildcard
    )


def _ipcidr_set(items: Iterable[str], counter: _Counter) -> RuleSetData:
    cidrs: list[Cidr] = []
    for item in items:
        try:
            cidrs.append(parse_cidr(item))
        except ValueError as ex:
            counter.skip(str(ex))
        else:
            counter.count += 1
    return RuleSetData(behavior="ipcidr", cidr=_unique_cidrs(cidrs), resolves=bool(cidrs))


def _part_resolves(part: SubRule) -> bool:
    """mihomo's ``ShouldResolveIP`` for a classical line (no rule set inside one)."""
    if part.is_logical:
        return any(_part_resolves(p) for p in part.rules or ())
    return not part.no_resolve and any(
        getattr(part, key) is not None for key in ADDRESS_CONDITION_KEYS
    )


def _classical_set(items: Iterable[str], counter: _Counter) -> RuleSetData:
    sink = _DomainSink()
    keywords: dict[str, None] = {}
    regexes: dict[str, None] = {}
    cidrs: list[Cidr] = []
    parts: list[SubRule] = []
    resolves = False
    for item in items:
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
        data = _domain_set(items, counter)  # type: ignore[arg-type]
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


def parse_rule_set(body: bytes, behavior: Behavior, fmt: Format) -> RuleSetData:
    """Parse a rule provider's content (see the module). Raises :class:`RuleSetError`
    for a body with no usable entry, binary junk, an HTML page, a YAML document without
    ``payload``, a damaged ``mrs`` file."""
    if behavior not in _BUILDERS:
        raise RuleSetError(f"unknown behavior {behavior!r} (domain, ipcidr or classical)")
    if fmt == "mrs":
        return _parse_mrs(body, behavior)
    if fmt not in ("text", "yaml"):
        raise RuleSetError(f"unknown format {fmt!r} (text, yaml or mrs)")
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:]
    if _looks_binary(body):
        raise RuleSetError("the content is binary, not a text or yaml rule set")
    text = body.decode("utf-8", errors="replace")
    if _looks_html(text):
        raise RuleSetError("the content is an HTML page (an error page?), not a rule set")
    items: Iterable[str] = _yaml_items(text) if fmt == "yaml" else _text_lines(text)
    counter = _Counter()
    data = _BUILDERS[behavior](items, counter)
    if counter.count == 0:
        first = f": {counter.reasons[0]}" if counter.reasons else ""
        raise RuleSetError(
            f"no valid {behavior} entry in the rule set ({counter.skipped} skipped{first})"
        )
    return _with_counts(data, counter)
