"""spliceway.clash.yaml12: YAML decoded as yaml.v3 (mihomo) decodes it."""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.clash.yaml12 import Duplicate, YamlError, go_parse_int, load, load_document

# A subconverter-style head: YAML 1.1 would turn several of these into booleans or
# sexagesimal integers.
SUBSCRIPTION = """\
port: 7890
socks-port: 7891
allow-lan: true
mode: Rule
log-level: info
external-controller: :9090
proxies:
  - {name: "on", type: ss, server: 1.2.3.4, port: 8388, cipher: aes-128-gcm, password: no}
  - {name: off, type: ss, server: 1.2.3.5, port: "8389", cipher: aes-256-gcm, password: yes}
  - {name: y, type: socks5, server: 10.0.0.1, port: 1080, username: n, password: 1:20}
"""


def test_subscription_scalars_keep_their_1_2_meaning() -> None:
    doc = load(SUBSCRIPTION)
    assert doc["allow-lan"] is True
    assert doc["mode"] == "Rule"
    assert doc["external-controller"] == ":9090"
    names = [p["name"] for p in doc["proxies"]]
    assert names == ["on", "off", "y"]
    assert [p["password"] for p in doc["proxies"]] == ["no", "yes", "1:20"]
    assert doc["proxies"][2]["username"] == "n"
    assert doc["proxies"][0]["port"] == 8388
    assert doc["proxies"][1]["port"] == "8389"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("false", False),
        ("FALSE", False),
        ("tRUE", "tRUE"),
        ("yes", "yes"),
        ("No", "No"),
        ("ON", "ON"),
        ("off", "off"),
        ("y", "y"),
        ("n", "n"),
        ("~", None),
        ("null", None),
        ("Null", None),
        ("NULL", None),
        ("nULL", "nULL"),
        ("", None),
        ("1:20", "1:20"),
        ("190:20:30", "190:20:30"),
        ("0777", 511),
        ("0o17", 15),
        ("0x1F", 31),
        ("0b101", 5),
        ("-0x10", -16),
        ("+12", 12),
        ("1_000", 1000),
        ("08", 8.0),
        ("1.5", 1.5),
        (".5", 0.5),
        ("1e3", 1000.0),
        ("-2.5E-1", -0.25),
        (".inf", math.inf),
        ("-.Inf", -math.inf),
        ("+.INF", math.inf),
        ("2024-01-02", "2024-01-02"),
        ("=", "="),
        ("0x", "0x"),
        ("1.2.3.4", "1.2.3.4"),
        ("18446744073709551615", 18446744073709551615),
        ("-9223372036854775808", -9223372036854775808),
        ('"123"', "123"),
        ("'true'", "true"),
    ],
)
def test_plain_scalars_resolve_as_yaml_v3(text: str, value: object) -> None:
    assert load(f"k: {text}\n") == {"k": value}
    got = load(f"k: {text}\n")["k"]
    assert type(got) is type(value)


def test_nan_and_big_numbers() -> None:
    assert math.isnan(load("k: .NaN\n")["k"])
    # Above uint64: yaml.v3 reads it as a float.
    assert load("k: 18446744073709551616\n")["k"] == float(18446744073709551616)
    assert load("k: 1e400\n")["k"] == "1e400"


def test_keys_resolve_the_same_way() -> None:
    assert load("yes: 1\non: 2\n3: x\n") == {"yes": 1, "on": 2, 3: "x"}


def test_explicit_tags() -> None:
    assert load("a: !!str 123\nb: !!int '0x10'\nc: !!float '1'\n") == {
        "a": "123",
        "b": 16,
        "c": 1.0,
    }
    with pytest.raises(YamlError, match="line 1, column 4: cannot decode 'abc' as an integer"):
        load("x: !!int abc\n")
    with pytest.raises(YamlError, match="as a boolean"):
        load("x: !!bool yes\n")


def test_merge_keys_as_yaml_v3() -> None:
    doc = load(
        """\
base: &base {type: ss, cipher: aes-128-gcm, udp: true}
other: &other {cipher: aes-256-gcm, plugin: obfs, port: 1}
p1:
  <<: *base
  name: a
  udp: false
p2:
  <<: [*base, *other]
  name: b
p3:
  <<: [*other, *base]
nested:
  <<: {<<: *base, name: inner}
  port: 2
"""
    )
    assert doc["p1"] == {"type": "ss", "cipher": "aes-128-gcm", "udp": False, "name": "a"}
    # Of the merged mappings the first listed wins.
    assert doc["p2"]["cipher"] == "aes-128-gcm" and doc["p2"]["plugin"] == "obfs"
    assert doc["p3"]["cipher"] == "aes-256-gcm"
    assert doc["nested"] == {
        "type": "ss",
        "cipher": "aes-128-gcm",
        "udp": True,
        "name": "inner",
        "port": 2,
    }
    # The anchored mappings are unchanged by being merged.
    assert doc["base"] == {"type": "ss", "cipher": "aes-128-gcm", "udp": True}


def test_anchor_used_as_a_value_twice() -> None:
    doc = load("a: &g [x, y]\nb: *g\nc: {<<: &m {k: 1}}\nd: *m\n")
    assert doc == {"a": ["x", "y"], "b": ["x", "y"], "c": {"k": 1}, "d": {"k": 1}}


def test_duplicate_keys_are_errors_with_both_lines() -> None:
    with pytest.raises(YamlError) as info:
        load("proxies: []\nmode: rule\nproxies: [1]\n")
    assert str(info.value) == "line 3, column 1: mapping key 'proxies' already defined at line 1"
    assert (info.value.line, info.value.column) == (3, 1)
    with pytest.raises(YamlError, match="mapping key 'name' already defined"):
        load("- {name: a, name: b}\n")
    with pytest.raises(YamlError, match="'<<' already defined"):
        load("a: &a {x: 1}\nb: {<<: *a, <<: *a}\n")


def test_duplicates_reported_on_request_last_wins() -> None:
    loaded = load_document("a: 1\nb: {c: 1, c: 2}\na: 3\n", duplicates="report")
    assert loaded.document == {"b": {"c": 2}, "a": 3}
    assert set(loaded.duplicates) == {
        Duplicate("a", 3, 1, 1),
        Duplicate("c", 2, 11, 2),
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1,\n", "line 2, column 1"),
        ("a: 'open\n", "line 2"),
        ("a:\n\t- 1\n", "line 2"),
        ("a: *nowhere\n", "line 1, column 4"),
        ("a: &a {<<: 1}\n", "map merge requires map or sequence of maps"),
        ("a: {<<: [1]}\n", "map merge requires map or sequence of maps"),
    ],
)
def test_malformed_documents_say_where(text: str, message: str) -> None:
    with pytest.raises(YamlError, match=message):
        load(text)


def test_billion_laughs_is_refused_quickly() -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    with pytest.raises(YamlError, match="excessive aliasing"):
        load("\n".join(lines) + "\n")


def test_moderate_aliasing_is_fine() -> None:
    # A provider-style file: one anchor reused by a hundred groups.
    text = "x: &p [a, b, c, d]\ngroups:\n" + "".join(
        f"  - {{name: g{i}, proxies: *p}}\n" for i in range(100)
    )
    doc = load(text)
    assert len(doc["groups"]) == 100 and doc["groups"][99]["proxies"] == ["a", "b", "c", "d"]


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    # PyYAML 6.0.4 refuses past its own limit first ("exceeded maximum nesting depth",
    # at 1,000); older ones reach yaml.v3's 10,000 that the loader enforces itself.
    with pytest.raises(YamlError, match=r"exceeded max(imum nesting)? depth"):
        load("a: " + "[" * 20000 + "]" * 20000 + "\n")
    assert load("a: " + "[" * 100 + "]" * 100 + "\n") is not None


def test_bytes_bom_empty_and_documents() -> None:
    assert load(b"\xef\xbb\xbfmode: rule\n") == {"mode": "rule"}
    assert load("") is None
    assert load("# only a comment\n") is None
    assert load("--- {a: 1}\n--- {a: 2}\n") == {"a": 1}
    with pytest.raises(YamlError, match="not UTF-8"):
        load(b"mode: \xff\n")


def test_emoji_and_cjk_names() -> None:
    doc = load("proxy-groups:\n  - name: 🚀 节点选择\n    proxies: [♻️ 自动选择, DIRECT]\n")
    assert doc["proxy-groups"][0] == {"name": "🚀 节点选择", "proxies": ["♻️ 自动选择", "DIRECT"]}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("443", 443),
        ("0x1bb", 443),
        ("0o673", 443),
        ("0673", 443),
        ("0b1", 1),
        ("-1", -1),
        ("+1", 1),
        ("9223372036854775807", 9223372036854775807),
        ("18446744073709551615", 18446744073709551615),
        ("-9223372036854775809", None),
        ("+18446744073709551615", None),
        ("18446744073709551616", None),
        ("08", None),
        ("", None),
        (" 1", None),
        ("1.0", None),
        ("0x", None),
    ],
)
def test_go_parse_int(text: str, value: int | None) -> None:
    assert go_parse_int(text) == value


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.binary(max_size=200),
        st.text(alphabet=st.sampled_from(list("ab:- \n[]{}&*<!|>'\"#,0x1.~")), max_size=200),
    )
)
def test_any_input_loads_or_raises_yaml_error(text: bytes | str) -> None:
    # Any other exception fails the test: bad input is a YamlError with a message.
    with contextlib.suppress(YamlError):
        load(text)
