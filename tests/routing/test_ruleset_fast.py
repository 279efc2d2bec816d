"""spliceway.routing.ruleset's fast paths read every body as the reference reading does.

``parse_rule_set`` reads clean lines of text bodies in bulk and the common YAML shape
without yaml12; ``_parse(..., fast=False)`` is the reference (every entry one at a time,
every YAML document through yaml12). For any body the two give the same set, counts and
first skip reasons, or the same error. And a body is parsed once: the same bytes give the
same object while it is held.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spliceway.routing import ruleset
from spliceway.routing.ruleset import RuleSetData, RuleSetError, _parse, parse_rule_set

FIELDS = (
    "behavior",
    "exact",
    "suffix",
    "subdomain",
    "wildcard",
    "keyword",
    "regex",
    "cidr",
    "classical",
    "resolves",
    "count",
    "skipped",
    "skip_reasons",
)


def outcome(body: bytes, behavior: Any, fmt: Any, *, fast: bool) -> Any:
    try:
        data = _parse(body, behavior, fmt, fast=fast)
    except RuleSetError as ex:
        return ("error", str(ex))
    return tuple(getattr(data, f) for f in FIELDS)


def same(body: bytes, behavior: str, fmt: str) -> None:
    assert outcome(body, behavior, fmt, fast=True) == outcome(body, behavior, fmt, fast=False)


LABEL = st.text(alphabet="abcXYZ019-_", min_size=1, max_size=6)
NAME = st.lists(LABEL, min_size=1, max_size=4).map(".".join)
DOMAIN_ENTRY = st.one_of(
    NAME,
    NAME.map(lambda n: "+." + n),
    NAME.map(lambda n: "." + n),
    NAME.map(lambda n: n + "."),
    NAME.map(lambda n: "+." + n + "."),
    NAME.map(lambda n: "*." + n),
    NAME.map(lambda n: "+.*." + n),
    NAME.map(lambda n: "a*." + n),
    NAME.map(lambda n: n + ".." + n),
    NAME.map(lambda n: n + "/x"),
    NAME.map(lambda n: "#" + n),
    NAME.map(lambda n: "//" + n),
    st.sampled_from([".", "+.", "+..", "..", "+", "*", "例子.测试", "Bücher.DE", "a\u00a0b"]),
)
V4 = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))
V6 = st.sampled_from(["::1", "2001:db8::", "fe80::1%eth0", "::ffff:1.2.3.4", "2001:DB8:0:1::"])
PREFIX = st.one_of(st.integers(0, 129).map(str), st.sampled_from(["", "-1", "08", "1234", "x"]))
CIDR_ENTRY = st.one_of(
    st.tuples(V4, PREFIX).map("/".join),
    st.tuples(V6, PREFIX).map("/".join),
    V4,
    V6,
    st.sampled_from(["10.1/8", "01.2.3.4/8", "1.2.3.4/5/6", "1.2.3.4//8", "garbage", "::/"]),
)
CLASSICAL_ENTRY = st.one_of(
    NAME.map(lambda n: "DOMAIN," + n),
    NAME.map(lambda n: "DOMAIN-SUFFIX," + n),
    CIDR_ENTRY.map(lambda c: "IP-CIDR," + c),
    st.sampled_from(["DST-PORT,53", "UID,1000", "MATCH", "GEOIP,cn", "DOMAIN-KEYWORD,kw"]),
)
#: What may surround an entry on its line, or stand between lines.
PAD = st.sampled_from(["", "", "", " ", "\t", "\u3000"])
BREAK = st.sampled_from(["\n", "\n", "\n", "\r\n", "\n\n", "\r", "\x0b", "\x85", "\u2028"])


@st.composite
def text_body(draw: Any, entry: Any) -> bytes:
    lines = draw(st.lists(st.tuples(PAD, entry, PAD), max_size=40))
    out = ""
    for before, item, after in lines:
        out += before + item + after + draw(BREAK)
    if draw(st.booleans()):
        out = "# a comment\n" + out
    prefix = "\ufeff" if draw(st.booleans()) else ""
    return (prefix + out).encode()


def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of a few lines: the boundaries between chunks are read as often as lines.
    monkeypatch.setattr(ruleset, "_CHUNK_CHARS", 24)


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(body=text_body(DOMAIN_ENTRY))
def test_domain_text_matches_the_reference(body: bytes) -> None:
    same(body, "domain", "text")


@SETTINGS
@given(body=text_body(CIDR_ENTRY))
def test_ipcidr_text_matches_the_reference(body: bytes) -> None:
    same(body, "ipcidr", "text")


@SETTINGS
@given(body=text_body(CLASSICAL_ENTRY))
def test_classical_text_matches_the_reference(body: bytes) -> None:
    same(body, "classical", "text")


@SETTINGS
@given(domains=text_body(DOMAIN_ENTRY), cidrs=text_body(CIDR_ENTRY))
def test_chunk_boundaries_change_nothing(domains: bytes, cidrs: bytes) -> None:
    with pytest.MonkeyPatch.context() as mp:
        small_chunks(mp)
        same(domains, "domain", "text")
        same(cidrs, "ipcidr", "text")


def test_uniform_clean_chunks_in_bulk() -> None:
    """Big clean bodies (the bulk paths, many chunks) with a few odd lines among them."""
    names = [f"+.s{i}.z{i % 97}.test" if i % 10 else f"E{i}.z.test." for i in range(20_000)]
    names[5000] = "*.wild.test"
    names[7000] = "bad entry"
    names[9000] = "例子.测试"
    same("\n".join(names).encode(), "domain", "text")
    v4 = [f"{i >> 8 & 255}.{i & 255}.{i % 7}.0/{16 + i % 17}" for i in range(20_000)]
    same("\n".join(v4).encode(), "ipcidr", "text")
    v4[100] = "10.0.0.0/33"
    v4[200] = "192.168.0.1"
    same("\n".join(v4).encode(), "ipcidr", "text")
    v6 = [f"2001:db8:{i:x}::/{48 + i % 80}" for i in range(5000)]
    same("\n".join(v6).encode(), "ipcidr", "text")
    same("\n".join(v4 + v6).encode(), "ipcidr", "text")


@pytest.mark.parametrize(
    "kinds",
    [("+.",), ("",), (".",), ("+.", "+.", "+.", ""), ("", "", "+."), ("+.", ".", ""), (".", "+.")],
)
@pytest.mark.parametrize("chunk_chars", [24, 4096])
def test_chunks_of_every_mix(kinds: tuple[str, ...], chunk_chars: int) -> None:
    """Chunks all suffixes, all exact, all subdomains, or mixed one way or another, with
    names repeated across kinds ("x" and ".x" are "+.x")."""
    dot = ["", "", "."]
    lines = [f"{kinds[i % len(kinds)]}N{i % 700}.Test{dot[i % 3]}" for i in range(3000)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ruleset, "_CHUNK_CHARS", chunk_chars)
        same("\n".join(lines).encode(), "domain", "text")
        body = "payload:\n" + "".join(f"  - '{line}'\n" for line in lines)
        same(body.encode(), "domain", "yaml")


# -- YAML ------------------------------------------------------------------------------

#: Plain scalars yaml12 reads as something else than the text (numbers, booleans, null).
TRICKY_PLAIN = st.sampled_from(
    [
        *("10", "0x1F", "0o17", "0b11", "1e3", "1.5", ".5", "1_000", "+1", "-.inf", ".NaN"),
        *("true", "True", "FALSE", "null", "Null", "~", "yes", "no", "on", "1.2.3.4"),
        *("10.0.0.0/8", "+.a", "2001:db8::/32", "::1", "a:", "-a", "*a", "a #c", "a#b"),
        *("1_e3", "_1", "+.5e3"),
    ]
)
YAML_VALUE = st.one_of(DOMAIN_ENTRY, CIDR_ENTRY, TRICKY_PLAIN, st.text(max_size=6))


@st.composite
def yaml_item(draw: Any, indent: str, style: str | None) -> str:
    value = draw(YAML_VALUE)
    style = style or draw(st.sampled_from(["single", "double", "plain"]))
    if style == "single":
        scalar = "'" + value.replace("'", "''") + "'"
    elif style == "double":
        scalar = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        scalar = value
    tail = draw(st.sampled_from(["", "", " ", " # note", "  #x"]))
    return f"{indent}-{draw(st.sampled_from([' ', ' ', '  ']))}{scalar}{tail}"


@st.composite
def yaml_body(draw: Any) -> bytes:
    indent = draw(st.sampled_from(["", "  ", "  ", "    "]))
    style = draw(st.sampled_from([None, "single", "double", "plain"]))
    lines = draw(st.lists(yaml_item(indent, style), max_size=30))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(["", "# c", "  #"])))
    key = draw(st.sampled_from(["payload:", "payload:", "rules:", "payload: # x", "proxies:"]))
    head = draw(st.sampled_from(["", "", "---\n", "# head\n", "other: 1\n", "payload:\n"]))
    text = head + key + "\n" + "\n".join(lines)
    if draw(st.booleans()):
        text += "\n"
    if draw(st.booleans()):
        text = text.replace("\n", "\r\n")
    return text.encode()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=yaml_body(), behavior=st.sampled_from(["domain", "ipcidr", "classical"]))
def test_yaml_matches_yaml12(body: bytes, behavior: str) -> None:
    same(body, behavior, "yaml")


@pytest.mark.parametrize(
    "body",
    [
        b"payload:\n  - 'a.test'\n  - '+.b.test'\n  - ' c.test '\n",
        b'payload:\n- "a.test"\n- "+.b.test"\n',
        b"payload:\n  - a.test\n  - +.b.test\n  - .c.test\n",
        b"payload:\n  - a.test\n  - 'b.test'\n  # c\n\n  - \"c.test\"  # d\n",
        b"payload:\n  - 10\n  - a.test\n",  # a number: yaml12 reads it
        b"payload:\n  - True\n  - a.test\n",
        b"payload:\n  - a.test\n  - b.test:\n",  # a mapping
        b"payload:\n  - 'a''b.test'\n",  # an escaped quote
        b"payload:\n  - a.test\n other: 1\n",
        b"payload:\n\t- a.test\n",
        b"payload:\n  - '\xe4\xbe\x8b\xe5\xad\x90.\xe6\xb5\x8b\xe8\xaf\x95'\n",
    ],
)
def test_yaml_shapes(body: bytes) -> None:
    for behavior in ("domain", "ipcidr", "classical"):
        same(body, behavior, "yaml")


def test_uniform_yaml_in_bulk() -> None:
    names = [f"+.s{i}.z.test" if i % 10 else f"e{i}.z.test" for i in range(20_000)]
    for style in ("'{}'", '"{}"', "{}"):
        body = "payload:\n" + "".join(f"  - {style.format(n)}\n" for n in names)
        same(body.encode(), "domain", "yaml")
        assert ruleset._plain_yaml_items(body) == "\n".join(names)
    cidrs = [f"10.{i >> 8 & 255}.{i & 255}.0/24" for i in range(5000)]
    body = "payload:\n" + "".join(f"  - {c}\n" for c in cidrs)
    assert ruleset._plain_yaml_items(body) == "\n".join(cidrs)
    same(body.encode(), "ipcidr", "yaml")


# -- parsed once -----------------------------------------------------------------------


def test_the_same_bytes_give_the_same_set_while_it_is_held() -> None:
    body = b"DOMAIN-SUFFIX,once.test\nexact.test\n"
    first = parse_rule_set(body, "domain", "text")
    assert parse_rule_set(bytes(body), "domain", "text") is first
    # Another reading of the same bytes is another set.
    other = parse_rule_set(body, "classical", "text")
    assert other is not first and other.suffix == {"once.test"}
    assert parse_rule_set(body + b"\n", "domain", "text") is not first
    ident = id(first)
    del first, other
    gc.collect()
    # Nothing held it: the memo kept no copy (a refreshed set is freed once unused).
    again = parse_rule_set(body, "domain", "text")
    assert isinstance(again, RuleSetData) and again.count == 2
    assert not any(id(v) == ident for v in ruleset._MEMO.values() if v is not again)


def test_errors_are_not_remembered() -> None:
    with pytest.raises(RuleSetError):
        parse_rule_set(b"bad one\n", "domain", "text")
    with pytest.raises(RuleSetError):
        parse_rule_set(b"bad one\n", "domain", "text")


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's collector")
def test_name_sets_are_out_of_the_cyclic_collectors_sight() -> None:
    """A big set of names walked in every collection of its generation costs the thread
    that collects (the dispatcher, mostly) 50-300 ms a time: strings make no cycles, so
    the sets are not tracked, and reference counting frees them."""
    data = _parse(b"+.a.test\nb.test\n.c.test\n", "domain", "text")
    for names in (data.exact, data.suffix, data.subdomain):
        assert names and not gc.is_tracked(names)
    gone = weakref.ref(data)
    del data
    assert gone() is None  # no collection needed
