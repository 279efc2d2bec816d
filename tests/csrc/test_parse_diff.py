"""The C parsers (csrc/parse.c) against their Python references, byte string for byte string.

The contract (csrc/parse.h): for every input a C parser gives exactly the Python verdict
-- OK with the same fields and ``consumed``, NEED_MORE, or ERROR with the same reply
(reply_len 0 for a ProtocolError whose reply is None) -- or SW_PARSE_DEFER.  On top of
that SOCKS5, sniffing and the upstream response head parser never defer, and well-formed
CONNECT heads (and every prefix of one) are never deferred.  The CONNECT request builder
(sw_http_connect_request) writes exactly http.connect_request()'s bytes, or -EINVAL
where it raises ValueError, and -ENOSPC for any smaller capacity.  For every input the
response parser rejects, sw_http_response_error writes exactly str() of the ProtocolError
Python raises (UTF-8, repr() of the quoted version or header name included), and -EINVAL
for every other input; shorter capacities give -ENOSPC and the longest whole-character
prefix.

Inputs: generated valid messages (hosts, IPv4/IPv6, unicode domains, credentials,
headers; genuine ClientHellos from the ssl module), mutations of them (bit flips,
replaced/inserted/deleted bytes, truncation, splices), random bytes, and every prefix of
valid messages; for the response parser also every max_size around the head's length.
The C functions are pure, so the tests call them through the extension's ffi directly
(as test_relay_aead does) rather than through a wrapper module.

``HYPOTHESIS_PROFILE=deep`` multiplies the example counts by 20.  Under an ASan build of
the extension (``SPLICEWAY_RELAY_SANITIZE=address,undefined``, run with
``LD_PRELOAD=$(gcc -print-file-name=libasan.so) PYTHONMALLOC=malloc``) every input is
passed in a malloc() block of exactly its length, so over-reads are caught too.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import ipaddress
import os
import ssl
import sys

import cffi
import pytest
from hypothesis import currently_in_test_context, event, given
from hypothesis import strategies as st

from spliceway import _relay
from spliceway.protocols import NEED_MORE, ProtocolError, http, sniff, socks5
from tests.helpers.examples import diff_settings as _settings

ffi, lib = _relay.ffi, _relay.lib


def note(label: str) -> None:
    """Record an outcome for --hypothesis-show-statistics (only inside a given test)."""
    if currently_in_test_context():
        event(label)


_STATUS = {
    lib.SW_PARSE_OK: "ok",
    lib.SW_PARSE_NEED_MORE: "need_more",
    lib.SW_PARSE_ERROR: "error",
    lib.SW_PARSE_DEFER: "defer",
}
NEED = ("need_more",)
DEFER = ("defer",)

# -- the two sides, as comparable verdict tuples -----------------------------------------


# Under an ASan build of the extension (LD_PRELOAD=libasan) inputs are handed to C in
# malloc() blocks of exactly their length -- a bytes object ends in a hidden NUL and
# ffi.new() rounds up, either of which would hide a one-byte over-read -- with the
# malloc this dlopen(None) finds, ASan's.  Otherwise the bytes go as they are (faster).
_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")
_libc_ffi = cffi.FFI()
_libc_ffi.cdef("void *malloc(size_t); void free(void *);")


class _Exact:
    """A C copy of ``buf`` with nothing after it, freed on exit."""

    _libc = _libc_ffi.dlopen(None) if _ASAN else None

    def __init__(self, buf: bytes) -> None:
        self.raw = self._libc.malloc(len(buf))
        assert self.raw != _libc_ffi.NULL
        self.ptr = ffi.cast("uint8_t *", int(_libc_ffi.cast("uintptr_t", self.raw)))
        ffi.memmove(self.ptr, buf, len(buf))

    def __enter__(self):
        return self.ptr

    def __exit__(self, *exc) -> None:
        self._libc.free(self.raw)


def exact(buf: bytes):
    """``with exact(buf) as p``: what to pass C for ``buf``."""
    return _Exact(buf) if _ASAN else contextlib.nullcontext(buf)


def _c_s5(func, ctype: str, buf: bytes):
    out = ffi.new(ctype)
    reply = ffi.new("uint8_t[]", lib.SW_PARSE_REPLY_MAX)
    reply_len = ffi.new("size_t *", 999)
    with exact(buf) as p:
        rc = func(p, len(buf), out, reply, reply_len)
    status = _STATUS[rc]
    if status == "error":
        assert reply_len[0] <= lib.SW_PARSE_REPLY_MAX
        return ("error", bytes(ffi.buffer(reply, reply_len[0])) or None), out
    assert reply_len[0] == 0, (status, reply_len[0])
    return (status,), out


def c_greeting(buf: bytes):
    verdict, out = _c_s5(lib.sw_parse_s5_greeting, "sw_s5_greeting *", buf)
    if verdict[0] == "ok":
        return ("ok", out.consumed, bool(out.no_auth), bool(out.userpass))
    return verdict


def py_greeting(buf: bytes):
    try:
        r = socks5.parse_greeting(buf)
    except ProtocolError as exc:
        return ("error", exc.reply)
    if r is NEED_MORE:
        return NEED
    return (
        "ok",
        r.consumed,
        socks5.METHOD_NO_AUTH in r.methods,
        socks5.METHOD_USERPASS in r.methods,
    )


def c_userpass(buf: bytes):
    verdict, out = _c_s5(lib.sw_parse_s5_userpass, "sw_s5_userpass *", buf)
    if verdict[0] != "ok":
        return verdict
    assert out.user_off + out.user_len <= out.consumed
    assert out.pass_off + out.pass_len <= out.consumed
    user = buf[out.user_off : out.user_off + out.user_len].decode("utf-8")
    password = buf[out.pass_off : out.pass_off + out.pass_len].decode("utf-8")
    return ("ok", out.consumed, user, password)


def py_userpass(buf: bytes):
    try:
        r = socks5.parse_userpass(buf)
    except ProtocolError as exc:
        return ("error", exc.reply)
    if r is NEED_MORE:
        return NEED
    return ("ok", r.consumed, r.username, r.password)


def _c_string(field, length: int) -> bytes:
    raw = bytes(ffi.buffer(field, length + 1))
    assert raw[-1:] == b"\0", "not NUL-terminated"
    return raw[:-1]


def c_request(buf: bytes):
    verdict, out = _c_s5(lib.sw_parse_s5_request, "sw_s5_request *", buf)
    if verdict[0] != "ok":
        return verdict
    host = _c_string(out.host, out.host_len)
    assert b"\0" not in host
    return ("ok", out.consumed, out.command, out.atyp, host.decode("utf-8"), out.port)


def py_request(buf: bytes):
    try:
        r = socks5.parse_request(buf)
    except ProtocolError as exc:
        return ("error", exc.reply)
    if r is NEED_MORE:
        return NEED
    return ("ok", r.consumed, r.command, r.address_type, r.host, r.port)


def c_http(buf: bytes):
    out = ffi.new("sw_http_connect *")
    with exact(buf) as p:
        status = _STATUS[lib.sw_parse_http_connect(p, len(buf), out)]
    assert status != "error", "C never answers an HTTP error itself"
    if status != "ok":
        return (status,)
    assert 0 < out.consumed <= len(buf)
    host = _c_string(out.host, out.host_len).decode("ascii")
    creds = None
    if out.has_creds:
        user = _c_string(out.user, out.user_len).decode("utf-8")
        password = _c_string(getattr(out, "pass"), out.pass_len).decode("utf-8")
        creds = (user, password)
    else:
        assert out.user_len == out.pass_len == 0
    return ("ok", out.consumed, host, out.port, creds)


def py_http(buf: bytes):
    """What Python's http inbound makes of ``buf`` for a CONNECT (C's only OK case)."""
    try:
        head = http.parse_request_head(buf)
        if head is NEED_MORE:
            return NEED
        if head.method.upper() != "CONNECT":
            return ("other method",)
        host, port = http.connect_authority(head.target)
    except ProtocolError as exc:
        return ("error", exc.reply)
    return ("ok", head.consumed, host, port, http.proxy_basic_credentials(head))


def c_sniff(buf: bytes):
    out = ffi.new("sw_sniffed *")
    with exact(buf) as p:
        status = _STATUS[lib.sw_sniff(p, len(buf), out)]
    assert status != "defer", "sniffing never defers"
    if status == "ok":
        return ("ok", _c_string(out.host, out.host_len).decode("ascii"))
    return (status,) if status == "need_more" else ("error", None)


def py_sniff(buf: bytes):
    r = sniff.sniff(buf)
    if r is NEED_MORE:
        return NEED
    return ("error", None) if r is None else ("ok", r.host)


# -- the contract ------------------------------------------------------------------------

_S5 = {
    "greeting": (c_greeting, py_greeting),
    "userpass": (c_userpass, py_userpass),
    "request": (c_request, py_request),
}


def check_s5(kind: str, buf: bytes):
    """SOCKS5: exactly Python's verdict, never a deferral."""
    c_fn, py_fn = _S5[kind]
    c, py = c_fn(buf), py_fn(buf)
    assert c == py, (kind, buf)
    note(f"{kind}: {c[0]}")
    return c


def check_http(buf: bytes):
    """HTTP CONNECT: Python's verdict or DEFER; returns C's."""
    c = c_http(buf)
    py = py_http(buf)
    if c != DEFER:
        assert c == py, buf
    note(f"http: C {c[0]}, Python {py[0]}")
    return c


def _mapped_as_311(host: str) -> str:
    # Python 3.13 spells IPv4-mapped addresses ::ffff:a.b.c.d in .compressed, 3.11 in
    # hex; C (which cannot ask) always writes the 3.11 form.
    with contextlib.suppress(ValueError):
        ip = ipaddress.IPv6Address(host)
        if ip.ipv4_mapped is not None:
            return f"::ffff:{int(ip) >> 16 & 0xFFFF:x}:{int(ip) & 0xFFFF:x}"
    return host


def check_sniff(buf: bytes):
    c, py = c_sniff(buf), py_sniff(buf)
    if sys.version_info >= (3, 13) and py[0] == "ok":
        py = ("ok", _mapped_as_311(py[1]))
    assert c == py, buf
    note(f"sniff: {c[0]}")
    return c


def check_prefixes(check, buf: bytes) -> None:
    for cut in range(len(buf) + 1):
        check(buf[:cut])


# -- mutation ----------------------------------------------------------------------------


@st.composite
def mutated(draw, base: st.SearchStrategy[bytes]) -> bytes:
    """A valid message with a few random edits (the fuzz driver's repertoire, small)."""
    buf = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice"]))
        at = draw(st.integers(0, len(buf)))
        if op == "flip" and buf:
            at = min(at, len(buf) - 1)
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            at = min(at, len(buf) - 1)
            buf[at] = draw(
                st.sampled_from([0, 1, 2, 3, 4, 5, 9, 10, 13, 32, 58, 61, 127, 128, 255])
            )
        elif op == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del buf[at : at + draw(st.integers(1, 4))]
        elif op == "truncate":
            del buf[at:]
        elif op == "splice" and buf:
            start = draw(st.integers(0, len(buf) - 1))
            buf[at:at] = buf[start : start + draw(st.integers(1, 16))]
    return bytes(buf)


# -- SOCKS5 ------------------------------------------------------------------------------

# Strings that stress strict UTF-8: overlongs, surrogates, > U+10FFFF, truncations, stray
# continuation bytes, plus valid neighbours of each and the control-character rule.
_UTF8_BITS = [
    b"a", b"\xc2\x80", b"\xdf\xbf", b"\xe0\xa0\x80", b"\xed\x9f\xbf", b"\xee\x80\x80",
    b"\xef\xbf\xbf", b"\xf0\x90\x80\x80", b"\xf4\x8f\xbf\xbf", b"\xc2\x85", b"\xc2\xa0",
    b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xed\xa0\x80",
    b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xf4\x90\x80\x80",
    b"\xf5\x80\x80\x80", b"\xff", b"\x80", b"\xbf", b"\xe2\x82", b"\xf0\x9f\x98",
    b"\x00", b" ", b"\x1f", b"\x7f", b"\t",
]  # fmt: skip
utf8_edgy = st.lists(st.sampled_from(_UTF8_BITS), max_size=8).map(b"".join)
unicode_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
names = st.one_of(
    unicode_text.map(str.encode),
    utf8_edgy,
    st.binary(max_size=40),
    st.from_regex(r"[a-z0-9-]{1,20}(\.[a-z0-9-]{1,20}){0,3}", fullmatch=True).map(str.encode),
    st.just(b"x" * 255),
).map(lambda b: b[:255])

greetings = st.lists(st.integers(0, 255), max_size=255).map(
    lambda methods: bytes([5, len(methods), *methods])
)
userpasses = st.tuples(names, names).map(
    lambda up: bytes([1, len(up[0])]) + up[0] + bytes([len(up[1])]) + up[1]
)
_hextet = st.one_of(st.sampled_from([0, 0, 0, 1, 0xFFFF, 0xFFFE, 0x10]), st.integers(0, 0xFFFF))
ipv6_packed = st.one_of(
    st.lists(_hextet, min_size=8, max_size=8).map(
        lambda h: b"".join(x.to_bytes(2, "big") for x in h)
    ),
    st.binary(min_size=4, max_size=4).map(lambda v4: bytes(10) + b"\xff\xff" + v4),  # mapped
    st.binary(min_size=4, max_size=4).map(lambda v4: bytes(12) + v4),  # "compatible"
    st.binary(min_size=16, max_size=16),
)
addresses = st.one_of(
    st.binary(min_size=4, max_size=4).map(lambda a: b"\x01" + a),
    ipv6_packed.map(lambda a: b"\x04" + a),
    names.filter(len).map(lambda n: b"\x03" + bytes([len(n)]) + n),
)
requests = st.builds(
    lambda cmd, rsv, addr, port: bytes([5, cmd, rsv]) + addr + port.to_bytes(2, "big"),
    st.sampled_from([1, 2, 3, 0, 9]),
    st.sampled_from([0, 0, 7]),
    addresses,
    st.integers(0, 0xFFFF),
)
_S5_VALID = {"greeting": greetings, "userpass": userpasses, "request": requests}


@pytest.mark.parametrize("kind", sorted(_S5_VALID))
@_settings(150)
@given(data=st.data())
def test_socks5_valid_messages_and_every_prefix(kind, data):
    msg = data.draw(_S5_VALID[kind])
    check_prefixes(functools.partial(check_s5, kind), msg)
    trailer = data.draw(st.binary(max_size=8))
    check_s5(kind, msg + trailer)


@pytest.mark.parametrize("kind", sorted(_S5_VALID))
@_settings(400)
@given(data=st.data())
def test_socks5_mutated_and_random_bytes(kind, data):
    buf = data.draw(st.one_of(mutated(_S5_VALID[kind]), st.binary(max_size=300)))
    check_s5(kind, buf)


def test_socks5_utf8_exhaustive_boundaries():
    """Every 1- and 2-byte string and every lead byte with boundary continuations."""
    tails = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF]
    cases = [bytes([a]) for a in range(256)]
    cases += [bytes([a, b]) for a in range(256) for b in range(256)]
    cases += [bytes([a, b, c]) for a in range(0xE0, 0x100) for b in tails for c in tails]
    cases += [bytes([a, b, 0x80, c]) for a in range(0xF0, 0x100) for b in tails for c in tails]
    for name in cases:
        check_s5("userpass", bytes([1, len(name)]) + name + b"\x00")
        check_s5("request", b"\x05\x01\x00\x03" + bytes([len(name)]) + name + b"\x01\xbb")


def test_socks5_ipv6_text_matches_ip_text():
    """Zero runs of every position and length (RFC 5952 choice), mapped and compatible."""
    packed = []
    for start in range(8):
        for length in range(9 - start):
            for filler in (1, 0xABCD):
                h = [filler] * 8
                h[start : start + length] = [0] * length
                packed.append(b"".join(x.to_bytes(2, "big") for x in h))
    for mask in range(256):  # every zero/non-zero pattern of the 8 hextets
        packed.append(b"".join((b"\x00\x00" if mask >> i & 1 else b"\x0f\x00") for i in range(8)))
    for v4 in (b"\x00\x00\x00\x00", b"\x01\x02\x03\x04", b"\xff\xff\xff\xff"):
        packed += [bytes(10) + b"\xff\xff" + v4, bytes(12) + v4, bytes(10) + b"\xff\xfe" + v4]
    for a in packed:
        verdict = check_s5("request", b"\x05\x01\x00\x04" + a + b"\x00\x50")
        assert verdict[0] == "ok"
        assert verdict[4] == socks5._ip_text(a)


def test_socks5_known_replies():
    assert c_greeting(b"\x04\x01\x00") == ("error", None)
    assert c_greeting(b"\x05\x00") == ("error", b"\x05\xff")
    assert c_userpass(b"\x02") == ("error", b"\x01\x01")
    assert c_request(b"\x05\x01\x00\x05") == ("error", socks5.reply(8))
    assert c_request(b"\x05\x01\x00\x03\x00") == ("error", socks5.reply(1))
    assert c_request(b"\x05\x01\x00\x03\x03a b\x00\x50") == ("error", socks5.reply(1))
    assert c_request(b"\x05\x01\x00\x04" + bytes(12) + b"\x01\x02\x03\x04\x00\x50")[4] == (
        "::102:304"  # IPv4-compatible: Python's hex, not inet_ntop's ::1.2.3.4
    )


# -- HTTP CONNECT -------------------------------------------------------------------------

_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
tokens = st.text(st.sampled_from(_TOKEN_CHARS), min_size=1, max_size=12)
reg_names = st.one_of(
    st.from_regex(r"[A-Za-z0-9_\-]{1,20}(\.[A-Za-z0-9_\-]{1,20}){0,4}", fullmatch=True),
    st.text(st.sampled_from("abcXYZ019_-."), min_size=1, max_size=300),
)


def _v4_tail_compressed(packed: bytes) -> str:
    """The address as six hextets with their longest zero run as "::", then dotted IPv4."""
    h = [int.from_bytes(packed[i : i + 2], "big") for i in range(0, 12, 2)]
    best, best_len = 0, 0
    for start in range(6):
        run = next((k for k in range(start, 6) if h[k]), 6) - start
        if run > best_len:
            best, best_len = start, run
    v4 = ipaddress.IPv4Address(packed[12:])
    if not best_len:
        return ":".join(f"{x:x}" for x in h) + f":{v4}"
    left = ":".join(f"{x:x}" for x in h[:best])
    right = "".join(f"{x:x}:" for x in h[best + best_len :])
    return f"{left}::{right}{v4}"


def _ipv6_texts(packed: bytes) -> list[str]:
    """Six spellings Python accepts for the same address."""
    ip = ipaddress.IPv6Address(packed)
    hextets = ip.exploded.split(":")
    v4 = ipaddress.IPv4Address(packed[12:])
    return [
        ip.compressed,
        ip.exploded,
        ip.compressed.upper(),
        ":".join(h.lstrip("0") or "0" for h in hextets),
        ":".join(hextets[:6]) + f":{v4}",
        _v4_tail_compressed(packed),
    ]


ipv6_texts = st.tuples(ipv6_packed, st.integers(0, 5)).map(lambda t: _ipv6_texts(t[0])[t[1]])
ip_garbage = st.text(st.sampled_from("0123456789abcdefABCDEFg:.%/"), max_size=48)
ports = st.one_of(
    st.integers(1, 0xFFFF).map(str),
    st.sampled_from(["", "0", "00443", "65536", "99999", "123456", "44a", "-1", "1:2"]),
)
port_suffixes = st.one_of(ports.map(lambda p: ":" + p), st.just(""))
targets = st.one_of(
    st.tuples(reg_names, port_suffixes).map("".join),
    st.tuples(st.one_of(ipv6_texts, ip_garbage), port_suffixes).map(lambda t: f"[{t[0]}]{t[1]}"),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF), min_size=1, max_size=30),
)
latin1_values = st.text(
    st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.sampled_from("\t\x80\xa0\xff\x00\x01\x7f\x0b"),
    ),
    max_size=30,
)
cred_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"), max_size=40)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _bad_padding(token: str, how: int) -> str:
    """A valid token made (usually) invalid for b64decode(validate=True)."""
    bare = token.rstrip("=")
    variants = [bare, token + "=", token + "==", bare + "=", "=" + token, token[:-1], token + "A"]
    return variants[how]


auth_values = st.one_of(
    st.builds(_basic, cred_text.map(lambda u: u.replace(":", "")), cred_text),
    st.builds(
        lambda user, password, how: "Basic " + _bad_padding(_basic(user, password)[6:], how),
        cred_text.map(lambda u: u.replace(":", "")),
        cred_text,
        st.integers(0, 6),
    ),
    st.builds(
        lambda scheme, sep, token, ows: f"{ows}{scheme}{sep}{token}{ows}",
        st.sampled_from(["Basic", "basic", "BASIC", "Bearer", "Basic\t", "Basi"]),
        st.sampled_from([" ", "  ", " \t", ""]),
        st.one_of(
            st.binary(max_size=300).map(lambda b: base64.b64encode(b).decode()),
            st.text(st.sampled_from("QUJDZGVm+/=\t \xe9"), max_size=12),
        ),
        st.sampled_from(["", " ", "\t "]),
    ),
)
header_names = st.one_of(
    tokens,
    st.sampled_from(
        ["Host", "host", "Proxy-Authorization", "proxy-authorization", "Content-Length",
         "Transfer-Encoding", "User-Agent", "Proxy-Connection", "Bad Name", ""]
    ),
)  # fmt: skip
headers = st.lists(
    st.tuples(
        header_names,
        st.sampled_from([": ", ":", ":\t", " : "]),
        st.one_of(latin1_values, auth_values),
    ).map("".join),
    max_size=6,
)


def _noise(draw) -> st.SearchStrategy[bool]:
    """Half the messages are entirely valid; in the rest each piece is off one time in four."""
    noisy = draw(st.booleans())

    def pick(good: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
        return st.integers(0, 3).flatmap(lambda k: odd if k == 0 else good) if noisy else good

    return pick


good_targets = st.one_of(
    st.tuples(reg_names, st.integers(1, 0xFFFF)).map(lambda t: f"{t[0]}:{t[1]}"),
    st.tuples(ipv6_texts, st.integers(1, 0xFFFF)).map(lambda t: f"[{t[0]}]:{t[1]}"),
)
good_field_values = latin1_values.map(lambda v: "".join(c for c in v if c >= " " or c == "\t"))


@st.composite
def http_heads(draw) -> bytes:
    """Plausible request heads: valid, or with a few pieces slightly off."""
    _mostly = _noise(draw)
    lead = draw(st.sampled_from(["", "", "", "\r\n", "\n", "\r\n\n"]))
    method = draw(
        _mostly(st.just("CONNECT"), st.sampled_from(["connect", "GET", "CONNEC", "CONNECTX"]))
    )
    version = draw(
        _mostly(
            st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
            st.sampled_from(["HTTP/2.0", "HTTP/1.x", "HTTP/1.1 ", "http/1.1"]),
        )
    )
    eols = _mostly(st.sampled_from(["\r\n", "\n"]), st.sampled_from(["\r", "\r\r\n", "\n\r"]))
    line = f"{method} {draw(_mostly(good_targets, targets))} {version}{draw(eols)}"
    good_fields = st.tuples(
        _mostly(tokens, header_names),
        st.sampled_from([": ", ":", ":\t"]),
        _mostly(good_field_values, auth_values),
    ).map("".join)
    odd_fields = st.tuples(header_names, st.sampled_from([": ", " : ", ""]), latin1_values).map(
        "".join
    )
    fields = draw(st.lists(_mostly(good_fields, odd_fields), max_size=6))
    if draw(st.booleans()):
        fields.insert(0, "Proxy-Authorization: " + draw(auth_values))
    return (lead + line + "".join(f + draw(eols) for f in fields) + draw(eols)).encode("latin-1")


@st.composite
def good_connect_heads(draw) -> tuple[bytes, tuple]:
    """Well-formed CONNECT heads that C must accept, with the fields Python finds."""
    if draw(st.booleans()):
        host_text = draw(
            st.from_regex(r"[A-Za-z0-9_\-]{1,30}(\.[A-Za-z0-9_\-]{1,30}){0,4}", fullmatch=True)
        )
        host, target_host = host_text.lower(), host_text
    else:
        packed = draw(ipv6_packed.filter(lambda a: ipaddress.IPv6Address(a).ipv4_mapped is None))
        text = _ipv6_texts(packed)[draw(st.integers(0, 5))]
        host, target_host = ipaddress.IPv6Address(packed).compressed, f"[{text}]"
    port = draw(st.integers(1, 0xFFFF))
    eol = draw(st.sampled_from(["\r\n", "\n"]))
    fields = draw(
        st.lists(
            st.tuples(
                st.one_of(tokens, st.sampled_from(["User-Agent", "Proxy-Connection", "Accept"])),
                latin1_values.filter(
                    lambda v: not any((c < " " and c != "\t") or c == "\x7f" for c in v)
                ),
            ).filter(
                lambda nv: (
                    nv[0].lower()
                    not in ("host", "content-length", "transfer-encoding", "proxy-authorization")
                )
            ),
            max_size=5,
        )
    )
    if draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), ("Host", f"{target_host}:{port}"))
    creds = None
    if draw(st.booleans()):
        user = draw(cred_text.map(lambda u: u.replace(":", "")))
        password = draw(cred_text)
        creds = (user, password)
        scheme = draw(st.sampled_from(["Basic", "basic", "BASIC", "bAsIc"]))
        sep, ows = draw(st.sampled_from([" ", "  ", " \t"])), draw(st.sampled_from(["", " \t"]))
        value = f"{ows}{scheme}{sep}{_basic(user, password)[6:]}{ows}"
        fields.insert(draw(st.integers(0, len(fields))), ("Proxy-Authorization", value))
    head = draw(st.sampled_from(["", "", "\r\n", "\n", "\r\n\n"]))
    head += f"CONNECT {target_host}:{port} HTTP/1.{draw(st.sampled_from('01'))}{eol}"
    head += "".join(f"{n}: {v}{eol}" for n, v in fields) + eol
    raw = head.encode("latin-1")
    return raw, ("ok", len(raw), host, port, creds)


@_settings(150)
@given(good=good_connect_heads(), trailer=st.binary(max_size=16))
def test_http_good_connect_heads_are_never_deferred(good, trailer):
    raw, expected = good
    assert py_http(raw) == expected
    assert c_http(raw) == expected
    assert c_http(raw + trailer) == expected
    for cut in range(len(raw)):
        assert c_http(raw[:cut]) == NEED, raw[:cut]


@_settings(300)
@given(head=http_heads(), trailer=st.binary(max_size=8))
def test_http_plausible_heads(head, trailer):
    check_http(head)
    check_http(head + trailer)


@_settings(60)
@given(head=http_heads())
def test_http_every_prefix(head):
    check_prefixes(check_http, head)


@_settings(400)
@given(buf=st.one_of(mutated(http_heads()), mutated(good_connect_heads().map(lambda g: g[0]))))
def test_http_mutated(buf):
    check_http(buf)


@_settings(200)
@given(
    buf=st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=60).map(lambda b: b"CONNECT " + b),
        st.text(st.sampled_from("CONECT :1[]\r\n\tHP/.ab"), max_size=60).map(str.encode),
    )
)
def test_http_random_bytes(buf):
    check_http(buf)


def test_http_head_size_bound():
    """NEED_MORE only under http.MAX_HEAD_SIZE; a head ending inside it is still OK."""
    start = b"CONNECT a.example:443 HTTP/1.1\r\n"
    filler = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    long_head = start + filler * 70
    assert len(long_head) > http.MAX_HEAD_SIZE
    for cut in (http.MAX_HEAD_SIZE - 1, http.MAX_HEAD_SIZE, http.MAX_HEAD_SIZE + 1):
        verdict = check_http(long_head[:cut])
        assert verdict == (NEED if cut < http.MAX_HEAD_SIZE else DEFER)
    pad = http.MAX_HEAD_SIZE - len(start) - len(b"X: \r\n\r\n")
    exact = start + b"X: " + b"v" * pad + b"\r\n\r\n"
    assert len(exact) == http.MAX_HEAD_SIZE
    assert check_http(exact + b"more")[0] == "ok"
    assert check_http(start + b"X: " + b"v" * (pad + 1) + b"\r\n\r\n") == DEFER


def test_http_defers_what_c_does_not_decide():
    ok = b"CONNECT h:1 HTTP/1.1\r\n"
    for buf in [
        b"GET http://h/ HTTP/1.1\r\n\r\n",  # another method
        b"G",  # cannot be "CONNECT "
        b"connect h:1 HTTP/1.1\r\n\r\n",  # Python accepts it (method.upper())
        ok + b"Content-Length: 0\r\n\r\n",
        ok + b"Transfer-Encoding: chunked\r\n\r\n",
        ok + b"Host: a\r\nHOST: b\r\n\r\n",
        ok + b"X: a\r\n b\r\n\r\n",  # obs-fold
        b"CONNECT [::ffff:1.2.3.4]:1 HTTP/1.1\r\n\r\n",  # .compressed differs by version
        ok + b"Proxy-Authorization: Basic " + base64.b64encode(b"u:\0") + b"\r\n\r\n",
        ok + b"Proxy-Authorization: Basic " + base64.b64encode(b"u:" + b"p" * 256) + b"\r\n\r\n",
        b"CONNECT h HTTP/1.1\r\n\r\n",  # Python's 400
        # '=' after whole quads: accepted by 3.11 to 3.12.3, refused since 3.12.4
        ok + b"Proxy-Authorization: Basic OjAw=\r\n\r\n",
        ok + b"Proxy-Authorization: Basic dTpw===\r\n\r\n",
    ]:
        assert check_http(buf) == DEFER, buf


def test_http_basic_token_padding_shapes():
    """Every cut of a token with 0-4 '=' and a stray character: binascii's strict rules."""
    head = b"CONNECT h:1 HTTP/1.1\r\nProxy-Authorization: Basic %s\r\n\r\n"
    for creds in (b":", b"u:", b"us:", b"u:p", b"us:pa", b"usr:pas", b"\xc3\xa9:\xff"):
        bare = base64.b64encode(creds).rstrip(b"=")
        for cut in range(len(bare) + 1):
            for pads in range(5):
                for extra in (b"", b"A", b"=", b" "):
                    token = bare[:cut] + b"=" * pads + extra
                    verdict = check_http(head % token)
                    data = token.strip().rstrip(b"=")
                    # '=' after whole quads: accepted by 3.11 to 3.12.3, refused since 3.12.4
                    version_dependent = data and len(data) % 4 == 0 and b"=" not in data
                    version_dependent = version_dependent and data != token.strip()
                    creds = py_http(head % token)[4]
                    if version_dependent or (creds and "\0" in "".join(creds)):
                        assert verdict == DEFER, token
                    else:
                        assert verdict[0] == "ok", token


# -- HTTP upstream proxy (client side) ---------------------------------------------------


def c_response(buf: bytes, max_size: int = http.MAX_HEAD_SIZE):
    out = ffi.new("sw_http_response *")
    with exact(buf) as p:
        status = _STATUS[lib.sw_parse_http_response(p, len(buf), max_size, out)]
    assert status != "defer", "the response parser never defers"
    if status != "ok":
        return (status,)
    assert 0 < out.consumed <= min(len(buf), max_size)
    return ("ok", out.status, out.consumed)


def py_response(buf: bytes, max_size: int = http.MAX_HEAD_SIZE):
    try:
        head = http.parse_response_head(buf, max_size)
    except ProtocolError:
        return ("error",)
    if head is NEED_MORE:
        return NEED
    return ("ok", head.status, head.consumed)


def check_response(buf: bytes, max_size: int = http.MAX_HEAD_SIZE):
    """The upstream response head: exactly Python's verdict, status and consumed, and
    for an error exactly its message (see check_response_error)."""
    c, py = c_response(buf, max_size), py_response(buf, max_size)
    assert c == py, (buf, max_size)
    note(f"response: {c[0]}")
    message = check_response_error(buf, max_size)
    assert (message is not None) == (c[0] == "error")
    return c


# Slack after the capacity passed to sw_http_response_error: it must stay 0xA5.
_MSG_SLACK = 8


def c_response_error(
    buf: bytes, max_size: int = http.MAX_HEAD_SIZE, cap: int | None = None
) -> tuple[int, bytes]:
    """sw_http_response_error's return value and the bytes before msg's NUL.

    ``cap`` defaults to room for any message about ``buf`` (4 bytes per input byte for
    a repr()'d piece, plus the fixed text).  Checks that msg is NUL-terminated within
    cap (cap > 0) and that nothing after the NUL was written.
    """
    if cap is None:
        cap = 4 * len(buf) + 64
    with exact(buf) as p, _out_block(cap + _MSG_SLACK) as out:
        msg = ffi.cast("char *", out) if cap else ffi.NULL
        rc = lib.sw_http_response_error(p, len(buf), max_size, msg, cap)
        block = bytes(ffi.buffer(out, cap + _MSG_SLACK))
    if cap == 0:
        assert block == b"\xa5" * _MSG_SLACK, "wrote with cap 0"
        return rc, b""
    assert 0 in block[:cap], "msg not NUL-terminated within cap"
    nul = block.index(0)
    assert block[nul + 1 :] == b"\xa5" * (len(block) - nul - 1), "wrote past the NUL"
    return rc, block[:nul]


def py_response_error(buf: bytes, max_size: int = http.MAX_HEAD_SIZE) -> str | None:
    """str() of the ProtocolError parse_response_head raises, or None."""
    try:
        http.parse_response_head(buf, max_size)
    except ProtocolError as exc:
        return str(exc)
    return None


def _message_kind(message: str) -> str:
    """The message without the repr() it may end with (for the statistics)."""
    quote = min((i for i in (message.find("'"), message.find('"')) if i >= 0), default=None)
    return message if quote is None else message[:quote] + "..."


def check_response_error(buf: bytes, max_size: int = http.MAX_HEAD_SIZE) -> str | None:
    """sw_http_response_error: Python's message byte for byte (UTF-8), or -EINVAL and an
    empty msg where Python raises nothing."""
    py = py_response_error(buf, max_size)
    rc, msg = c_response_error(buf, max_size)
    if py is None:
        assert (rc, msg) == (-errno.EINVAL, b""), (buf, max_size)
        return None
    expected = py.encode("utf-8")
    assert msg == expected, (buf, max_size, msg.decode("utf-8", "replace"), py)
    assert rc == len(expected)
    note(f"message: {_message_kind(py)}")
    return py


good_reasons = st.text(
    st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E), st.sampled_from("\t\x80\xa0\xb2\xff")
    ),
    max_size=20,
)
# Field values _BAD_VALUE_CHAR_RE accepts (good_field_values still lets DEL through).
response_field_values = good_field_values.map(lambda v: v.replace("\x7f", ""))
# What follows the SP or HTAB of an obs-fold line: Python appends it unchecked, so
# anything but NUL, CR and LF (which _head_lines and the line split act on) is fine.
fold_texts = st.text(st.characters(max_codepoint=0xFF, exclude_characters="\0\r\n"), max_size=20)
_FOLD_STARTS = [" ", "\t", "  ", " \t", "\t "]


@st.composite
def response_heads(draw) -> bytes:
    """Plausible upstream response heads: valid, or with a few pieces slightly off."""
    _mostly = _noise(draw)
    lead = draw(_mostly(st.just(""), st.sampled_from(["\r\n", "\n", " ", "H", "HTTP", "x"])))
    version = draw(
        _mostly(
            st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/1.9"]),
            st.sampled_from(
                ["HTTP/2.0", "HTTP/1.x", "HTTP/1.10", "HTTP/1", "http/1.1", "HTTP/1.1\r",
                 "HTTPS/1.1", "HTTP/1.1\0", "HTTP/", "HTTP/1.\xb9"]
            ),
        )
    )  # fmt: skip
    sep = draw(_mostly(st.just(" "), st.sampled_from(["", "  ", "\t"])))
    code = draw(
        _mostly(
            st.integers(100, 999).map(str),
            st.sampled_from(
                ["099", "000", "99", "1000", "2x0", "\xb200", "20\xb9", "", "-20", "+20", "2 0"]
            ),
        )
    )
    reason = draw(
        _mostly(
            st.one_of(good_reasons.map(lambda r: " " + r), st.just(""), st.just(" ")),
            st.one_of(
                latin1_values.map(lambda r: " " + r), st.sampled_from([" \r", " OK\0", " a\rb"])
            ),
        )
    )
    eols = _mostly(st.sampled_from(["\r\n", "\n"]), st.sampled_from(["\r", "\r\r\n", "\n\r"]))
    good_fields = st.tuples(
        tokens, st.sampled_from([": ", ":", ":\t", ": \t"]), response_field_values
    ).map("".join)
    folds = st.tuples(st.sampled_from(_FOLD_STARTS), st.one_of(fold_texts, latin1_values)).map(
        "".join
    )
    odd_fields = st.tuples(
        header_names, st.sampled_from([": ", " : ", "", ":"]), latin1_values
    ).map("".join)
    # A field with its continuation lines, or an odd line on its own.
    field_groups = st.tuples(good_fields, st.lists(folds, max_size=2)).map(lambda g: [g[0], *g[1]])
    groups = draw(st.lists(_mostly(field_groups, odd_fields.map(lambda f: [f])), max_size=5))
    fields = [line for group in groups for line in group]
    if draw(st.integers(0, 7)) == 0:
        fields.insert(0, draw(folds))  # a fold with no field to continue
    lines = [lead + version + sep + code + reason, *fields]
    return ("".join(line + draw(eols) for line in lines) + draw(eols)).encode("latin-1")


@st.composite
def good_response_heads(draw) -> tuple[bytes, int]:
    """Valid response heads (obs-fold included) with the status Python finds."""
    status = draw(st.integers(100, 999))
    line = f"HTTP/1.{draw(st.integers(0, 9))} {status}"
    reason = draw(st.one_of(st.none(), good_reasons))
    if reason is not None:
        line += " " + reason
    lines = [line]
    for _ in range(draw(st.integers(0, 6))):
        if len(lines) > 1 and draw(st.integers(0, 3)) == 0:
            lines.append(draw(st.sampled_from(_FOLD_STARTS)) + draw(fold_texts))
        else:
            ows = draw(st.sampled_from(["", " ", "\t", " \t "]))
            lines.append(f"{draw(tokens)}:{ows}{draw(response_field_values)}{ows}")
    eols = st.sampled_from(["\r\n", "\n"])
    raw = ("".join(line + draw(eols) for line in lines) + draw(eols)).encode("latin-1")
    return raw, status


@_settings(200)
@given(good=good_response_heads(), trailer=st.binary(max_size=16))
def test_response_good_heads(good, trailer):
    raw, status = good
    assert check_response(raw) == ("ok", status, len(raw))
    assert check_response(raw + trailer) == ("ok", status, len(raw))
    for cut in range(len(raw)):
        assert check_response(raw[:cut]) == NEED, raw[:cut]


@_settings(400)
@given(head=response_heads(), trailer=st.binary(max_size=8))
def test_response_plausible_heads(head, trailer):
    check_response(head)
    check_response(head + trailer)


@_settings(80)
@given(head=response_heads())
def test_response_every_prefix(head):
    """Truncation at every offset, which includes every early status-line judgement."""
    check_prefixes(check_response, head)


@_settings(150)
@given(
    head=st.one_of(response_heads(), good_response_heads().map(lambda g: g[0])),
    trailer=st.binary(max_size=8),
    data=st.data(),
)
def test_response_max_size(head, trailer, data):
    """Every max_size around the head's length, at every prefix."""
    buf = head + trailer
    max_size = data.draw(
        st.one_of(st.integers(0, len(buf) + 4), st.integers(max(0, len(head) - 3), len(head) + 3))
    )
    check_prefixes(functools.partial(check_response, max_size=max_size), buf)


@_settings(400)
@given(buf=st.one_of(mutated(response_heads()), mutated(good_response_heads().map(lambda g: g[0]))))
def test_response_mutated(buf):
    check_response(buf)


@_settings(300)
@given(
    buf=st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=60).map(lambda b: b"HTTP/" + b),
        st.binary(max_size=60).map(lambda b: b"HTTP/1.1 " + b),
        st.binary(max_size=60).map(lambda b: b"HTTP/1.1 200 OK\r\n" + b),
        st.text(st.sampled_from("HTP/1.0 29\r\n\t:ab\0\x7f\x80"), max_size=60).map(
            lambda t: t.encode("latin-1")
        ),
    ),
    max_size=st.one_of(st.just(http.MAX_HEAD_SIZE), st.integers(0, 80)),
)
def test_response_random_bytes(buf, max_size):
    check_response(buf, max_size)


def test_response_known_cases():
    ok = b"HTTP/1.1 200 OK\r\n"
    cases = {
        b"": NEED,
        b"HTTP": NEED,
        b"HTTP/": NEED,
        b"HTTP/1.1 200 OK": NEED,
        b"HTTP/1.1 200\r\n": NEED,  # no reason phrase: fine
        b"HTTP/1.1 200 \r\n": NEED,
        b"HTTP/1.1 099 x\r\n": ("error",),  # judged before the head is complete
        b"HTTP/1.1 20\r\n": ("error",),
        b"HTTP/1.1 \xb200 x\r\n": ("error",),  # latin-1 superscript two: isdigit, not ascii
        b"HTTP/2.0 200 OK\r\n": ("error",),
        b"HTTP/1.1 200 O\rK\r\n": ("error",),
        b"HTTP/1.1 200 O\0K\r\n": ("error",),
        b"HTTP/1.1 200 OK\r\r\n": ("error",),
        b"HTTP/1.1 200 OK\n\r": NEED,
        b"HTTPS": ("error",),
        b"http/": ("error",),
        b"\r\nHTTP/1.1 200 OK\r\n\r\n": ("error",),
        ok + b"\r\n": ("ok", 200, len(ok) + 2),
        ok + b"\n": ("ok", 200, len(ok) + 1),  # "\n\n" ends the head too
        b"HTTP/1.1 407 Proxy Authentication Required\n\n": ("ok", 407, 44),
        b"HTTP/1.0 999\r\n\r\nbody": ("ok", 999, 16),
        ok + b"X: a\r\n b\r\n\r\n": ("ok", 200, len(ok) + 12),  # obs-fold, unfolded
        ok + b"X: a\r\n \x01\x7f\xff\x0b\r\n\r\n": ("ok", 200, len(ok) + 15),  # unchecked
        ok + b" b\r\nX: a\r\n\r\n": ("error",),  # a fold before any field
        ok + b"X: a\r\n \0\r\n\r\n": ("error",),  # NUL anywhere in the head
        ok + b"X: a\r\n \rb\r\n\r\n": ("error",),  # bare CR, even in a fold
        ok + b"X : a\r\n\r\n": ("error",),
        ok + b": a\r\n\r\n": ("error",),
        ok + b"X\r\n\r\n": ("error",),
        ok + b"X: a\x7f\r\n\r\n": ("error",),
        ok + b"X: \ta\tb\t\r\n\r\n": ("ok", 200, len(ok) + 12),
        ok + b"X: a\r\n\r\n\0": ("ok", 200, len(ok) + 8),  # after the head: not looked at
        ok + b"X: \x01\r\n": NEED,  # fields are judged only once the head is complete
    }
    for buf, expected in cases.items():
        assert check_response(buf) == expected, buf


def test_response_head_size_bound():
    """No terminator within max_size bytes is an error; one ending right at it is OK."""
    assert lib.SW_HTTP_MAX_HEAD == http.MAX_HEAD_SIZE
    limit = http.MAX_HEAD_SIZE
    start = b"HTTP/1.1 200 OK\r\nX: "
    for total in (limit - 2, limit - 1, limit, limit + 1, limit + 2):
        for end in (b"\r\n\r\n", b"\n\n", b"\n\r\n"):
            head = start + b"v" * (total - len(start) - len(end)) + end
            assert len(head) == total
            verdict = check_response(head + b"more")
            assert verdict == (("ok", 200, total) if total <= limit else ("error",)), (total, end)
            for cut in (limit - 3, limit - 2, limit - 1, limit, limit + 1):
                check_response(head[:cut])
    # The terminator straddling the bound, and an incomplete head of exactly the limit.
    for tail in (b"\r\n", b"\r\n\r", b"\n\r"):
        head = start + b"v" * (limit - len(start) - len(tail) + 1) + tail + b"\n"
        assert check_response(head) == ("error",)
    assert check_response((start + b"v" * limit)[: limit - 1]) == NEED
    assert check_response((start + b"v" * limit)[:limit]) == ("error",)
    assert check_response(b"", 0) == ("error",)
    assert check_response(b"HTTP/1.1 200 OK\r\n\r\n", 19) == ("ok", 200, 19)
    assert check_response(b"HTTP/1.1 200 OK\r\n\r\n", 18) == ("error",)


# -- the upstream response's error message (sw_http_response_error) ---------------------

# Characters that stress repr(): both quotes and backslash, the \t \n \r escapes, other C0
# controls, DEL, the C1 controls, U+00A0 and U+00AD (not printable) next to printable
# latin-1 (U+00A1, U+00AC, U+00AE, superscripts, letters), and the structure bytes.
_REPR_CHARS = (
    "'\"\\\t\r\0\x01\x0b\x1b\x1f\x7f\x80\x85\x9f\xa0\xa1\xac\xad\xae\xb2\xb9\xe9\xff :/.1Hx"
)
repr_texts = st.text(
    st.one_of(st.sampled_from(_REPR_CHARS), st.characters(max_codepoint=0xFF)), max_size=12
)
# Texts that cannot hold a NUL, CR or LF: what a line of a complete head can.
line_texts = repr_texts.map(lambda t: t.translate({0: None, 10: None, 13: None}))
bad_versions = st.one_of(
    st.sampled_from(
        ["HTTP/2.0", "HTTP/1.10", "HTTP/1", "HTTP/", "HTTP/1.x", "HTTP/1.\xb9", "HTTP/1.1\0",
         "HTTP/1.1\r", "HTTP/1.1\t", "HTTP/'1\"", "HTTP/1.'", 'HTTP/1."', "HTTP/1.\\",
         "HTTP/1.\xa0", "HTTP/1.\xa1", "HTTP/1.\xad", "HTTP/1.\x85", "HTTP/1.\xff"]
    ),
    repr_texts.map(lambda t: "HTTP/" + t),
    repr_texts.map(lambda t: "HTTP/1." + t),
    st.tuples(repr_texts, repr_texts).map(lambda t: f"HTTP/{t[0]}1.{t[1]}"),
)  # fmt: skip
bad_codes = st.one_of(
    st.sampled_from(["099", "000", "20", "2000", "2x0", "\xb200", "20\xb9", "", "+20", "2\t0"]),
    repr_texts.filter(lambda t: " " not in t),
)
bad_reasons = st.one_of(
    repr_texts, st.text(st.sampled_from("\0\x01\x08\x0b\x0c\x1f\x7f\r\ta \x80\xff"), max_size=6)
)
status_lines = st.one_of(
    st.builds(lambda v, c, r: f"{v} {c} {r}", st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
              st.integers(100, 999), good_reasons),
    st.builds(lambda v, rest: v + rest, bad_versions, st.sampled_from([" 200 OK", " 200", ""])),
    st.builds(lambda c, r: f"HTTP/1.1 {c}{r}", bad_codes, st.sampled_from(["", " OK", " "])),
    st.builds(lambda c, r: f"HTTP/1.1 {c} {r}", st.sampled_from(["200", "099", "000"]),
              bad_reasons),
)  # fmt: skip
bad_names = st.one_of(
    st.just(""),
    line_texts,
    st.tuples(tokens, line_texts, st.one_of(tokens, st.just(""))).map("".join),
    st.sampled_from(["X Y", "X\tY", " X", "X ", "X'Y", 'X"Y', "X\\Y", "X\xa0", "X\xe9", "{}"]),
)
# A value with a control character _BAD_VALUE_CHAR_RE refuses (NUL and CR fail earlier).
_value_chars = st.text(st.sampled_from("a \t\x80\xff\x01\x7f"), max_size=3)
bad_values = st.tuples(_value_chars, st.sampled_from("\x01\x08\x0b\x0c\x1f\x7f"), _value_chars).map(
    "".join
)
field_lines = st.one_of(
    st.tuples(tokens, st.sampled_from([": ", ":", ":\t"]), response_field_values).map("".join),
    st.tuples(bad_names, st.sampled_from([": ", ":", " : "]), response_field_values).map("".join),
    st.tuples(tokens, st.sampled_from([": ", ":"]), bad_values, response_field_values).map("".join),
    st.tuples(st.sampled_from(_FOLD_STARTS), line_texts).map("".join),  # obs-fold
    line_texts.map(lambda t: t.replace(":", "")),  # no colon
    st.sampled_from(["", "\0", "\r", "X: a\rb", "X: a\0", "X\r: a", "\0X: a", "X: \r"]),
)


@st.composite
def error_heads(draw) -> tuple[bytes, int]:
    """Response heads made to fail, often in several places at once (so that which check
    Python runs first decides the message), with the max_size to parse them under."""
    lines = [draw(status_lines), *draw(st.lists(field_lines, max_size=5))]
    # Line ends that break the head (a bare CR, an early end) in one head in four.
    eols = ["\r\n", "\n"]
    if draw(st.integers(0, 3)) == 3:
        eols = [*eols * 3, "\r", "\r\r\n", "\n\r"]
    eol = st.sampled_from(eols)
    raw = ("".join(line + draw(eol) for line in lines) + draw(eol)).encode("latin-1")
    how = draw(st.sampled_from(["whole", "whole", "whole", "whole", "cut", "trailer"]))
    if how == "cut":  # cut short: NEED_MORE or the early status-line verdict
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif how == "trailer":
        raw += draw(st.binary(max_size=8))
    max_size = http.MAX_HEAD_SIZE
    if draw(st.integers(0, 7)) == 7:
        max_size = draw(st.integers(max(0, len(raw) - 4), len(raw) + 4))
    return raw, max_size


@_settings(1500)
@given(head=error_heads())
def test_response_error_messages(head):
    check_response(*head)


@_settings(100)
@given(head=error_heads())
def test_response_error_messages_every_prefix(head):
    """Prefixes meet the early judgement of the status line, and later the complete
    head's order of checks, which may name a different fault for the same bytes."""
    check_prefixes(functools.partial(check_response, max_size=head[1]), head[0])


@_settings(300)
@given(buf=mutated(error_heads().map(lambda h: h[0])))
def test_response_error_messages_mutated(buf):
    check_response(buf)


def test_response_error_every_byte():
    """Each latin-1 code point in a version, a header name, a value and a reason, in
    heads complete and not, and both quotes with and without a backslash."""
    ok = b"HTTP/1.1 200 OK\r\n"
    for b in map(bytes, ([c] for c in range(256))):
        for buf in (
            b"HTTP/" + b + b" 200 OK\r\n",
            b"HTTP/" + b + b" 200 OK\r\n\r\n",
            b"HTTP/1." + b + b"\n",
            b"HTTP/1." + b + b"\n\n",
            b"HTTP/1.1" + b + b"x 200\r\n\r\n",
            b"HTTP/1.1 200 " + b + b"\r\n",
            b"HTTP/1.1 2" + b + b"0\r\n",
            ok + b + b"X: y\r\n\r\n",
            ok + b"X" + b + b": y\r\n\r\n",
            ok + b"X" + b + b"Y" + b + b": y\r\n\r\n",
            ok + b"X: y" + b + b"\r\n\r\n",
            ok + b"X: y\r\n" + b + b"\r\n\r\n",
        ):
            check_response(buf)
    for text in ["'", '"', "'\"", "\"'", "\\", "\\'", '\\"', "a'b\"c\\d", "''", '""', "'\\\"'"]:
        raw = text.encode("latin-1")
        check_response(b"HTTP/" + raw + b" 200\r\n")
        check_response(ok + b"X" + raw + b": y\r\n\r\n")


def test_response_error_known_messages():
    ok = b"HTTP/1.1 200 OK\r\n"
    cases = {
        b"x": "not an HTTP response",
        b"HTTPS/1.1 200 OK\r\n\r\n": "not an HTTP response",
        b"HTTP/2.0 200 OK\r\n": "unsupported response version 'HTTP/2.0'",
        b"HTTP/1.10 200 OK\r\n": "unsupported response version 'HTTP/1.10'",
        b"HTTP/1.\xa0\xa1\xad\xae\x85\xff\t\x00\x7f\r\n": (
            "unsupported response version 'HTTP/1.\\xa0\xa1\\xad\xae\\x85\xff\\t\\x00\\x7f'"
        ),
        b"HTTP/1.1\r\r\n": "unsupported response version 'HTTP/1.1\\r'",  # early: CR kept
        b"HTTP/'1\n": 'unsupported response version "HTTP/\'1"',
        b"HTTP/'1\"\n": "unsupported response version 'HTTP/\\'1\"'",
        b"HTTP/\\\n": "unsupported response version 'HTTP/\\\\'",
        b"HTTP/1.1 20\r\n": "malformed status code",
        b"HTTP/1.1\r\n": "malformed status code",
        b"HTTP/1.1 \xb200 x\r\n": "malformed status code",
        b"HTTP/1.1 099\r\n": "malformed status code",
        b"HTTP/1.1 099 \x01\r\n": "invalid reason phrase",  # the reason is checked first
        b"HTTP/1.1 200 O\0K\r\n": "invalid reason phrase",  # early: no NUL check yet
        b"HTTP/1.1 200 O\0K\r\n\r\n": "malformed response head: NUL in head",
        b"HTTP/1.1 200 O\rK\r\n\r\n": "malformed response head: bare CR in head",
        ok + b"X Y: z\r\n\r\n": "malformed response head: invalid header name 'X Y'",
        ok + b": z\r\n\r\n": "malformed response head: invalid header name ''",
        ok + b"X\xe9\xa0: z\r\n\r\n": "malformed response head: invalid header name 'X\xe9\\xa0'",
        ok + b"Foo: \x01\r\n\r\n": "malformed response head: invalid character in header 'Foo'",
        ok + b"Foo\r\n\r\n": "malformed response head: header line without a colon",
        ok + b" x\r\nA: b\r\n\r\n": "malformed response head: obsolete line folding",
        ok + b"A: b\r\n x\x01\r\n\r\n": None,  # a continuation line is not checked
        # A complete head: _head_lines, then _parse_fields, then the status line.
        b"HTTP/2.0 200 OK\r\nX Y: z\r\n\r\n": "malformed response head: invalid header name 'X Y'",
        b"HTTP/2.0 200 OK\r\nX Y: z\r\n": "unsupported response version 'HTTP/2.0'",  # early
        b"HTTP/2.0 200\r\nX: \x01\r\nY Z: a\r\n\r\n": (
            "malformed response head: invalid character in header 'X'"
        ),
        b"HTTP/2.0 200\r\nX Y: a\r\nZ: \rb\r\n\r\n": "malformed response head: bare CR in head",
        b"HTTP/2.0 2\r0\r\nX Y: \0\r\n\r\n": "malformed response head: NUL in head",
        b"HTTP/1.1 099 x\r\n\r\n": "malformed status code",
        b"HTTP/1.1 200 OK\r\n\r\n": None,
        b"HTTP/1.1 200 OK\r\n": None,
        b"": None,
    }
    for buf, expected in cases.items():
        assert check_response_error(buf) == expected, buf
        assert py_response_error(buf) == expected, buf
    # max_size comes first: nothing else is looked at.
    assert check_response_error(b"xyz", 3) == "response head too large"
    assert check_response_error(b"HTTP/2.0 200\r\n", 5) == "response head too large"
    assert check_response_error(b"xyz", 4) == "not an HTTP response"
    assert check_response_error(b"", 0) == "response head too large"


def _truncated(message: bytes, cap: int) -> bytes:
    """What msg holds for cap <= len(message): the longest prefix of at most cap - 1
    bytes that does not end inside a UTF-8 sequence."""
    cut = message[: max(cap - 1, 0)]
    return cut.decode("utf-8", "ignore").encode("utf-8")


def check_response_error_caps(buf: bytes, max_size: int = http.MAX_HEAD_SIZE) -> None:
    """Every capacity: the whole message when it fits with its NUL, else -ENOSPC and the
    longest prefix that fits without splitting a character; -EINVAL whatever the cap."""
    py = py_response_error(buf, max_size)
    if py is None:
        for cap in (0, 1, 2, 100):
            assert c_response_error(buf, max_size, cap) == (-errno.EINVAL, b""), cap
        return
    message = py.encode("utf-8")
    for cap in range(len(message) + 3):
        rc, msg = c_response_error(buf, max_size, cap)
        if cap > len(message):
            assert (rc, msg) == (len(message), message), cap
        else:
            assert (rc, msg) == (-errno.ENOSPC, _truncated(message, cap)), cap
            assert len(msg) >= cap - 2


def test_response_error_caps():
    ok = b"HTTP/1.1 200 OK\r\n"
    for buf in [
        b"x",
        b"HTTP/\xe9\xe9\xa0\xe9 200\r\n",  # UTF-8 pairs at odd and even offsets
        b"HTTP/1.\xff\xfe\xfd\r\n",
        b"HTTP/1.\x00\x01\\'\n",
        ok + b"X\xe9: y\r\n\r\n",
        ok + b"X: \x01\r\n\r\n",
        ok,  # not an error
        b"HTTP/1.1 200 OK\r\n\r\n",
    ]:
        check_response_error_caps(buf)
    assert lib.sw_http_response_error(b"x", 1, 100, ffi.NULL, 0) == -errno.ENOSPC
    assert lib.sw_http_response_error(ok, len(ok), 100, ffi.NULL, 0) == -errno.EINVAL


@_settings(200)
@given(head=error_heads())
def test_response_error_caps_random(head):
    check_response_error_caps(*head)


def test_response_error_longest_messages():
    """The longest messages a max_size of http.MAX_HEAD_SIZE allows fit in
    SW_HTTP_RESPONSE_ERROR_MAX (NUL included), and are still Python's."""
    limit = http.MAX_HEAD_SIZE
    room = lib.SW_HTTP_RESPONSE_ERROR_MAX
    longest = 0
    for buf in [
        b"HTTP/" + b"\x01" * (limit - 7) + b"\n",  # an early verdict just under max_size
        b"HTTP/" + b"\x01" * (limit - 8) + b"\n\n",  # a complete head of exactly max_size
        b"HTTP/1.1 200\n" + b"\x80" * (limit - 16) + b":\n\n",
        b"HTTP/1.1 200\n" + b"X" * (limit - 17) + b":\x01\n\n",
    ]:
        message = check_response_error(buf)
        assert message is not None
        size = len(message.encode("utf-8"))
        longest = max(longest, size)
        rc, msg = c_response_error(buf, limit, room)
        assert rc == size and len(msg) == size
    assert longest + 1 <= room
    assert room - (longest + 1) < 64, "SW_HTTP_RESPONSE_ERROR_MAX is a close bound"


# Hosts for connect_request: names, IP literals with and without brackets (IPv6 in
# every spelling, IPv4-mapped and -compatible ones, zone ids Python accepts or refuses),
# near misses, and text ASCII cannot encode (C gets the str's UTF-8, lone surrogates
# included via surrogatepass: Python's .encode() refuses those).
ipv4_texts = st.one_of(
    st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t))),
    st.sampled_from(
        ["1.2.3", "1.2.3.4.5", "01.2.3.4", "256.1.1.1", "1.2.3.4 ", " 1.2.3.4", "1..3.4",
         "0.0.0.0", "1.2.3.04", "1.2.3.4/8", "\u0661.2.3.4", "1.2.3.\xb2", "1.2.3.-4"]
    ),
)  # fmt: skip
zone_ids = st.one_of(
    st.sampled_from(["eth0", "1", "", "%", "a%b", "x y", "\r\nX: y", "\xe9", "a/b", "]", "a:b"]),
    st.text(st.characters(max_codepoint=0x2FF, exclude_characters="\0"), max_size=8),
)
request_hosts = st.one_of(
    st.from_regex(r"[A-Za-z0-9_\-]{1,20}(\.[A-Za-z0-9_\-]{1,20}){0,3}\.?", fullmatch=True),
    ipv4_texts,
    ipv6_texts,
    st.tuples(ipv6_texts, zone_ids).map(lambda t: f"{t[0]}%{t[1]}"),
    ip_garbage,
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
    st.text(
        st.characters(exclude_characters="\0", categories=["L", "N", "P", "Cc", "Cs"]), max_size=12
    ),
    st.sampled_from(["", "[", "]", "[]", "[[::1]]", "[::1", "::1]", "b\xfccher.example", "a b"]),
).flatmap(lambda h: st.sampled_from([h, f"[{h}]"]))
request_texts = st.one_of(
    cred_text,
    st.text(
        st.characters(exclude_characters="\0", categories=["L", "N", "P", "Zs", "Cs"]), max_size=12
    ),
    st.sampled_from(["", ":", "a:b", "\ud800", "\xe9\udfff", "\U0001f600"]),
)
request_ports = st.one_of(st.integers(1, 0xFFFF), st.sampled_from([0, 1, 80, 443, 0xFFFF]))
request_credentials = st.one_of(st.none(), st.tuples(request_texts, request_texts))


def _utf8(text: str) -> bytes:
    """What C gets for a Python str: its UTF-8 (lone surrogates as surrogatepass has them)."""
    return text.encode("utf-8", "surrogatepass")


def _out_block(n: int):
    """An output buffer of exactly n bytes (see exact()), filled with 0xA5."""
    return (
        _Exact(b"\xa5" * n) if _ASAN else contextlib.nullcontext(ffi.new("uint8_t[]", b"\xa5" * n))
    )


def c_connect_request(host: str | None, port: int, creds: tuple[str, str | None] | None):
    """C's request bytes, or "ValueError" for -EINVAL; also checks the cap contract."""
    c_host = ffi.NULL if host is None else ffi.new("char[]", _utf8(host))
    c_user = c_pass = ffi.NULL
    if creds is not None:
        c_user = ffi.new("char[]", _utf8(creds[0]))
        c_pass = ffi.NULL if creds[1] is None else ffi.new("char[]", _utf8(creds[1]))

    def call(out, cap: int) -> int:
        return lib.sw_http_connect_request(c_host, port, c_user, c_pass, out, cap)

    slack = 16
    room = 64 + 2 * len(ffi.buffer(c_host) if host is not None else b"")
    if creds is not None:
        room += 2 * (len(ffi.buffer(c_user)) + (len(ffi.buffer(c_pass)) if c_pass else 0)) + 64
    with _out_block(room + slack) as out:
        n = call(out, room)
        written = bytes(ffi.buffer(out, room + slack))
    if n == -errno.EINVAL:
        assert call(ffi.NULL, 0) == -errno.EINVAL, "an error must not depend on the room"
        return "ValueError"
    assert 0 < n <= room, n
    assert written[room:] == b"\xa5" * slack, "wrote past cap"
    request = written[:n]
    # Exactly n bytes of room is enough; any less is -ENOSPC, without writing past cap.
    with _out_block(n) as out:
        assert call(out, n) == n
        assert bytes(ffi.buffer(out, n)) == request
    for cap in sorted({0, 1, n // 2, n - 1}):
        with _out_block(cap) as out:
            assert call(out, cap) == -errno.ENOSPC, cap
    assert call(ffi.NULL, 0) == -errno.ENOSPC
    return request


def _mapped_request_as_311(request: bytes, host: str) -> bytes:
    """3.13 spells IPv4-mapped literals ::ffff:a.b.c.d; C writes 3.11's hex (see parse.h)."""
    if sys.version_info < (3, 13):
        return request
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    text = bare.partition("%")[0]
    mapped = _mapped_as_311(text)
    if mapped == text:
        return request
    compressed = str(ipaddress.IPv6Address(text))
    return request.replace(f"[{compressed}".encode(), f"[{mapped}".encode())


def py_connect_request(host: str, port: int, creds: tuple[str, str] | None):
    try:
        return _mapped_request_as_311(http.connect_request(host, port, creds), host)
    except ValueError:  # UnicodeEncodeError included
        return "ValueError"


def check_connect_request(host: str, port: int, creds: tuple[str, str] | None):
    c, py = c_connect_request(host, port, creds), py_connect_request(host, port, creds)
    assert c == py, (host, port, creds)
    note(f"connect_request: {'ValueError' if c == 'ValueError' else 'built'}")
    return c


@_settings(800)
@given(host=request_hosts, port=request_ports, creds=request_credentials)
def test_connect_request_matches_python(host, port, creds):
    check_connect_request(host, port, creds)


@_settings(200)
@given(
    host=st.one_of(
        ipv6_texts,
        ipv6_texts.map(lambda t: f"[{t}]"),
        st.tuples(ipv6_texts, zone_ids).map(lambda t: f"[{t[0]}%{t[1]}]"),
        ipv4_texts.map(lambda t: f"[{t}]"),
    ),
    port=request_ports,
)
def test_connect_request_ip_literals(host, port):
    check_connect_request(host, port, None)


def test_connect_request_known_cases():
    assert c_connect_request("example.com", 443, None) == (
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
    )
    for host in ["::1", "[::1]", "[::ffff:1.2.3.4]", "::1.2.3.4", "[1.2.3.4]", "fe80::1%eth0",
                 "[fe80::1%eth0]", "fe80::1%", "fe80::1%%", "fe80::1%a%b", "fe80::1%\xe9",
                 "fe80::1%a/b", "fe80::1%\r\nX: y", "[abc]", "[]", "[", "a:b", "a/b", "a@b",
                 "a b", "", "b\xfccher.example", "1.2.3.04", "[[::1]]", "2001:DB8:0:0:0:0:0:1",
                 "\ud800", "A.EXAMPLE."]:  # fmt: skip
        check_connect_request(host, 8080, None)
    # A port of 0 (and, in Python, anything above 0xFFFF, which uint16_t cannot carry).
    assert c_connect_request("example.com", 0, None) == "ValueError"
    assert c_connect_request(None, 80, None) == "ValueError"
    # Every base64 tail (the joined length mod 3), empty parts, UTF-8 and surrogates.
    for user in ["", "u", "us", "usr", "\xfc", "\U0001f600", "a:b", "\ud800"]:
        for password in ["", "p", "pa", "pas", "p\xe4:ss", "\udfff", " "]:
            check_connect_request("h", 1, (user, password))
    # pass NULL is "" (HttpOutbound passes `password or ""`).
    assert c_connect_request("h", 1, ("u", None)) == http.connect_request("h", 1, ("u", ""))


# -- sniffing -----------------------------------------------------------------------------


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def real_client_hello(server_hostname: str) -> bytes:
    """The first flight of a genuine ssl-module client: one record holding a ClientHello."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = _tls_context().wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def rerecord(flight: bytes, sizes: list[int]) -> bytes:
    """The same handshake bytes cut into records of the given sizes (the rest in one)."""
    assert flight[0] == 22
    version = flight[1:3]
    payload = flight[5 : 5 + int.from_bytes(flight[3:5], "big")]
    out, pos = b"", 0
    for size in [*sizes, len(payload)]:
        chunk = payload[pos : pos + size]
        if chunk:
            out += b"\x16" + version + len(chunk).to_bytes(2, "big") + chunk
        pos += len(chunk)
    return out


def _len(n: int, data: bytes) -> bytes:
    return len(data).to_bytes(n, "big") + data


def synthetic_client_hello(
    entries: list[tuple[int, bytes]], session: bytes, before: list[int], sni_ext: bool | None
) -> bytes:
    """A ClientHello record whose server_name list is ``entries`` (any bytes); with
    ``sni_ext`` None, one without any extensions block (SSL 3 style)."""
    exts = b"".join(t.to_bytes(2, "big") + _len(2, b"\x00" * (t % 5)) for t in before)
    if sni_ext:
        names = b"".join(bytes([t]) + _len(2, name) for t, name in entries)
        exts += b"\x00\x00" + _len(2, _len(2, names))
    exts += b"\x00\x2b" + _len(2, b"\x02\x03\x04")
    body = b"\x03\x03" + bytes(32) + _len(1, session) + _len(2, b"\x13\x01\x13\x02")
    body += _len(1, b"\x00") + (b"" if sni_ext is None else _len(2, exts))
    handshake = b"\x01" + _len(3, body)
    return b"\x16\x03\x01" + _len(2, handshake)


def synthetic_padded_hello(name: bytes, needed: int) -> bytes:
    """A handshake of exactly ``needed`` bytes (a padding extension fills it), as one
    over-long pseudo-record for rerecord() to cut."""
    short = synthetic_client_hello([(0, name)], b"", [], True)
    body = short[9:]
    pad = needed - 4 - len(body) - 4  # the padding extension's own header
    exts_at = 2 + 32 + 1 + 2 + 4 + 1 + 1
    exts = body[exts_at + 2 :] + b"\x00\x15" + _len(2, bytes(pad))
    body = body[:exts_at] + _len(2, exts)
    handshake = b"\x01" + _len(3, body)
    assert len(handshake) == needed
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


label = st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_\-]{0,20}[A-Za-z0-9_])?", fullmatch=True)
dns_names = st.builds(
    lambda labels, dot: ".".join(labels) + dot,
    st.lists(label, min_size=1, max_size=5),
    st.sampled_from(["", "", "."]),
)
_odd_sni_names = st.one_of(
    st.binary(max_size=70),
    st.text(st.sampled_from("aZ09_-.:"), max_size=70).map(str.encode),
    st.just(b"a" * 63 + b"." + b"b" * 64),
    st.integers(250, 256).map(lambda n: (b"ab." * 100)[:n]),
)
sni_names = st.integers(0, 2).flatmap(
    lambda k: _odd_sni_names if k == 0 else dns_names.map(str.encode)
)
sni_entries = st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 255]), sni_names), max_size=3)
synthetic_hellos = st.builds(
    synthetic_client_hello,
    st.integers(0, 3).flatmap(
        lambda k: sni_entries if k == 0 else st.tuples(sni_names).map(lambda n: [(0, n[0])])
    ),
    st.binary(max_size=32),
    st.lists(st.sampled_from([10, 11, 13, 16, 23, 43, 51]), max_size=3),
    st.sampled_from([True, True, True, True, False, None]),
)
record_sizes = st.lists(st.integers(1, 200), max_size=6)


@_settings(80)
@given(
    host=st.one_of(dns_names, st.sampled_from(["bücher.example", "ÉCOLE.fr", "1.2.3.4", "::1"])),
    sizes=record_sizes,
)
def test_sniff_real_client_hellos_are_read(host, sizes):
    try:
        flight = real_client_hello(host)
    except (UnicodeError, ValueError):
        return  # a name the ssl module itself refuses
    try:
        ipaddress.ip_address(host)
    except ValueError:
        sni = sniff.normalize_host(host.encode("idna").decode())
    else:
        sni = None  # ssl sends no server_name for an IP address
    for buf in (flight, rerecord(flight, sizes)):
        verdict = check_sniff(buf)
        if sni is not None:
            assert verdict == ("ok", sni), (host, buf)


@_settings(10)
@given(host=dns_names, sizes=record_sizes)
def test_sniff_every_prefix_of_a_client_hello(host, sizes):
    check_prefixes(check_sniff, rerecord(real_client_hello(host), sizes))


@_settings(300)
@given(hello=synthetic_hellos, sizes=record_sizes)
def test_sniff_synthetic_client_hellos(hello, sizes):
    check_sniff(hello)
    check_sniff(rerecord(hello, sizes))


@_settings(400)
@given(
    buf=st.one_of(
        mutated(synthetic_hellos),
        mutated(st.builds(real_client_hello, dns_names)),
        st.binary(max_size=300).map(lambda b: b"\x16" + b),
        st.binary(max_size=300).map(lambda b: b"\x16\x03\x01" + b),
    )
)
def test_sniff_mutated_tls(buf):
    check_sniff(buf)


good_host_values = st.one_of(
    st.tuples(dns_names, st.sampled_from(["", ":", ":80", ":8080", ":65535"])).map("".join),
    ipv6_texts.map(lambda t: f"[{t}]"),
    st.tuples(ipv6_texts, st.integers(0, 99999)).map(lambda t: f"[{t[0]}]:{t[1]}"),
)
host_values = st.one_of(
    st.tuples(dns_names, port_suffixes).map("".join),
    st.tuples(st.one_of(ipv6_texts, ip_garbage), port_suffixes).map(lambda t: f"[{t[0]}]{t[1]}"),
    st.text(st.characters(max_codepoint=0xFF), max_size=30),
)


@st.composite
def sniff_http_requests(draw) -> bytes:
    _mostly = _noise(draw)
    methods = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"]
    method = draw(_mostly(st.sampled_from(methods), st.sampled_from(["BREW", "get", "GETX", "G"])))
    target = draw(
        _mostly(
            st.sampled_from(["/", "/a?b", "http://x/", "*", "/\x80"]),
            st.sampled_from(["", "/ /", "/\x7f"]),
        )
    )
    version = draw(
        _mostly(
            st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
            st.sampled_from(["HTTP/2.0", "HTTP/1.1 ", "HTTP/1."]),
        )
    )
    eols = _mostly(st.sampled_from(["\r\n", "\n"]), st.sampled_from(["\r\r\n", "\n\r", "\r"]))
    lines = [f"{method} {target} {version}"]
    lines += draw(st.lists(_mostly(st.just("X-A: b"), latin1_values), max_size=3))
    if draw(st.integers(0, 4)):
        host_name = draw(
            _mostly(
                st.sampled_from(["Host", "host", "HOST"]),
                st.sampled_from(["Host ", " Host", "Hostx"]),
            )
        )
        ows = draw(st.sampled_from(["", " ", "\t ", "  "]))
        lines.append(f"{host_name}:{ows}{draw(_mostly(good_host_values, host_values))}{ows}")
    lines += draw(st.lists(latin1_values, max_size=2))
    raw = "".join(line + draw(eols) for line in lines) + draw(st.sampled_from(["", "\r\n"]))
    return raw.encode("latin-1")


@_settings(300)
@given(req=sniff_http_requests(), trailer=st.binary(max_size=8))
def test_sniff_http(req, trailer):
    check_sniff(req)
    check_sniff(req + trailer)


@_settings(60)
@given(req=sniff_http_requests())
def test_sniff_http_every_prefix(req):
    check_prefixes(check_sniff, req)


@_settings(400)
@given(buf=st.one_of(mutated(sniff_http_requests()), st.binary(max_size=100)))
def test_sniff_mutated_http_and_random(buf):
    check_sniff(buf)


def test_sniff_limits():
    """SNIFF_LIMIT on both paths, and a ClientHello cut into many tiny records."""
    limit = sniff.SNIFF_LIMIT
    get = b"GET / HTTP/1.1\r\n"
    for n in (limit - 1, limit, limit + 1, limit + 100):
        check_sniff(get + b"X-Pad: " + b"p" * n)
        check_sniff((get + b"X: y\r\n" * (n // 6))[:n] + b"\r\nHost: late.example\r\n")
        check_sniff(b"\x16\x03\x01\x40\x00" + bytes(n))
    hello = real_client_hello("tiny.records.example")
    tiny = rerecord(hello, [1] * 600)
    assert check_sniff(tiny) == ("ok", "tiny.records.example")
    assert check_sniff(synthetic_client_hello([(0, b"a.example")], b"", [], None)) == (
        "error",
        None,
    )
    big = synthetic_client_hello([(0, b"big.example")], b"", [21] * 4000, True)
    check_sniff(big)
    # A declared ClientHello length right at SNIFF_LIMIT: read, or refused as soon as known.
    for needed in (limit - 1, limit, limit + 1):
        announce = b"\x01" + (needed - 4).to_bytes(3, "big")
        assert check_sniff(b"\x16\x03\x01\x00\x04" + announce) == (
            NEED if needed <= limit else ("error", None)
        )
        hello = synthetic_padded_hello(b"edge.example", needed)
        expected = ("ok", "edge.example") if needed <= limit else ("error", None)
        assert check_sniff(rerecord(hello, [16384])) == expected
    check_prefixes(check_sniff, rerecord(hello, [3] * 40)[:400])


def test_sniff_ipv6_host_forms():
    for value in ["[::1]", "[::1]:80", "[::ffff:1.2.3.4]", "[::1.2.3.4]", "[1:2:3:4:5:6:7::]",
                  "[::1:2:3:4:5:6:7]", "[1::2:3:4:5:6:7:8]", "[fe80::1%eth0]", "[::01.2.3.4]",
                  "[1:2:3:4:5:6:1.2.3.4]", "[::256.1.1.1]", "[:1::]", "[1:::2]", "[00000::]",
                  "[::]:", "[::]:123456", "[::1]x", "[]", "[::"]:  # fmt: skip
        check_sniff(f"GET / HTTP/1.1\r\nHost: {value}\r\n".encode())
