"""The DNS server's checks before any parse (spliceway.dns.server.screen), the responder's
header-only refusals, and the per-source rate limit (ClientRateLimit), without sockets."""

from __future__ import annotations

import asyncio
import struct
import threading

import dns.edns
import dns.message
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.dns.ratelimit import RATE_BURST_SECONDS
from spliceway.dns.resolver import Answer
from spliceway.dns.server import (
    ACCEPTED,
    MAX_QUERY_BYTES,
    SLOW,
    ClientRateLimit,
    DnsResponder,
    _fast_key,
    screen,
)
from tests.dns.test_server import mutated, queries

_HEADER = struct.Struct(">HHHHHH")
QUESTION = b"\x01a\x04test\x00\x00\x01\x00\x01"


def header(flags: int = 0x0100, qd: int = 1, an: int = 0, ns: int = 0, ar: int = 0) -> bytes:
    return _HEADER.pack(0x4242, flags, qd, an, ns, ar)


def formerr(flags: int = 0x0100) -> bytes:
    return _HEADER.pack(0x4242, 0x8080 | (flags & 0x7900) | 1, 0, 0, 0, 0)


def test_a_plain_query_is_accepted():
    assert screen(dns.message.make_query("a.test", "A").to_wire()) is ACCEPTED
    assert screen(dns.message.make_query("a.test", "A", use_edns=0).to_wire()) is ACCEPTED


def test_refusals_are_the_header_alone():
    # Question counts other than one, records that have no place in a query, too long.
    for data in (
        header(qd=0),
        header(qd=2) + QUESTION * 2,
        header(qd=10_831) + QUESTION,
        header(an=1) + QUESTION,
        header(ns=1) + QUESTION,
        header(ar=2) + QUESTION,
        header() + QUESTION + b"\0" * (MAX_QUERY_BYTES - 12 - len(QUESTION) + 1),
    ):
        assert screen(data) == (formerr(), 1), data[:12]
    # RD clear is copied as clear; the ID always.
    assert screen(header(flags=0, qd=3)) == (formerr(0), 1)
    # Another opcode (NOTIFY, UPDATE): NOTIMP, the opcode copied.
    assert screen(header(flags=0x2100)) == (_HEADER.pack(0x4242, 0xA184, 0, 0, 0, 0), 4)
    assert screen(header(flags=0x2800, qd=1, ns=3)) == (_HEADER.pack(0x4242, 0xA884, 0, 0, 0, 0), 4)
    # A response, a short message: dropped.
    assert screen(header(flags=0x8180)) == (None, 0)
    assert screen(b"\x42\x42\x01\x00") == (None, 0)
    # Exactly the largest length is still parsed (one padding option fills it).
    room = MAX_QUERY_BYTES - 12 - len(QUESTION) - 11 - 4
    longest = header(ar=1) + QUESTION + opt(struct.pack(">HH", 12, room) + b"\0" * room)
    assert len(longest) == MAX_QUERY_BYTES and screen(longest) is ACCEPTED


def opt(options: bytes) -> bytes:
    """An EDNS(0) OPT record (root owner, 1232-byte payload) holding ``options``."""
    return b"\0" + struct.pack(">HHIH", 41, 1232, 0, len(options)) + options


def test_the_one_additional_record_must_be_a_plain_opt():
    cookie = struct.pack(">HH", 10, 8) + b"c" * 8
    assert screen(header(ar=1) + QUESTION + opt(b"")) is ACCEPTED
    assert screen(header(ar=1) + QUESTION + opt(cookie * 8)) is ACCEPTED
    # What dnspython would take milliseconds to parse, in a few hundred bytes.
    txt = b"\0" + struct.pack(">HHIH", 16, 1, 0, 900) + b"\0" * 900
    for data in (
        header(ar=1) + QUESTION + opt(cookie * 9),  # more than MAX_EDNS_OPTIONS
        header(ar=1) + QUESTION + opt(struct.pack(">HH", 65001, 0) * 290),
        header(ar=1) + QUESTION + txt,  # not an OPT
        header(ar=1) + QUESTION + b"\x01x" + opt(b"")[1:],  # an owner name
        header(ar=1) + QUESTION + opt(cookie)[:-1],  # cut short
        header(ar=1) + QUESTION + opt(cookie) + b"\0",  # trailing bytes
        header(ar=1) + QUESTION + opt(struct.pack(">HH", 10, 9) + b"c" * 8),  # overrun
        header(ar=1) + b"\x05ab",  # the question runs out
    ):
        assert screen(data) == (formerr(), 1), data
    # Wrapped in a name that is a compression pointer, still walked.
    pointed = header(ar=1) + b"\xc0\x0c\x00\x01\x00\x01" + opt(cookie)
    assert screen(pointed) is ACCEPTED


@st.composite
def with_options(draw: st.DrawFn) -> bytes:
    """A query with 0-12 EDNS options of random codes and lengths."""
    options = [
        dns.edns.GenericOption(draw(st.integers(0, 65535)), draw(st.binary(max_size=40)))
        for _ in range(draw(st.integers(0, 12)))
    ]
    q = dns.message.make_query("a.test", "A", use_edns=0, options=options)
    return q.to_wire()


@settings(max_examples=400, deadline=None)
@given(data=st.one_of(queries(), mutated(), with_options()), tcp=st.booleans())
def test_what_the_wire_cache_may_answer_passes_the_screen(data, tcp):
    # quick() skips screen() for what _fast_key takes: it must be a subset.
    if _fast_key(data, tcp) is not None and len(data) <= MAX_QUERY_BYTES:
        assert screen(data) is ACCEPTED


@settings(max_examples=500, deadline=None)
@given(data=st.binary(min_size=12, max_size=80))
def test_any_refusal_is_twelve_bytes_and_names_the_query(data):
    judged = screen(data)
    if judged is ACCEPTED:
        return
    reply, _ = judged
    if reply is None:
        assert data[2] & 0x80
        return
    assert len(reply) == 12 and reply[:2] == data[:2] and reply[2] & 0x80
    assert reply[4:] == b"\0" * 8


def test_the_responder_answers_refusals_without_parsing_and_counts_them():
    responder = DnsResponder(lambda: None, lambda: None)  # type: ignore[arg-type,return-value]
    loop = asyncio.new_event_loop()
    try:
        big = header(qd=100) + QUESTION + struct.pack(">HHH", 0xC00C, 1, 1) * 99
        assert loop.run_until_complete(responder.respond(big, False)) == formerr()
        # A response: the fast path leaves it to respond(), which drops it.
        assert responder.quick(header(flags=0x8100), True) is SLOW
        assert loop.run_until_complete(responder.respond(header(flags=0x8100), True)) is None
        assert responder.quick(header(flags=0x2100), True) == screen(header(flags=0x2100))[0]
    finally:
        loop.close()
    c = responder.counters.snapshot()
    assert (c["formerr"], c["dropped"], c["notimp"], c["servfail"]) == (1, 1, 1, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_limit_is_a_bucket_per_source():
    clock = Clock()
    limit = ClientRateLimit(10, clock=clock)
    burst = 10 * RATE_BURST_SECONDS
    assert [limit.allow("a") for _ in range(burst + 5)].count(True) == burst
    assert limit.allow("b")  # its own bucket
    clock.now += 0.5  # five more tokens
    assert [limit.allow("a") for _ in range(10)].count(True) == 5
    clock.now += 60  # full again, never above the burst
    assert [limit.allow("a") for _ in range(burst * 2)].count(True) == burst
    # A costly query takes more; one the bucket cannot pay takes nothing.
    clock.now += 60
    assert [limit.allow("c", 9) for _ in range(3)] == [True, True, False]
    assert limit.allow("c", 2) and not limit.allow("c")


def test_the_rate_limit_forgets_the_least_recently_seen_source_and_can_be_changed():
    clock = Clock()
    limit = ClientRateLimit(1, max_sources=3, clock=clock)
    for source in ("a", "b", "c"):
        assert limit.allow(source) and limit.allow(source)
        assert not limit.allow(source)
    assert limit.allow("d") and len(limit) == 3  # "a" forgotten
    assert limit.allow("a")  # a full bucket again
    assert not limit.allow("c")  # still followed
    limit.configure(None)
    assert limit.rate is None and all(limit.allow("c") for _ in range(100))
    limit.configure(1000)
    assert limit.rate == 1000


class SlowResolver:
    """Answers every name after 50 ms (so two loops' queries overlap); no network."""

    cache = None

    def __init__(self) -> None:
        self.upstreams: list[tuple[str, str, int]] = []
        self.asked = 0

    async def resolve_answer(self, host: str, timeout: float = 5.0) -> Answer:
        self.asked += 1
        await asyncio.sleep(0.05)
        return Answer(("10.0.0.7",), 60)


def test_one_responder_answers_from_two_loops_at_once():
    """The DNS server's thread and the dispatcher's (a TUN's dns_hijack) share one
    responder: a name being resolved on one loop is resolved again on the other, never
    awaited across loops."""
    resolver = SlowResolver()
    responder = DnsResponder(lambda: resolver, lambda: None)  # type: ignore[arg-type,return-value]
    wire = dns.message.make_query("same.test", "A").to_wire()
    answers: list[bytes | None] = []
    start = threading.Barrier(2)

    def run() -> None:
        async def ask() -> list[bytes | None]:
            return list(await asyncio.gather(*(responder.respond(wire, False) for _ in range(5))))

        start.wait(5)
        answers.extend(asyncio.run(ask()))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(answers) == 10
    for reply in answers:
        assert reply is not None
        msg = dns.message.from_wire(reply)
        assert msg.rcode() == 0 and msg.answer[0][0].address == "10.0.0.7"
    assert resolver.asked == 2  # one resolution per loop, shared by its five queries
    assert responder.counters.snapshot()["servfail"] == 0
