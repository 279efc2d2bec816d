"""sw_parse_http_forward against the Python path it is to stand for.

For every input the C parser gives SW_PARSE_DEFER (always allowed: Python's path then
answers, its 400s included), SW_PARSE_NEED_MORE only where ``http.parse_request_head``
wants more too, or SW_PARSE_OK with exactly what Python makes of the head:
``parse_request_head`` + ``inbound.forward_request`` (no body, no Upgrade) and the
bytes ``http.origin_request(head, path, host_header, connection="")`` sends the
origin (what actors/http_forward.py sends for an HTTP/1.1 request), the host, port,
the client's keep-alive and whether the method is HEAD. Never SW_PARSE_ERROR.

The strategies and helpers are test_parse_diff.py's (the CONNECT parser's contract is
the same shape); ASan runs hand C exact-size copies the same way.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spliceway.flows.inbound import forward_request
from spliceway.protocols import NEED_MORE, ProtocolError, http, http_message
from tests.csrc.test_parse_diff import (
    _STATUS,
    DEFER,
    NEED,
    _c_string,
    _settings,
    exact,
    ffi,
    latin1_values,
    lib,
    mutated,
    note,
    reg_names,
    tokens,
)

_WIRE_CAP = 1 << 17


def c_forward(buf: bytes, cap: int = _WIRE_CAP):
    out = ffi.new("sw_http_forward *")
    wire = ffi.new("uint8_t[]", max(cap, 1))
    with exact(buf) as p:
        status = _STATUS[lib.sw_parse_http_forward(p, len(buf), out, wire, cap)]
    assert status != "error", "C never answers an HTTP error itself"
    if status != "ok":
        return (status,)
    assert 0 < out.consumed <= len(buf) and out.wire_len <= cap
    host = _c_string(out.host, out.host_len).decode("ascii")
    return (
        "ok",
        out.consumed,
        host,
        out.port,
        bool(out.keep_alive),
        bool(out.head),
        bytes(ffi.buffer(wire, out.wire_len)),
    )


def py_forward(buf: bytes):
    """What the http inbound (no users) and actors/http_forward.py make of ``buf``."""
    try:
        head = http.parse_request_head(buf)
        if head is NEED_MORE:
            return NEED
        if head.method.upper() == "CONNECT":
            return ("connect",)
        request = forward_request(head)
    except ProtocolError as exc:
        return ("error", exc.reply)
    if request.body_kind != http_message.NONE or request.upgrade:
        return ("body or upgrade",)
    # _exchange's choice of our hop's Connection field.
    connection = "keep-alive" if head.version == "HTTP/1.0" and request.keep_alive else ""
    wire = http.origin_request(head, request.path, request.host_header, connection=connection)
    return (
        "ok",
        head.consumed,
        request.host,
        request.port,
        request.keep_alive,
        head.method.upper() == "HEAD",
        wire,
    )


def check_forward(buf: bytes):
    """Python's verdict or DEFER; returns C's."""
    c = c_forward(buf)
    py = py_forward(buf)
    if c != DEFER:
        assert c == py, buf
    note(f"forward: C {c[0]}, Python {py[0]}")
    return c


# -- strategies --------------------------------------------------------------------------

_METHODS = ["GET", "HEAD", "DELETE", "OPTIONS", "PURGE"]
_NAMES = ["Host", "host", "User-Agent", "Accept", "X-A", "x-a", "Connection", "connection",
          "Proxy-Connection", "Keep-Alive", "TE", "Proxy-Authorization", "Upgrade",
          "Content-Length", "Transfer-Encoding", "Expect"]  # fmt: skip
_TOKEN_WORDS = ["close", "Close", "keep-alive", "Keep-Alive", "x-a", "X-A", "te", "host",
                "accept", "upgrade", "", " "]  # fmt: skip
path_chars = st.text(
    st.one_of(
        st.sampled_from("/?#&=%:;@!$'()*+,-._~abcXYZ019"),
        st.characters(min_codepoint=0x80, max_codepoint=0xFF),
    ),
    max_size=20,
)
token_lists = st.lists(st.sampled_from(_TOKEN_WORDS), min_size=1, max_size=4).flatmap(
    lambda words: st.sampled_from([",", ", ", " ,\t"]).map(lambda sep: sep.join(words))
)
plain_values = latin1_values.map(
    lambda v: "".join(c for c in v if (c >= " " and c != "\x7f") or c == "\t")
)


def _pick(noisy: bool, good: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """Half the heads are valid throughout; in the rest each piece is off one time in four."""
    return st.integers(0, 3).flatmap(lambda k: odd if k == 0 else good) if noisy else good


@st.composite
def forward_heads(draw) -> bytes:
    """Plausible absolute-URI request heads: valid, or with a few pieces slightly off."""
    noisy = draw(st.booleans())
    lead = draw(st.sampled_from(["", "", "", "\r\n", "\n"]))
    method = draw(
        _pick(
            noisy,
            st.sampled_from(_METHODS),
            st.one_of(tokens, st.sampled_from(["get", "CONNECT", "connect", "G ET", ""])),
        )
    )
    scheme = draw(_pick(noisy, st.just("http"), st.sampled_from(["HTTP", "https", "ftp", "h"])))
    host = draw(
        _pick(
            noisy,
            reg_names,
            st.sampled_from(["", "[::1]", "u@h", "h h", "[::1", "a%2e", "xn--h.example"]),
        )
    )
    port = draw(
        _pick(
            noisy,
            st.one_of(st.just(""), st.integers(1, 0xFFFF).map(lambda p: f":{p}")),
            st.sampled_from([":", ":0", ":65536", ":080", ":8a", "::80", ":123456"]),
        )
    )
    path = draw(st.one_of(st.just(""), path_chars))
    if path and draw(st.booleans()):
        path = "/" + path
    version = draw(
        _pick(
            noisy,
            st.just("HTTP/1.1"),
            st.sampled_from(["HTTP/1.0", "HTTP/1.9", "HTTP/2.0", "http/1.1", "HTTP/1.1 "]),
        )
    )
    eol = draw(
        _pick(noisy, st.sampled_from(["\r\n", "\n"]), st.sampled_from(["\r", "\n\r", "\r\r\n"]))
    )
    fields = []
    for _ in range(draw(st.integers(0, 7))):
        name = draw(_pick(noisy, st.sampled_from(_NAMES), st.one_of(tokens, st.just("Bad Name"))))
        sep = draw(_pick(noisy, st.sampled_from([": ", ":", ":\t"]), st.sampled_from([" : ", ""])))
        if name.lower() in ("connection", "proxy-connection"):
            value = draw(token_lists)
        else:
            value = draw(_pick(noisy, plain_values, latin1_values))
        ows = draw(st.sampled_from(["", "", " ", "\t "]))
        fields.append(f"{name}{sep}{value}{ows}")
    line = f"{method} {scheme}://{host}{port}{path} {version}"
    text = lead + line + eol + "".join(f + eol for f in fields) + eol
    return text.encode("latin-1")


@st.composite
def good_forward_heads(draw) -> bytes:
    """Heads within C's subset (it must never defer them)."""
    host = draw(reg_names)
    port = draw(st.one_of(st.just(""), st.integers(1, 0xFFFF).map(lambda p: f":{p}")))
    # After the authority comes one of "/?#" or the end (else it is part of the host).
    path = draw(st.one_of(st.just(""), st.tuples(st.sampled_from("/?#"), path_chars).map("".join)))
    eol = draw(st.sampled_from(["\r\n", "\n"]))
    fields = []
    names = st.sampled_from(["Host", "User-Agent", "Accept", "X-A", "Keep-Alive", "TE",
                             "Connection", "Proxy-Connection", "Proxy-Authorization"])  # fmt: skip
    hosts = 0
    for _ in range(draw(st.integers(0, 6))):
        name = draw(names)
        if name == "Host":
            hosts += 1
            if hosts > 1:
                continue
        if name in ("Connection", "Proxy-Connection"):
            value = draw(token_lists)
        else:
            value = draw(plain_values)
        fields.append(f"{name}: {value}")
    method = draw(st.sampled_from(_METHODS))
    lead = draw(st.sampled_from(["", "\r\n"]))
    text = f"{lead}{method} http://{host}{port}{path} HTTP/1.1{eol}"
    text += "".join(f + eol for f in fields) + eol
    return text.encode("latin-1")


# -- the contract ------------------------------------------------------------------------


@_settings(300)
@given(head=good_forward_heads(), trailer=st.binary(max_size=16))
def test_good_heads_are_forwarded_exactly_and_never_deferred(head, trailer):
    py = py_forward(head)
    assert py[0] == "ok", py
    assert c_forward(head) == py
    assert c_forward(head + trailer) == py
    for cut in range(len(head)):
        assert c_forward(head[:cut]) == NEED, head[:cut]


@_settings(400)
@given(head=forward_heads(), trailer=st.binary(max_size=8))
def test_plausible_heads(head, trailer):
    check_forward(head)
    check_forward(head + trailer)


@_settings(80)
@given(head=forward_heads())
def test_every_prefix(head):
    for cut in range(len(head) + 1):
        check_forward(head[:cut])


@_settings(400)
@given(buf=st.one_of(mutated(forward_heads()), mutated(good_forward_heads())))
def test_mutated(buf):
    check_forward(buf)


@_settings(200)
@given(
    buf=st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=60).map(lambda b: b"GET http://" + b),
        st.text(st.sampled_from("GETHAD htp:/[]1\r\n\tP.ab:?#"), max_size=60).map(str.encode),
    )
)
def test_random_bytes(buf):
    check_forward(buf)


def test_known_heads():
    """Hand-picked cases: the rewrite's corners and what C leaves to Python."""
    ok = [
        # The Host from the target replaces the client's in place; Connection and what it
        # names go, so do Proxy-Connection, Keep-Alive, TE, Proxy-Authorization.
        b"GET http://Example.COM:8080/a?b#frag HTTP/1.1\r\nX-B: 1\r\nHost: x\r\n"
        b"Connection: close, X-B\r\nProxy-Connection: keep-alive\r\nKeep-Alive: 5\r\n"
        b"TE: trailers\r\nProxy-Authorization: Basic eDp5\r\nAccept:  */* \t\r\n\r\n",
        # No Host: one goes second; port 80 is not written; an empty path is "/".
        b"HEAD http://h:80 HTTP/1.1\r\n\r\n",
        b"GET http://h?q HTTP/1.1\r\n\r\n",
        b"GET http://h:/#x HTTP/1.1\n\n",
        b"\r\nDELETE HTTP://h/%7e HTTP/1.1\r\nConnection: host\r\nHost: a\r\n\r\n",
    ]
    for head in ok:
        assert check_forward(head)[0] == "ok", head
    verdict = c_forward(ok[0])
    assert verdict[1:6] == (len(ok[0]), "example.com", 8080, False, False)
    assert verdict[6] == (b"GET /a?b HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\n\r\n")
    assert c_forward(ok[1])[6] == b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n"
    assert c_forward(ok[2])[6] == b"GET /?q HTTP/1.1\r\nHost: h\r\n\r\n"
    deferred = [
        b"CONNECT h:1 HTTP/1.1\r\n\r\n",
        b"get http://h/ HTTP/1.1\r\n\r\n",  # Python accepts it; C only upper case
        b"GET http://h/ HTTP/1.0\r\n\r\n",
        b"GET https://h/ HTTP/1.1\r\n\r\n",
        b"GET http://[::1]:80/ HTTP/1.1\r\n\r\n",
        b"GET http://u@h/ HTTP/1.1\r\n\r\n",
        b"GET http://h:0/ HTTP/1.1\r\n\r\n",
        b"GET http:///x HTTP/1.1\r\n\r\n",
        b"POST http://h/ HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
        b"GET http://h/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET http://h/ HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        b"GET http://h/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET http://h/ HTTP/1.1\r\nX: a\r\n b\r\n\r\n",  # obs-fold: Python's 400
        b"GET http://h/ HTTP/1.1\r\nConnection: " + b",".join([b"a"] * 17) + b"\r\n\r\n",
        b"GET http://h/ HTTP/1.1\r\n" + b"X: 1\r\n" * 65 + b"\r\n",
    ]
    for head in deferred:
        assert check_forward(head) == DEFER, head


@pytest.mark.parametrize("cap", [0, 1, 20, 33])
def test_a_wire_buffer_too_small_defers(cap):
    head = b"GET http://h/x HTTP/1.1\r\nA: b\r\n\r\n"
    wire = b"GET /x HTTP/1.1\r\nHost: h\r\nA: b\r\n\r\n"
    assert len(wire) == 34  # every cap below it defers
    assert c_forward(head, cap) == DEFER
    assert c_forward(head, len(wire))[6] == wire


def test_head_size_bound():
    """NEED_MORE only under http.MAX_HEAD_SIZE, as Python; past it, DEFER."""
    start = b"GET http://a.example/ HTTP/1.1\r\n"
    long_head = start + (b"X-Pad: " + b"p" * 1000 + b"\r\n") * 70
    for cut in (http.MAX_HEAD_SIZE - 1, http.MAX_HEAD_SIZE, http.MAX_HEAD_SIZE + 1):
        verdict = check_forward(long_head[:cut])
        assert verdict == (NEED if cut < http.MAX_HEAD_SIZE else DEFER)


# -- the response to a forwarded request ---------------------------------------------------


def c_response(buf: bytes, head_request: bool, close: bool, cap: int = _WIRE_CAP):
    out = ffi.new("sw_http_fwd_response *")
    wire = ffi.new("uint8_t[]", max(cap, 1))
    with exact(buf) as p:
        status = _STATUS[
            lib.sw_parse_http_fwd_response(p, len(buf), head_request, close, out, wire, cap)
        ]
    assert status != "error", "C never answers an HTTP error itself"
    if status != "ok":
        return (status,)
    assert 0 < out.consumed <= len(buf) and out.wire_len <= cap
    return ("ok", out.consumed, out.status, out.length, bytes(ffi.buffer(wire, out.wire_len)))


def py_response(buf: bytes, head_request: bool, close: bool):
    """What actors/http_upstream.py's _download makes of ``buf`` for a bodiless HTTP/1.1
    request whose client keeps its connection unless ``close``."""
    try:
        response = http.parse_response_head(buf)
        if response is NEED_MORE:
            return NEED
        if response.status < 200:
            return ("interim",)
        kind, length = http_message.response_framing(response, "HEAD" if head_request else "GET")
    except ProtocolError as exc:
        return ("error", str(exc))
    tokens = http_message.connection_tokens(response.headers, "Connection")
    closes = close or "close" in tokens or kind == http_message.CLOSE
    wire = http.proxy_response(response, "close" if closes else None)
    if kind == http_message.CHUNKED or kind == http_message.CLOSE:
        return ("other framing", kind)
    return ("ok", response.consumed, response.status, length, wire)


def check_response(buf: bytes, head_request: bool, close: bool):
    c = c_response(buf, head_request, close)
    py = py_response(buf, head_request, close)
    if c != DEFER:
        assert c == py, (buf, head_request, close)
    note(f"response: C {c[0]}, Python {py[0]}")
    return c


_RESPONSE_NAMES = ["Content-Length", "content-length", "Date", "Server", "X-A", "ETag",
                   "Connection", "Keep-Alive", "Proxy-Connection", "Upgrade",
                   "Transfer-Encoding", "Content-Type"]  # fmt: skip
length_values = st.one_of(
    st.integers(0, 10**6).map(str),
    st.sampled_from(["5, 5", "5,5", "5, 6", "05", "", "-1", "1e3", " 7 ", "99999999999999999999"]),
)


@st.composite
def response_heads(draw) -> bytes:
    """Plausible response heads: valid, or with a few pieces slightly off."""
    noisy = draw(st.booleans())
    version = draw(
        _pick(noisy, st.just("HTTP/1.1"), st.sampled_from(["HTTP/1.0", "HTTP/2.0", "HTTP/1.x"]))
    )
    status = draw(
        _pick(
            noisy,
            st.sampled_from(["200", "204", "304", "404", "500", "299", "999"]),
            st.sampled_from(["100", "101", "103", "20", "2000", "abc", "099"]),
        )
    )
    reason = draw(st.sampled_from(["", " OK", " Not Found", " ", "  two  spaces", " r\xe9"]))
    eol = draw(_pick(noisy, st.sampled_from(["\r\n", "\n"]), st.sampled_from(["\r", "\n\r"])))
    fields = []
    for _ in range(draw(st.integers(0, 6))):
        name = draw(
            _pick(noisy, st.sampled_from(_RESPONSE_NAMES), st.one_of(tokens, st.just("B N")))
        )
        if name.lower() == "content-length":
            value = draw(length_values)
        elif name.lower() == "connection":
            value = draw(token_lists)
        else:
            value = draw(_pick(noisy, plain_values, latin1_values))
        ows = draw(st.sampled_from(["", " ", "\t"]))
        fold = draw(_pick(noisy, st.just(""), st.just(f"{eol} folded")))
        fields.append(f"{name}:{ows}{value}{ows}{fold}")
    text = f"{version} {status}{reason}{eol}" + "".join(f + eol for f in fields) + eol
    return text.encode("latin-1")


@st.composite
def good_response_heads(draw) -> tuple[bytes, bool]:
    """Heads within C's subset, and whether the request was HEAD."""
    status = draw(st.sampled_from([200, 201, 204, 206, 304, 404, 503, 999]))
    head_request = draw(st.booleans())
    reason = draw(st.sampled_from(["", " OK", " Whatever it is"]))
    eol = draw(st.sampled_from(["\r\n", "\n"]))
    fields = [
        f"{n}: {draw(plain_values)}"
        for n in draw(st.lists(st.sampled_from(["Date", "Server", "X-A", "ETag"]), max_size=4))
    ]
    if not head_request and status not in (204, 304):
        length = draw(st.integers(0, 10**9))
        fields.insert(draw(st.integers(0, len(fields))), f"Content-Length: {length}")
    head = f"HTTP/1.1 {status}{reason}{eol}" + "".join(f + eol for f in fields) + eol
    return head.encode("latin-1"), head_request


@_settings(300)
@given(good=good_response_heads(), close=st.booleans(), body=st.binary(max_size=16))
def test_good_responses_are_taken_exactly_and_never_deferred(good, close, body):
    head, head_request = good
    py = py_response(head, head_request, close)
    assert py[0] == "ok", py
    assert c_response(head, head_request, close) == py
    assert c_response(head + body, head_request, close) == py
    for cut in range(len(head)):
        assert c_response(head[:cut], head_request, close) == NEED, head[:cut]


@_settings(400)
@given(
    head=response_heads(),
    head_request=st.booleans(),
    close=st.booleans(),
    trailer=st.binary(max_size=8),
)
def test_plausible_responses(head, head_request, close, trailer):
    check_response(head, head_request, close)
    check_response(head + trailer, head_request, close)


@_settings(60)
@given(head=response_heads(), head_request=st.booleans(), close=st.booleans())
def test_every_response_prefix(head, head_request, close):
    for cut in range(len(head) + 1):
        check_response(head[:cut], head_request, close)


@_settings(300)
@given(
    buf=st.one_of(
        mutated(response_heads()),
        mutated(good_response_heads().map(lambda g: g[0])),
        st.binary(max_size=120),
    ),
    head_request=st.booleans(),
    close=st.booleans(),
)
def test_mutated_and_random_responses(buf, head_request, close):
    check_response(buf, head_request, close)


def test_known_responses():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nDate:  x \r\n\r\nhello"
    assert check_response(ok, False, False) == (
        "ok",
        len(ok) - 5,
        200,
        5,
        b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nDate: x\r\n\r\n",
    )
    assert check_response(ok, False, True)[4].endswith(b"Connection: close\r\n\r\n")
    # No reason keeps its space; HEAD and 304 have no body whatever Content-Length says.
    assert check_response(b"HTTP/1.1 204\n\n", False, False)[4] == b"HTTP/1.1 204 \r\n\r\n"
    assert check_response(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", True, False)[3] == 0
    deferred = [
        b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",  # read to the close
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nKeep-Alive: timeout=5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n",  # Python's 502
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nX: a\r\n folded\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1234567890123456789\r\n\r\n",
        b"HTTX/1.1 200 OK\r\n\r\n",
    ]
    for head in deferred:
        assert check_response(head, False, False) == DEFER, head
