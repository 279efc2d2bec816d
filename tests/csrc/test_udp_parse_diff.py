"""The C SOCKS5 UDP datagram header parser (csrc/parse.c ``sw_parse_s5_udp``) against
its Python reference, ``socks5.parse_udp_datagram``, byte string for byte string.

The contract (csrc/parse.h): OK with Python's fragment, host, port and payload
(``buf[header_len:]``), or ERROR exactly where Python raises ProtocolError; never
NEED_MORE or DEFER.  ``sw_parse_s5_udp_fields`` (the relay's hot path, outside the cdef)
is not reachable from Python; it shares every check with ``sw_parse_s5_udp`` and is
fuzzed with it by benchmarks/fuzz_parse.c.

Inputs: datagrams (IPv4 and IPv6 with mapped and compatible forms by
``socks5.build_udp_datagram``; ASCII and unicode domains as their UTF-8) with random
RSV and FRAG bytes and payloads, raw domain fields (empty, controls, invalid UTF-8),
mutations, random bytes, and every prefix of each.  ``HYPOTHESIS_PROFILE=deep``
multiplies the example counts by 20; under an ASan build every input goes to C in a
malloc() block of its exact length (see test_parse_diff.exact).
"""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from spliceway import _relay
from spliceway.protocols import ProtocolError, socks5
from tests.csrc.test_parse_diff import exact, note
from tests.helpers.examples import diff_settings as _settings

ffi, lib = _relay.ffi, _relay.lib


def c_udp(buf: bytes):
    out = ffi.new("sw_s5_udp *")
    with exact(buf) as p:
        rc = lib.sw_parse_s5_udp(p, len(buf), out)
    assert rc in (lib.SW_PARSE_OK, lib.SW_PARSE_ERROR), rc
    if rc == lib.SW_PARSE_ERROR:
        return ("error",)
    assert 0 < out.header_len <= len(buf)
    raw = bytes(ffi.buffer(out.host, out.host_len + 1))
    assert raw[-1:] == b"\0" and b"\0" not in raw[:-1]
    assert out.atyp in (1, 3, 4)
    assert out.addr_off + out.addr_len + 2 == out.header_len
    assert out.addr_len == {1: 4, 4: 16}.get(out.atyp, out.addr_len)
    if out.atyp == 3:
        assert buf[out.addr_off : out.addr_off + out.addr_len] == raw[:-1]
    return ("ok", out.frag, raw[:-1].decode("utf-8"), out.port, buf[out.header_len :])


def py_udp(buf: bytes):
    try:
        d = socks5.parse_udp_datagram(buf)
    except ProtocolError as exc:
        return ("error",) if exc.reply is None else ("error with a reply", exc.reply)
    return ("ok", d.fragment, d.host, d.port, d.payload)


def check(buf: bytes):
    c, py = c_udp(buf), py_udp(buf)
    assert c == py, buf
    note(f"udp: {c[0]}")
    return c


def check_prefixes(buf: bytes) -> None:
    """Every prefix: ERROR below the header, then OK with the same header fields."""
    ok_at = None
    for cut in range(len(buf) + 1):
        v = check(buf[:cut])
        if ok_at is not None:
            assert v[:4] == check(buf[:ok_at])[:4], (buf, cut)
        elif v[0] == "ok":
            ok_at = cut


# -- strategies --------------------------------------------------------------------------

_ipv4 = st.integers(0, 2**32 - 1).map(lambda n: str(ipaddress.IPv4Address(n)))
_ipv6 = st.one_of(
    st.integers(0, 2**128 - 1).map(lambda n: str(ipaddress.IPv6Address(n))),
    _ipv4.map(lambda v4: f"::ffff:{v4}"),  # mapped: Python spells these out
    _ipv4.map(lambda v4: f"::{v4}"),  # compatible
    st.sampled_from(["::", "::1", "fe80::1", "2001:db8::", "1:0:0:1::1", "1::1:0:0:1"]),
)
_label_chars = st.characters(blacklist_categories=("Cs",), min_codepoint=0x21)
_label = st.text(alphabet=_label_chars, min_size=1, max_size=20).filter(lambda s: "\x7f" not in s)
_domain = (
    st.lists(_label, min_size=1, max_size=5).map(".".join).filter(lambda d: len(d.encode()) <= 255)
)
_payload = st.binary(max_size=64)


@st.composite
def datagrams(draw) -> bytes:
    is_ip = draw(st.booleans())
    host = draw(st.one_of(_ipv4, _ipv6) if is_ip else _domain)
    port = draw(st.integers(0, 65535))
    frag = draw(st.one_of(st.just(0), st.integers(0, 255)))
    payload = draw(_payload)
    name = host.encode()
    if is_ip:
        dgram = bytearray(socks5.build_udp_datagram(host, port, payload, frag))
    else:  # the name's own UTF-8, as clients send it (the builder would IDNA-encode it)
        dgram = bytearray([0, 0, frag, 3, len(name)]) + name + port.to_bytes(2, "big") + payload
    if draw(st.booleans()):
        dgram[0:2] = draw(st.binary(min_size=2, max_size=2))  # RSV is not judged
    return bytes(dgram)


@st.composite
def raw_domain_datagrams(draw) -> bytes:
    """ATYP 3 with any name bytes: empty, controls, invalid UTF-8, the longest."""
    name = draw(st.one_of(st.binary(max_size=255), st.just(b"a" * 255), st.just(b"")))
    length = draw(st.one_of(st.just(len(name)), st.integers(0, 255)))
    port = draw(st.binary(min_size=0, max_size=2))
    return b"\0\0\0\x03" + bytes([length]) + name + port + draw(_payload)


@st.composite
def mutated(draw) -> bytes:
    buf = bytearray(draw(st.one_of(datagrams(), raw_domain_datagrams())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 3))
        at = draw(st.integers(0, len(buf)))
        if op == 0 and at < len(buf):
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif op == 1 and at < len(buf):
            buf[at] = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 0x20, 0x7F, 0x80, 0xC0, 0xFF]))
        elif op == 2:
            buf[at:at] = draw(st.binary(min_size=1, max_size=4))
        else:
            del buf[at : at + draw(st.integers(1, 4))]
    return bytes(buf)


# -- tests -------------------------------------------------------------------------------


def test_known_datagrams() -> None:
    assert check(b"\0\0\0\x01\x7f\0\0\x01\x00\x35hello") == ("ok", 0, "127.0.0.1", 53, b"hello")
    assert check(b"\xff\xff\x00\x01\x7f\0\0\x01\x00\x35") == ("ok", 0, "127.0.0.1", 53, b"")
    assert check(b"\0\0\x01\x03\x03a.b\x01\xbbx") == ("ok", 1, "a.b", 443, b"x")
    v6 = b"\0\0\0\x04" + bytes(10) + b"\xff\xff\xc0\x00\x02\x01" + b"\0\x50"
    assert check(v6) == ("ok", 0, "::ffff:192.0.2.1", 80, b"")
    bad_ones = [b"", b"\0", b"\0\0", b"\0\0\0", b"\0\0\0\x03", b"\0\0\0\x01\x7f\0\0\x01\x00",
                b"\0\0\0\x02\x7f\0\0\x01\0\0", b"\0\0\0\x03\x00\0\0", b"\0\0\0\x03\x03a b\0\0",
                b"\0\0\0\x03\x02\xc3\x28\0\0"]  # fmt: skip
    for bad in bad_ones:
        assert check(bad) == ("error",), bad


@given(datagrams())
@_settings(600)
def test_valid_datagrams(buf: bytes) -> None:
    assert check(buf)[0] == "ok"


@given(raw_domain_datagrams())
@_settings(400)
def test_raw_domains(buf: bytes) -> None:
    check(buf)


@given(mutated())
@_settings(800)
def test_mutated(buf: bytes) -> None:
    check(buf)


@given(st.binary(max_size=300))
@_settings(400)
def test_random_bytes(buf: bytes) -> None:
    check(buf)


@given(st.one_of(datagrams(), raw_domain_datagrams()))
@_settings(100)
def test_prefixes(buf: bytes) -> None:
    check_prefixes(buf)
