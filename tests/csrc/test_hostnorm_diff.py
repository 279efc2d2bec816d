"""The C host normalizer (csrc/iplit.c: sw_host_canon, sw_host_addr) against
spliceway.routing.hostnorm, and hostnorm against what glibc reads as an address.

The contract (csrc/iplit.h): for every host C writes exactly ``hostnorm.canonical_host``'s
text, and says SW_HOST_IP4/IP6 exactly when ``hostnorm.target_address`` finds an address
(sw_host_addr's bytes being that address), SW_HOST_NAME exactly when it finds none, or
SW_HOST_UNSURE for a host with a byte >= 0x80 or a '%', which only Python reads (IDNA,
IPv6 scope ids): then C's text is Python's unless Python found an address, and a '%' host
is given unchanged (and a non-ASCII name may keep a trailing dot that C drops, where
IDNA would make the rest an address). A capacity too small for the text is -ENOSPC.

And the reference itself: every host glibc's ``getaddrinfo`` (numeric) or ``inet_aton``
takes for an IPv4 address is that address to hostnorm (0.0.0.0 read as 127.0.0.1), so no
spelling the resolver would dial can reach routing as a domain name.

Inputs: IPv4 addresses written with 1..4 parts in decimal, octal and hex (leading zeros,
empty "0x", upper case, a trailing dot, whitespace and junk after them), huge parts,
IPv6 and IPv4-mapped texts with and without brackets, and random text over the alphabet
those use, plus arbitrary Unicode. ``HYPOTHESIS_PROFILE=deep`` multiplies the example
counts by 20.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from spliceway import _relay
from spliceway.routing import hostnorm
from tests.helpers.spellings import LOOPBACK_SPELLINGS

ffi, lib = _relay.ffi, _relay.lib
_DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
_CAP = 512


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples * 20 if _DEEP else examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def _c_canon(raw: bytes, cap: int = _CAP) -> tuple[int, bytes]:
    out = ffi.new("char[]", max(cap, 1))
    n = ffi.new("size_t *")
    # An exact-length copy, so an ASan build sees any over-read.
    buf = ffi.new("uint8_t[]", raw) if raw else ffi.NULL
    kind = lib.sw_host_canon(buf, len(raw), out, cap, n)
    return kind, (ffi.buffer(out, n[0])[:] if kind > 0 else b"")


def _c_addr(raw: bytes) -> tuple[int, bytes]:
    out = ffi.new("uint8_t[16]")
    buf = ffi.new("uint8_t[]", raw) if raw else ffi.NULL
    kind = lib.sw_host_addr(buf, len(raw), out)
    size = {lib.SW_HOST_IP4: 4, lib.SW_HOST_IP6: 16}.get(kind, 0)
    return kind, bytes(out)[:size]


def check(host: str) -> str:
    """Asserts the contract for one host; returns what it was (for statistics)."""
    raw = host.encode("utf-8", "surrogatepass")
    kind, text = _c_canon(raw)
    akind, packed = _c_addr(raw)
    assert akind == kind, (host, kind, akind)
    py_text = hostnorm.canonical_host(host)
    py_addr = hostnorm.target_address(host)
    assert hostnorm.canonical_host(py_text) == py_text, host  # idempotent
    if kind == lib.SW_HOST_UNSURE:
        assert not host.isascii() or "%" in host, host
        if "%" in host:
            assert text == raw, host
        elif py_addr is None:
            # Python keeps a dot whose removal would make an address (by IDNA).
            c_text = text.decode("utf-8", "surrogatepass")
            assert py_text in (c_text, c_text + "."), (host, text)
        return "unsure"
    assert text.decode("utf-8", "surrogatepass") == py_text, (host, text, py_text)
    if kind == lib.SW_HOST_NAME:
        assert py_addr is None, (host, py_addr)
        return "name"
    assert kind in (lib.SW_HOST_IP4, lib.SW_HOST_IP6), (host, kind)
    assert py_addr == py_text, host
    ip = ipaddress.ip_address(py_addr)
    assert kind == ip.version * 1 and packed == ip.packed, (host, kind, packed)
    # Any capacity below the text's is refused, never a cut text.
    if len(text) > 0:
        assert _c_canon(raw, len(text))[0] == -errno.ENOSPC
        assert _c_canon(raw, len(text) + 1) == (kind, text)
    return f"ip{kind}"


def _glibc_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """What getaddrinfo (numeric) or inet_aton takes ``host`` for, IPv4 only."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, flags=socket.AI_NUMERICHOST)
        return ipaddress.IPv4Address(infos[0][4][0])
    except (OSError, UnicodeError, ValueError):
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, UnicodeError, ValueError):
        return None


def check_glibc(host: str) -> None:
    seen = _glibc_ipv4(host)
    if seen is None:
        return
    expected = "127.0.0.1" if int(seen) == 0 else str(seen)
    assert hostnorm.target_address(host) == expected, (host, seen)


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


@st.composite
def _number(draw: st.DrawFn, value: int) -> str:
    """``value`` as an inet_aton/WHATWG number: decimal, octal or hex, padded."""
    radix = draw(st.sampled_from(["dec", "oct", "hex", "HEX"]))
    pad = "0" * draw(st.integers(0, 3))
    if radix == "dec":
        return str(value)  # leading zeros would make it octal
    if radix == "oct":
        return "0" + pad + format(value, "o")
    digits = format(value, "x")
    if value == 0 and draw(st.booleans()):
        digits = ""  # WHATWG's empty hex number
    prefix = "0x" if radix == "hex" else "0X"
    return prefix + pad + (digits.upper() if draw(st.booleans()) else digits)


@st.composite
def ipv4_spellings(draw: st.DrawFn) -> str:
    address = draw(st.integers(0, 2**32 - 1))
    parts = draw(st.integers(1, 4))
    values = [(address >> (8 * (3 - i))) & 255 for i in range(parts - 1)]
    values.append(address & ((1 << (8 * (5 - parts))) - 1))
    if draw(st.integers(0, 9)) == 0:
        # One part out of range, or one too many.
        i = draw(st.integers(0, parts - 1))
        values[i] += draw(st.sampled_from([256, 2**24, 2**32, 2**40]))
    text = ".".join(draw(_number(v)) for v in values)
    if draw(st.integers(0, 4)) == 0:
        text += "."
    tail = draw(st.integers(0, 6))
    if tail == 0:
        text += draw(st.sampled_from([" ", "\t", "\n", "\v", "\f", "\r"])) + draw(
            st.text(max_size=4)
        )
    elif tail == 1:
        text += draw(st.sampled_from(["x", ".", "..", ".0", "/8", ":80", "\x00", "\u00a0"]))
    return text


_ipv6_texts = st.one_of(
    st.ip_addresses(v=6).map(str),
    st.ip_addresses(v=6).map(lambda a: a.exploded.upper()),
    st.ip_addresses(v=4).map(lambda a: f"::ffff:{a}"),
    st.ip_addresses(v=4).map(lambda a: f"::FFFF:{int(a) >> 16:x}:{int(a) & 0xFFFF:x}"),
    st.ip_addresses(v=4).map(lambda a: f"0:0:0:0:0:ffff:{a}"),
    st.ip_addresses().map(lambda a: f"[{a}]"),
    st.sampled_from(["::", "[::]", "::0", "::ffff:0.0.0.0", "::1", "1::", "1:0:0:1::"]),
).map(lambda t: t + ("%eth0" if len(t) % 7 == 0 else ""))

_alphabet = st.sampled_from([*"0123456789abcdefxX.:[]% \t%", "\u00e9", "\uff11", "\u3002"])
_fuzz_text = st.text(alphabet=_alphabet, max_size=24)
_huge = st.builds(
    lambda zeros, digits, hexa: ("0x" if hexa else "") + "0" * zeros + digits,
    st.integers(0, 40),
    st.text(alphabet="0123456789", min_size=1, max_size=24),
    st.booleans(),
)
_hosts = st.one_of(ipv4_spellings(), _ipv6_texts, _fuzz_text, _huge, st.text(max_size=12))



# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


def test_the_issue_spellings_are_loopback_in_c_and_python():
    for host in LOOPBACK_SPELLINGS:
        assert check(host) == "ip4", host
        assert _c_canon(host.encode()) == (lib.SW_HOST_IP4, b"127.0.0.1"), host
        assert hostnorm.canonical_host(host) == "127.0.0.1", host
    for host, canonical in [
        ("example.com.", "example.com"),
        ("a..", "a.."),
        (".", "."),
        ("4chan.org", "4chan.org"),
        ("127.0.0.1 x", "127.0.0.1"),
        ("0x.0x.0x.0x", "127.0.0.1"),
        ("::", "::1"),
        ("1:0:0:0:0:0:0:1", "1::1"),
        ("[::FFFF:7f00:1]", "127.0.0.1"),
        ("256.1", "256.1"),
        ("4294967296", "4294967296"),
        ("09", "09"),
    ]:
        check(host)
        assert hostnorm.canonical_host(host) == canonical, host
    # Only Python reads these (IDNA, a scope id).
    assert hostnorm.canonical_host("\uff11\uff12\uff17.\uff10.\uff10.\uff11") == "127.0.0.1"
    assert check("\uff11\uff12\uff17.\uff10.\uff10.\uff11") == "unsure"
    assert hostnorm.canonical_host("[fe80::0:1%eth0]") == "fe80::1%eth0"
    assert check("fe80::1%eth0") == "unsure"
    assert _c_canon(b"")[0] == lib.SW_HOST_NAME
    assert lib.sw_host_canon(b"a", 1, ffi.NULL, 4, ffi.new("size_t *")) == -errno.EINVAL


@_settings(600)
@given(host=_hosts)
@example(host="0x" + "0" * 40 + "7f.1")
@example(host="1.2.3.4\x00")
@example(host="::.")
@example(host="0 %")
def test_c_matches_python(host):
    check(host)


@_settings(400)
@given(host=st.one_of(ipv4_spellings(), _fuzz_text, _huge))
@example(host="0 %")
@example(host="0 :")
@example(host="0 :%")
def test_every_address_glibc_reads_is_that_address(host):
    check_glibc(host)
