"""SOCKS5 codec: known byte strings, fuzzing, prefix and round-trip properties.

Also covers the shared ``NEED_MORE`` / ``ProtocolError`` of ``spliceway.protocols``.
"""

from __future__ import annotations

import copy
import ipaddress
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.protocols import NEED_MORE, NeedMore, ProtocolError
from spliceway.protocols import socks5 as s5
from tests.protocols import contract
from tests.protocols.contract import check_prefixes, mutated

FUZZ = settings.get_profile("protocols")

GENERAL_FAILURE = s5.reply(s5.REP_GENERAL_FAILURE)
ATYP_UNSUPPORTED = s5.reply(s5.REP_ADDRESS_TYPE_NOT_SUPPORTED)

# Byte strings as clients and servers (curl, Firefox, Dante, ssh -D) put them on the wire.
GREETING_NO_AUTH = b"\x05\x01\x00"
GREETING_BOTH = b"\x05\x02\x00\x02"
USERPASS = b"\x01\x04user\x08pa55word"
CONNECT_V4 = b"\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x50"
CONNECT_DOMAIN = b"\x05\x01\x00\x03\x0bexample.com\x01\xbb"
CONNECT_V6 = b"\x05\x01\x00\x04" + bytes(15) + b"\x01\x1f\x90"
REPLY_OK_V4 = b"\x05\x00\x00\x01\x0a\x00\x00\x01\x04\x38"
UDP_DATAGRAM = b"\x00\x00\x00\x01\x08\x08\x08\x08\x00\x35" + b"dns query"

SERVER_PARSERS: list[Callable[[bytes], Any]] = [
    s5.parse_greeting,
    s5.parse_userpass,
    s5.parse_request,
]
CLIENT_PARSERS: list[Callable[[bytes], Any]] = [
    s5.parse_method_selection,
    s5.parse_userpass_status,
    s5.parse_reply,
]
VALID_MESSAGES: list[tuple[Callable[[bytes], Any], bytes]] = [
    (s5.parse_greeting, GREETING_NO_AUTH),
    (s5.parse_greeting, GREETING_BOTH),
    (s5.parse_greeting, b"\x05\xff" + bytes(range(255))),
    (s5.parse_userpass, USERPASS),
    (s5.parse_userpass, b"\x01\x01u\x00"),
    (s5.parse_userpass, b"\x01\x00\x00"),
    (s5.parse_request, CONNECT_V4),
    (s5.parse_request, CONNECT_DOMAIN),
    (s5.parse_request, CONNECT_V6),
    (s5.parse_request, b"\x05\x03\x00\x01\x00\x00\x00\x00\x00\x00"),
    (s5.parse_method_selection, b"\x05\x00"),
    (s5.parse_method_selection, b"\x05\xff"),
    (s5.parse_userpass_status, b"\x01\x00"),
    (s5.parse_reply, REPLY_OK_V4),
    (s5.parse_reply, b"\x05\x00\x00\x03\x09localhost\x04\x38"),
    (s5.parse_reply, b"\x05\x05\x00\x04" + bytes(16) + b"\x00\x00"),
]


def check_contract(parser: Callable[[bytes], Any], buf: bytes) -> Any:
    """The parser contract, and every strict prefix of a parsed message asks for more."""
    result = contract.check_contract(parser, buf, b"\x00\xff")
    if result is not NEED_MORE and not isinstance(result, ProtocolError):
        check_prefixes(parser, buf[: result.consumed])
    return result


# -- NEED_MORE and ProtocolError ---------------------------------------------------------


def test_need_more_is_a_singleton():
    assert NEED_MORE is NeedMore.NEED_MORE
    assert copy.deepcopy(NEED_MORE) is NEED_MORE
    assert pickle.loads(pickle.dumps(NEED_MORE)) is NEED_MORE
    assert repr(NEED_MORE) == "NEED_MORE"
    assert isinstance(NEED_MORE, NeedMore)


def test_protocol_error_carries_message_and_reply():
    exc = ProtocolError("bad", b"\x05\x01")
    assert (exc.message, exc.reply, str(exc)) == ("bad", b"\x05\x01", "bad")
    assert ProtocolError("x").reply is None
    assert "reply=" in repr(exc)


# -- server side -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x05", NEED_MORE),
        (b"\x05\x02\x00", NEED_MORE),
        (GREETING_NO_AUTH, s5.Greeting((0,), 3)),
        (GREETING_BOTH + b"\x05\x01", s5.Greeting((0, 2), 4)),
        (b"\x05\x03\x00\x01\x02", s5.Greeting((0, 1, 2), 5)),
    ],
)
def test_parse_greeting(buf, expected):
    assert s5.parse_greeting(buf) == expected


@pytest.mark.parametrize(
    ("buf", "reply"),
    [
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", None),  # a SOCKS4 CONNECT
        (b"GET / HTTP/1.1\r\n", None),
        (b"\x16\x03\x01", None),  # TLS
        (b"\x05\x00", b"\x05\xff"),  # no methods at all
    ],
)
def test_parse_greeting_rejects(buf, reply):
    with pytest.raises(ProtocolError) as info:
        s5.parse_greeting(buf)
    assert info.value.reply == reply


def test_method_selection():
    assert s5.method_selection(s5.METHOD_NO_AUTH) == b"\x05\x00"
    assert s5.method_selection(s5.METHOD_USERPASS) == b"\x05\x02"
    assert s5.method_selection(s5.METHOD_NO_ACCEPTABLE) == b"\x05\xff"
    with pytest.raises(ValueError, match="one byte"):
        s5.method_selection(256)


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x01", NEED_MORE),
        (b"\x01\x04use", NEED_MORE),
        (b"\x01\x04user", NEED_MORE),
        (b"\x01\x04user\x08pa55wor", NEED_MORE),
        (USERPASS, s5.UserPass("user", "pa55word", 15)),
        (USERPASS + b"\x05\x01\x00", s5.UserPass("user", "pa55word", 15)),
        (b"\x01\x01u\x00", s5.UserPass("u", "", 4)),  # empty password: tolerated
        (b"\x01\x02\xc3\xbc\x03\xe2\x82", NEED_MORE),
        (b"\x01\x02\xc3\xbc\x03\xe2\x82\xac", s5.UserPass("ü", "€", 8)),
    ],
)
def test_parse_userpass(buf, expected):
    assert s5.parse_userpass(buf) == expected


@pytest.mark.parametrize(
    "buf",
    [
        b"\x05\x04user\x04pass",  # SOCKS version where the sub-negotiation version goes
        b"\x00\x01u\x01p",
        b"\x01\x01\xff\x01p",  # username not UTF-8
        b"\x01\x01u\x02\xc3\x28",  # password not UTF-8
    ],
)
def test_parse_userpass_rejects(buf):
    with pytest.raises(ProtocolError) as info:
        s5.parse_userpass(buf)
    assert info.value.reply == b"\x01\x01"


def test_userpass_status():
    assert s5.userpass_status(True) == b"\x01\x00"
    assert s5.userpass_status(False) == b"\x01\x01"


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x05\x01", NEED_MORE),
        (b"\x05\x01\x00", NEED_MORE),
        (b"\x05\x01\x00\x03", NEED_MORE),
        (b"\x05\x01\x00\x03\x0bexample.co", NEED_MORE),
        (b"\x05\x01\x00\x03\x0bexample.com\x01", NEED_MORE),
        (CONNECT_V4, s5.Request(1, "127.0.0.1", 80, 1, 10)),
        (CONNECT_DOMAIN + b"GET /", s5.Request(1, "example.com", 443, 3, 18)),
        (CONNECT_V6, s5.Request(1, "::1", 8080, 4, 22)),
        (
            b"\x05\x01\x00\x04" + bytes.fromhex("20010db8000000000001000000000001") + b"\x00\x50",
            s5.Request(1, "2001:db8::1:0:0:1", 80, 4, 22),
        ),
        (
            b"\x05\x01\x00\x04" + bytes(10) + b"\xff\xff\x01\x02\x03\x04\x00\x50",
            s5.Request(1, "::ffff:1.2.3.4", 80, 4, 22),
        ),
        # Unknown commands are returned for the caller to answer COMMAND_NOT_SUPPORTED.
        (b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00", s5.Request(2, "0.0.0.0", 0, 1, 10)),
        (b"\x05\x09\x00\x01\x01\x01\x01\x01\xff\xff", s5.Request(9, "1.1.1.1", 65535, 1, 10)),
        # The reserved byte carries no meaning and is not checked.
        (b"\x05\x01\x07\x01\x7f\x00\x00\x01\x00\x50", s5.Request(1, "127.0.0.1", 80, 1, 10)),
        (
            b"\x05\x01\x00\x03\x0dxn--bcher-kva\x00\x50",
            s5.Request(1, "xn--bcher-kva", 80, 3, 20),
        ),
        (b"\x05\x01\x00\x03\x03\xc3\xbcx\x00\x50", s5.Request(1, "üx", 80, 3, 10)),
    ],
)
def test_parse_request(buf, expected):
    assert s5.parse_request(buf) == expected


@pytest.mark.parametrize(
    ("buf", "reply"),
    [
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", GENERAL_FAILURE),
        (b"\x05\x01\x00\x02", ATYP_UNSUPPORTED),
        (b"\x05\x01\x00\x00", ATYP_UNSUPPORTED),
        (b"\x05\x01\x00\x03\x00", GENERAL_FAILURE),  # empty domain, refused at once
        (b"\x05\x01\x00\x03\x02\xff\xfe\x00\x50", GENERAL_FAILURE),  # not UTF-8
        (b"\x05\x01\x00\x03\x06a\r\nb:c\x00\x50", GENERAL_FAILURE),  # header injection
        (b"\x05\x01\x00\x03\x03a\x00b\x00\x50", GENERAL_FAILURE),
        (b"\x05\x01\x00\x03\x03a b\x00\x50", GENERAL_FAILURE),
    ],
)
def test_parse_request_rejects(buf, reply):
    with pytest.raises(ProtocolError) as info:
        s5.parse_request(buf)
    assert info.value.reply == reply


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((s5.REP_SUCCEEDED,), b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"),
        ((s5.REP_GENERAL_FAILURE,), b"\x05\x01\x00\x01\x00\x00\x00\x00\x00\x00"),
        ((s5.REP_SUCCEEDED, "10.0.0.1", 1080), REPLY_OK_V4),
        ((s5.REP_SUCCEEDED, "::1", 1), b"\x05\x00\x00\x04" + bytes(15) + b"\x01\x00\x01"),
        ((s5.REP_SUCCEEDED, "[::1]", 1), b"\x05\x00\x00\x04" + bytes(15) + b"\x01\x00\x01"),
        ((s5.REP_HOST_UNREACHABLE, "proxy.lan", 80), b"\x05\x04\x00\x03\x09proxy.lan\x00\x50"),
    ],
)
def test_reply(args, expected):
    assert s5.reply(*args) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((256,), "one byte"),
        ((0, "0.0.0.0", 65536), "port"),
        ((0, "0.0.0.0", -1), "port"),
        ((0, "", 80), "1..255"),
        ((0, "a" * 256, 80), "1..255"),
        ((0, "bad\r\nhost", 80), "invalid characters"),
    ],
)
def test_reply_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        s5.reply(*args)


def test_reply_constants_match_rfc_1928():
    codes = [
        s5.REP_SUCCEEDED,
        s5.REP_GENERAL_FAILURE,
        s5.REP_NOT_ALLOWED,
        s5.REP_NETWORK_UNREACHABLE,
        s5.REP_HOST_UNREACHABLE,
        s5.REP_CONNECTION_REFUSED,
        s5.REP_TTL_EXPIRED,
        s5.REP_COMMAND_NOT_SUPPORTED,
        s5.REP_ADDRESS_TYPE_NOT_SUPPORTED,
    ]
    assert codes == list(range(9))
    assert (s5.CMD_CONNECT, s5.CMD_BIND, s5.CMD_UDP_ASSOCIATE) == (1, 2, 3)
    assert (s5.METHOD_NO_AUTH, s5.METHOD_USERPASS, s5.METHOD_NO_ACCEPTABLE) == (0, 2, 0xFF)


# -- client side -------------------------------------------------------------------------


def test_client_greeting():
    assert s5.client_greeting(False) == b"\x05\x01\x00"
    assert s5.client_greeting(True) == b"\x05\x01\x02"
    assert s5.parse_greeting(s5.client_greeting(True)) == s5.Greeting((s5.METHOD_USERPASS,), 3)


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x05", NEED_MORE),
        (b"\x05\x00", s5.MethodSelection(0, 2)),
        (b"\x05\x02\x05\x00", s5.MethodSelection(2, 2)),
        (b"\x05\xff", s5.MethodSelection(0xFF, 2)),
    ],
)
def test_parse_method_selection(buf, expected):
    assert s5.parse_method_selection(buf) == expected


@pytest.mark.parametrize("buf", [b"\x04\x5a", b"HTTP/1.1 400 Bad Request\r\n", b"\x00"])
def test_parse_method_selection_rejects(buf):
    with pytest.raises(ProtocolError) as info:
        s5.parse_method_selection(buf)
    assert info.value.reply is None


def test_client_userpass():
    assert s5.client_userpass("user", "pa55word") == USERPASS
    assert s5.client_userpass("ü", "€") == b"\x01\x02\xc3\xbc\x03\xe2\x82\xac"
    assert s5.client_userpass("u" * 255, "") == b"\x01\xff" + b"u" * 255 + b"\x00"
    with pytest.raises(ValueError, match="255"):
        s5.client_userpass("u" * 256, "p")
    with pytest.raises(ValueError, match="255"):
        s5.client_userpass("u", "ü" * 128)  # 256 bytes of UTF-8


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x01", NEED_MORE),
        (b"\x01\x00", s5.UserPassStatus(True, 2)),
        (b"\x01\x01", s5.UserPassStatus(False, 2)),
        (b"\x01\xff\x05", s5.UserPassStatus(False, 2)),
        (b"\x05\x00", s5.UserPassStatus(True, 2)),  # servers that echo the SOCKS version
    ],
)
def test_parse_userpass_status(buf, expected):
    assert s5.parse_userpass_status(buf) == expected


def test_parse_userpass_status_rejects():
    with pytest.raises(ProtocolError):
        s5.parse_userpass_status(b"\x02\x00")


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("127.0.0.1", 80, CONNECT_V4),
        ("example.com", 443, CONNECT_DOMAIN),
        ("::1", 8080, CONNECT_V6),
        ("[::1]", 8080, CONNECT_V6),
        ("bücher.de", 80, b"\x05\x01\x00\x03\x10xn--bcher-kva.de\x00\x50"),
        ("localhost", 0, b"\x05\x01\x00\x03\x09localhost\x00\x00"),
    ],
)
def test_client_connect(host, port, expected):
    assert s5.client_connect(host, port) == expected


def test_client_request_other_commands():
    assert s5.client_request(s5.CMD_UDP_ASSOCIATE, "0.0.0.0", 0) == (
        b"\x05\x03\x00\x01\x00\x00\x00\x00\x00\x00"
    )


@pytest.mark.parametrize(
    ("host", "port"), [("a" * 256, 80), ("", 80), ("x", 65536), ("a\nb", 1), ("a b", 1)]
)
def test_client_connect_rejects(host, port):
    with pytest.raises(ValueError):  # noqa: PT011 - several distinct messages
        s5.client_connect(host, port)


@pytest.mark.parametrize(
    ("buf", "expected"),
    [
        (b"", NEED_MORE),
        (b"\x05\x00\x00", NEED_MORE),
        (REPLY_OK_V4[:-1], NEED_MORE),
        (REPLY_OK_V4 + b"HTTP/1.1", s5.Reply(0, "10.0.0.1", 1080, 10)),
        (b"\x05\x00\x00\x03\x09localhost\x04\x38", s5.Reply(0, "localhost", 1080, 16)),
        (b"\x05\x05\x00\x04" + bytes(16) + b"\x00\x00", s5.Reply(5, "::", 0, 22)),
    ],
)
def test_parse_reply(buf, expected):
    assert s5.parse_reply(buf) == expected


@pytest.mark.parametrize(
    "buf", [b"\x04\x5b\x00\x00\x00\x00\x00\x00", b"\x05\x00\x00\x05", b"\x05\x00\x00\x03\x00"]
)
def test_parse_reply_rejects(buf):
    with pytest.raises(ProtocolError) as info:
        s5.parse_reply(buf)
    assert info.value.reply is None


# -- UDP ---------------------------------------------------------------------------------


def test_parse_udp_datagram():
    assert s5.parse_udp_datagram(UDP_DATAGRAM) == s5.UdpDatagram(0, "8.8.8.8", 53, b"dns query")
    assert s5.parse_udp_datagram(b"\x00\x00\x01\x03\x01a\x00\x01") == s5.UdpDatagram(1, "a", 1, b"")


@pytest.mark.parametrize(
    "data", [b"", b"\x00\x00", b"\x00\x00\x00", b"\x00\x00\x00\x01\x08\x08", b"\x00\x00\x00\x07"]
)
def test_parse_udp_datagram_rejects(data):
    with pytest.raises(ProtocolError) as info:
        s5.parse_udp_datagram(data)
    assert info.value.reply is None


def test_build_udp_datagram():
    assert s5.build_udp_datagram("8.8.8.8", 53, b"dns query") == UDP_DATAGRAM
    assert s5.build_udp_datagram("a", 1, b"", fragment=1) == b"\x00\x00\x01\x03\x01a\x00\x01"


# -- properties --------------------------------------------------------------------------

domains = st.from_regex(
    r"[a-z0-9]([a-z0-9_-]{0,20}[a-z0-9])?(\.[a-z0-9-]{1,12}){0,4}", fullmatch=True
)
hosts = st.one_of(
    domains,
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
)
ports = st.integers(0, 65535)


def same_host(sent: str, parsed: str) -> bool:
    """IP literals compare as addresses (parsers canonicalise), names as text."""
    try:
        return ipaddress.ip_address(sent) == ipaddress.ip_address(parsed)
    except ValueError:
        return sent == parsed


@pytest.mark.parametrize(("parser", "message"), VALID_MESSAGES)
def test_valid_messages_meet_the_contract(parser, message):
    result = check_contract(parser, message)
    assert not isinstance(result, ProtocolError)
    assert result is not NEED_MORE
    assert result.consumed == len(message)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(SERVER_PARSERS + CLIENT_PARSERS))
def test_fuzz_parsers(buf, parser):
    check_contract(parser, buf)


@FUZZ
@given(st.data())
def test_fuzz_mutated_messages(data):
    parser, _ = data.draw(st.sampled_from(VALID_MESSAGES))
    seeds = [m for p, m in VALID_MESSAGES if p is parser]
    check_contract(parser, data.draw(mutated(seeds)))


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_udp_datagram(data):
    try:
        datagram = s5.parse_udp_datagram(data)
    except ProtocolError:
        return
    assert data.endswith(datagram.payload)
    assert s5.build_udp_datagram(datagram.host, datagram.port, datagram.payload, datagram.fragment)


@FUZZ
@given(hosts, ports, st.sampled_from([s5.CMD_CONNECT, s5.CMD_BIND, s5.CMD_UDP_ASSOCIATE, 0x42]))
def test_client_request_round_trips_through_server_parser(host, port, command):
    wire = s5.client_request(command, host, port)
    request = check_contract(s5.parse_request, wire)
    assert request.consumed == len(wire)
    assert (request.command, request.port) == (command, port)
    assert same_host(host, request.host)
    # The canonical form is a fixed point.
    assert s5.parse_request(s5.client_request(command, request.host, port)) == request


@FUZZ
@given(hosts, ports, st.integers(0, 255))
def test_reply_round_trips_through_client_parser(host, port, code):
    wire = s5.reply(code, host, port)
    parsed = check_contract(s5.parse_reply, wire)
    assert (parsed.code, parsed.bind_port, parsed.consumed) == (code, port, len(wire))
    assert same_host(host, parsed.bind_host)


@FUZZ
@given(st.text(max_size=100), st.text(max_size=100))
def test_userpass_round_trip(username, password):
    if max(len(username.encode()), len(password.encode())) > 255:
        with pytest.raises(ValueError, match="255"):
            s5.client_userpass(username, password)
        return
    wire = s5.client_userpass(username, password)
    assert check_contract(s5.parse_userpass, wire) == s5.UserPass(username, password, len(wire))


@FUZZ
@given(st.lists(st.integers(0, 255), min_size=1, max_size=255))
def test_greeting_round_trip(methods):
    wire = bytes([5, len(methods), *methods])
    assert check_contract(s5.parse_greeting, wire) == s5.Greeting(tuple(methods), len(wire))


@FUZZ
@given(st.integers(0, 255))
def test_method_selection_round_trip(method):
    assert s5.parse_method_selection(s5.method_selection(method)) == (method, 2)


@FUZZ
@given(st.booleans())
def test_userpass_status_round_trip(ok):
    assert s5.parse_userpass_status(s5.userpass_status(ok)) == s5.UserPassStatus(ok, 2)


@FUZZ
@given(hosts, ports, st.binary(max_size=64), st.integers(0, 255))
def test_udp_round_trip(host, port, payload, fragment):
    datagram = s5.parse_udp_datagram(s5.build_udp_datagram(host, port, payload, fragment))
    assert (datagram.fragment, datagram.port, datagram.payload) == (fragment, port, payload)
    assert same_host(host, datagram.host)
