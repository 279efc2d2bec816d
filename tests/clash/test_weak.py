"""spliceway.clash.weak: mihomo's weakly typed field decoding."""

from __future__ import annotations

import pytest

from spliceway.clash.weak import (
    MISSING,
    WeakTypeError,
    go_format_float,
    lookup,
    unknown_keys,
    weak_bool,
    weak_int,
    weak_str,
    weak_str_list,
)


def test_lookup_exact_then_case_and_dashes() -> None:
    m = {"Server": "a", "skip_cert_verify": True, "port": None, "server": "b"}
    assert lookup(m, "server") == "b"  # as written wins
    assert lookup({"Server": "a"}, "server") == "a"
    assert lookup(m, "skip-cert-verify") is True
    assert lookup(m, "skip-cert-verify", dashes=False) is MISSING
    assert lookup(m, "port") is MISSING  # null is absent
    assert lookup(m, "nothing") is MISSING


def test_unknown_keys() -> None:
    m = {"name": 1, "Type": 2, "skip_cert_verify": 3, "foo": 4, 5: 6}
    assert unknown_keys(m, ("name", "type", "skip-cert-verify")) == ["foo", "5"]


@pytest.mark.parametrize(
    ("value", "out"),
    [(443, 443), ("443", 443), ("0x1bb", 443), (443.9, 443), ("1_000", 1000), ("-5", -5)],
)
def test_weak_int(value: object, out: int) -> None:
    assert weak_int(value, "port") == out


@pytest.mark.parametrize("value", [True, "443a", "", [1], {"a": 1}, float("nan")])
def test_weak_int_refuses(value: object) -> None:
    with pytest.raises(WeakTypeError, match="port"):
        weak_int(value, "port")


def test_weak_str_and_bool() -> None:
    assert weak_str("x", "k") == "x"
    assert weak_str(123456, "password") == "123456"
    assert weak_str(1.5, "k") == "1.5E+00"
    for bad in (True, [1], {}):
        with pytest.raises(WeakTypeError, match="expected type 'string'"):
            weak_str(bad, "k")
    assert weak_bool(True, "udp") is True
    assert weak_bool(0, "udp") is False
    assert weak_bool(2, "udp") is True
    with pytest.raises(
        WeakTypeError, match="'udp' expected type 'bool', got unconvertible type 'string'"
    ):
        weak_bool("true", "udp")


def test_weak_str_list() -> None:
    assert weak_str_list(["a", 1, None], "proxies") == ["a", "1"]
    with pytest.raises(WeakTypeError, match="not a slice"):
        weak_str_list("a", "proxies")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.5, "1.5E+00"),
        (100.0, "1E+02"),
        (0.001, "1E-03"),
        (-2.25, "-2.25E+00"),
        (0.0, "0E+00"),
        (123456789.0, "1.23456789E+08"),
        (float("inf"), "+Inf"),
    ],
)
def test_go_format_float(value: float, text: str) -> None:
    assert go_format_float(value) == text
