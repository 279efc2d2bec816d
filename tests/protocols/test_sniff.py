"""Sniffing: real ClientHellos from the stdlib ssl module, crafted edge cases, fuzzing."""

from __future__ import annotations

import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.protocols import NEED_MORE
from spliceway.protocols.sniff import SNIFF_LIMIT, Sniffed, normalize_host, sniff

FUZZ = settings.get_profile("protocols")


def real_client_hello(server_hostname: str | None, tls12_only: bool = False) -> bytes:
    """The bytes OpenSSL sends first, exactly as a TLS client would put them on the wire."""
    ctx = ssl.create_default_context()
    if server_hostname is None:
        ctx.check_hostname = False
    if tls12_only:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def crafted_hello(sni: bytes | None, name_type: int = 0, before: bytes = b"") -> bytes:
    """The handshake message of a minimal ClientHello with the given server_name."""
    body = b"\x03\x03" + bytes(32) + b"\x20" + bytes(32) + b"\x00\x02\x13\x01" + b"\x01\x00"
    extensions = before
    if sni is not None:
        entry = bytes([name_type]) + len(sni).to_bytes(2, "big") + sni
        names = len(entry).to_bytes(2, "big") + entry
        extensions += b"\x00\x00" + len(names).to_bytes(2, "big") + names
    body += len(extensions).to_bytes(2, "big") + extensions
    return b"\x01" + len(body).to_bytes(3, "big") + body


def records(handshake: bytes, size: int = 16384, record_type: int = 22) -> bytes:
    """Wrap a handshake message in TLS records of at most ``size`` bytes each."""
    out = b""
    for start in range(0, len(handshake), size):
        chunk = handshake[start : start + size]
        out += bytes([record_type, 3, 1]) + len(chunk).to_bytes(2, "big") + chunk
    return out


def handshake_of(client_hello_records: bytes) -> bytes:
    """Undo records() for a single-record ClientHello."""
    length = int.from_bytes(client_hello_records[3:5], "big")
    return client_hello_records[5 : 5 + length]


REAL_TLS13 = real_client_hello("example.com")
REAL_TLS12 = real_client_hello("Sub.Example.ORG", tls12_only=True)


# -- TLS ---------------------------------------------------------------------------------


# ids: the hellos' random bytes differ in every process, and pytest-xdist's workers
# must collect the same names.
@pytest.mark.parametrize(
    ("hello", "host"),
    [(REAL_TLS13, "example.com"), (REAL_TLS12, "sub.example.org")],
    ids=["tls13", "tls12"],
)
def test_real_client_hello(hello, host):
    assert sniff(hello) == Sniffed("tls", host)
    assert sniff(bytearray(hello) + b"\x17\x03\x03") == Sniffed("tls", host)


@pytest.mark.parametrize("hello", [REAL_TLS13, REAL_TLS12], ids=["tls13", "tls12"])
def test_every_prefix_of_a_client_hello_needs_more(hello):
    for cut in range(len(hello)):
        assert sniff(hello[:cut]) is NEED_MORE, cut


@pytest.mark.parametrize("size", [1, 7, 100, 256])
def test_client_hello_split_across_records(size):
    wire = records(handshake_of(REAL_TLS13), size)
    assert sniff(wire) == Sniffed("tls", "example.com")
    for cut in range(0, len(wire), 13):
        assert sniff(wire[:cut]) is NEED_MORE


def test_client_hello_without_sni():
    assert sniff(real_client_hello(None)) is None
    # OpenSSL sends no SNI for an IP address (RFC 6066 forbids it).
    assert sniff(real_client_hello("192.0.2.1")) is None
    assert sniff(records(crafted_hello(None))) is None


@pytest.mark.parametrize(
    ("sni", "expected"),
    [
        (b"WWW.Example.COM.", "www.example.com"),
        (b"xn--bcher-kva.example", "xn--bcher-kva.example"),
        (b"_dmarc.example", "_dmarc.example"),
        (b"localhost", "localhost"),
        (b"a" * 63 + b".b", "a" * 63 + ".b"),
        (b"a" * 64 + b".b", None),  # label too long
        (b"", None),
        (b".", None),
        (b"a..b", None),
        (b"-a.example", None),
        (b"exa mple.com", None),
        (b"evil.com\r\nX: y", None),
        (b"evil\x00.com", None),
        (b"b\xc3\xbccher.example", None),  # raw UTF-8: SNI must be A-labels
        (b"[::1]", None),
        (b"::1", None),
    ],
)
def test_crafted_sni(sni, expected):
    result = sniff(records(crafted_hello(sni)))
    assert result == (None if expected is None else Sniffed("tls", expected))


def test_sni_after_other_extensions_and_other_name_types():
    alpn = b"\x00\x10\x00\x05\x00\x03\x02h2"
    assert sniff(records(crafted_hello(b"a.example", before=alpn))) == Sniffed("tls", "a.example")
    # A name type other than host_name is skipped, not mistaken for a host.
    assert sniff(records(crafted_hello(b"a.example", name_type=7))) is None


@pytest.mark.parametrize(
    "wire",
    [
        records(crafted_hello(b"a.example"), record_type=23),  # application data
        b"\x16\x02\x00\x00\x05" + crafted_hello(b"a.example")[:5],  # record version 2.0
        b"\x16\x03\x01\x00\x00",  # empty record
        b"\x16\x03\x01\x40\x01" + bytes(16385),  # record over 2**14
        records(b"\x02" + crafted_hello(b"a.example")[1:]),  # ServerHello type
        records(b"\x01\x00\x00\x05\x03\x03\x00\x00\x00"),  # body too short
        records(b"\x01\xff\xff\xff"),  # claims 16 MiB: never completes, give up now
        # First record fine, second is not a handshake record.
        records(crafted_hello(b"a.example")[:10]) + b"\x17\x03\x03\x00\x01\x00",
    ],
)
def test_malformed_tls_is_none(wire):
    assert sniff(wire) is None


def test_truncated_extension_lengths_are_none():
    hello = bytearray(crafted_hello(b"a.example"))
    hello[-15] = 0xFF  # the server_name extension's length now overruns the message
    assert sniff(records(bytes(hello))) is None


def test_tls_gives_up_at_the_limit():
    # A handshake that fits in the limit but whose records do not arrive in time.
    big = crafted_hello(b"a.example", before=b"\x00\x15" + (4000).to_bytes(2, "big") + bytes(4000))
    wire = records(big, 1)  # 6 bytes per handshake byte: far past the limit
    assert sniff(wire[: SNIFF_LIMIT - 1]) is NEED_MORE
    assert sniff(wire[:SNIFF_LIMIT]) is None


# -- HTTP --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"GET / HTTP/1.1\r\nHost: Example.COM:8080\r\n\r\n", "example.com"),
        (b"GET / HTTP/1.1\nUser-Agent: x\nhost:example.com.\n\n", "example.com"),
        (b"POST /api HTTP/1.0\r\nHOST:  a.example  \r\n", "a.example"),
        (b"GET / HTTP/1.1\r\nHost: [2001:DB8::1]:443\r\n\r\n", "2001:db8::1"),
        (b"GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n", "::1"),
        (b"GET / HTTP/1.1\r\nHost: 10.0.0.1:\r\n\r\n", "10.0.0.1"),
        (b"OPTIONS * HTTP/1.1\r\nHost: a\r\n", "a"),
    ],
)
def test_http_host(buf, expected):
    assert sniff(buf) == Sniffed("http", expected)


@pytest.mark.parametrize(
    "buf",
    [
        b"GET / HTTP/1.1\r\nUser-Agent: x\r\n\r\nHost: late.example\r\n",  # not in the head
        b"GET / HTTP/1.0\r\n\r\n",
        b"FOO / HTTP/1.1\r\nHost: a\r\n\r\n",  # unknown method
        b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
        b"GET /\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: bad host\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a:port\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a:123456\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: ::1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: [::1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: [::1]x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: [fe80::1%25eth0]\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: caf\xc3\xa9.example\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost:\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"\x05\x01\x00",
        b"\x00",
    ],
)
def test_http_none(buf):
    assert sniff(buf) is None


@pytest.mark.parametrize(
    "buf",
    [
        b"",
        b"G",
        b"GE",
        b"GET",
        b"CONNEC",
        b"GET / HTTP/1.1",
        b"GET / HTTP/1.1\r\n",
        b"GET / HTTP/1.1\r\nUser-Agent: curl\r\n",
        b"GET / HTTP/1.1\r\nHost: example.co",
    ],
)
def test_http_needs_more(buf):
    assert sniff(buf) is NEED_MORE


def test_http_gives_up_at_the_limit():
    head = b"GET / HTTP/1.1\r\n" + b"X-Pad: " + b"p" * SNIFF_LIMIT
    assert sniff(head[: SNIFF_LIMIT - 1]) is NEED_MORE
    assert sniff(head) is None


# -- normalize_host ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Example.COM.", "example.com"),
        ("2001:DB8:0::1", "2001:db8::1"),
        ("a" * 63, "a" * 63),
        (".".join(["a" * 63] * 4)[:253], ".".join(["a" * 63] * 4)[:253]),
        ("a" * 254, None),
        ("example.com..", None),
        ("", None),
        ("ex*ample.com", None),
        ("ex ample.com", None),
        ("bücher.de", None),
    ],
)
def test_normalize_host(raw, expected):
    assert normalize_host(raw) == expected


# -- properties --------------------------------------------------------------------------

SEEDS = [REAL_TLS13, REAL_TLS12, b"GET / HTTP/1.1\r\nHost: a.example:80\r\n\r\n"]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    seed = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(seed)))
        seed = seed[:at] + draw(st.binary(max_size=3)) + seed[at + draw(st.integers(0, 3)) :]
    return seed


def check_sniff(buf: bytes) -> None:
    result = sniff(buf)
    assert result is NEED_MORE or result is None or isinstance(result, Sniffed)
    if isinstance(result, Sniffed):
        assert result.protocol in ("tls", "http")
        assert normalize_host(result.host) == result.host
    if result is NEED_MORE:
        assert len(buf) < SNIFF_LIMIT


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_sniff(buf):
    check_sniff(buf)


@FUZZ
@given(mutated())
def test_fuzz_sniff_mutated(buf):
    check_sniff(buf)


@FUZZ
@given(
    st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,12}){0,3}", fullmatch=True),
    st.integers(1, 300),
)
def test_crafted_hello_round_trip(host, record_size):
    wire = records(crafted_hello(host.upper().encode() + b"."), record_size)
    assert sniff(wire) == Sniffed("tls", host)
