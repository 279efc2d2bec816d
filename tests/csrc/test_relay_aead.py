"""The C relay's Shadowsocks AEAD copy path (Relay.add_aead), on real sockets.

The "server" end of each flow is emulated with the Python codec
(spliceway.protocols.shadowsocks), which is independent of the C code: it opens
what the relay seals and seals what the relay must open.  One test runs Debian's
ss-server instead.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import random
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pykka
import pytest

from spliceway.native.relay import Cause, Completion, RelayError
from spliceway.protocols.shadowsocks import (
    CIPHERS,
    MAX_PAYLOAD,
    TAG_SIZE,
    Decryptor,
    Encryptor,
    master_key,
    target_header,
)
from tests.conftest import wait_until
from tests.csrc import test_relay as base
from tests.csrc.test_relay import (
    Env,
    Link,
    fd_closed,
    recv_eof,
    recv_exact,
    run,
)
from tests.helpers.servers import EchoServer
from tests.helpers.upstreams import ss_server

make_env = base.make_env  # the fixtures, shared with test_relay.py
env = base.env

MiB = 1 << 20
OVERHEAD = 2 + 2 * TAG_SIZE  # sealed length + payload tag, per chunk
NAMES = sorted(CIPHERS)
HEADER = b"\x01\x7f\x00\x00\x01\x1f\x90"  # what the Python side seals first (a target)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    for _ in range(10_000):
        if not view:
            return
        view = view[os.write(fd, view) :]
    raise AssertionError("write_all made no progress")


@dataclass
class SsServer:
    """The emulated ss-server end of one flow: opens what the relay seals, seals replies."""

    sock: socket.socket
    name: str
    key: bytes
    dec: Decryptor = field(init=False)
    enc: Encryptor = field(init=False)
    ct_in: int = 0  # ciphertext received, the caller's salt and header included
    ct_out: int = 0  # ciphertext sent, the salt included
    plain: bytearray = field(default_factory=bytearray)
    salt_sent: bool = False

    def __post_init__(self) -> None:
        self.dec = Decryptor(CIPHERS[self.name], self.key)
        self.enc = Encryptor(CIPHERS[self.name], self.key)

    def recv_plain(self, n: int, timeout: float = 20.0) -> bytes:
        self.sock.settimeout(timeout)
        while len(self.plain) < n:
            data = self.sock.recv(MiB)
            assert data, f"EOF after {len(self.plain)} of {n} plaintext bytes"
            self.ct_in += len(data)
            self.plain += self.dec.feed(data)
        out = bytes(self.plain[:n])
        del self.plain[:n]
        return out

    def recv_eof(self, timeout: float = 10.0) -> bytes:
        """The plaintext left until EOF."""
        self.sock.settimeout(timeout)
        for _ in range(100_000):
            data = self.sock.recv(MiB)
            if not data:
                out = bytes(self.plain)
                self.plain.clear()
                return out
            self.ct_in += len(data)
            self.plain += self.dec.feed(data)
        raise AssertionError("no EOF")

    def sealed(self, data: bytes, rng: random.Random | None = None) -> bytes:
        """The salt (first time) and ``data`` sealed, in random pieces when ``rng`` is given."""
        out = [b"" if self.salt_sent else self.enc.header]
        self.salt_sent = True
        pos = 0
        while pos < len(data):
            step = rng.randint(1, 3 * MAX_PAYLOAD) if rng else len(data)
            out.append(self.enc.seal(data[pos : pos + step]))
            pos += step
        return b"".join(out)

    def send(self, data: bytes, rng: random.Random | None = None) -> None:
        """Sends sealed ``data``; with ``rng`` in random pieces written as random fragments."""
        blob = self.sealed(data, rng)
        pos = 0
        while pos < len(blob):
            step = rng.choice((1, 7, 100, 5000, 70000, 300000)) if rng else len(blob)
            self.sock.sendall(blob[pos : pos + step])
            pos += step
        self.ct_out += len(blob)


@dataclass
class AeadFlow:
    link: Link
    handle: int
    server: SsServer
    pre: int  # ciphertext bytes the Python side sent before the hand-off


def add_aead(
    env: Env,
    name: str,
    *,
    link: Link | None = None,
    idle_timeout_ms: int = 0,
    server_password: str = "secret",
) -> AeadFlow:
    """What the Python side does: send salt + sealed header upstream, then hand off."""
    link = link or env.link()
    cipher = CIPHERS[name]
    key = master_key("secret", cipher.key_size)
    enc = Encryptor(cipher, key)
    pre = enc.header + enc.seal(HEADER)
    write_all(link.ufd, pre)
    handle = env.relay.add_aead(
        link.cfd,
        link.ufd,
        idle_timeout_ms,
        cipher=name,
        master_key=key,
        enc_subkey=enc.subkey,
        enc_nonce=enc.nonce_counter,
    )
    server = SsServer(link.server, name, master_key(server_password, cipher.key_size))
    if server_password == "secret":
        assert server.recv_plain(len(HEADER)) == HEADER
    return AeadFlow(link, handle, server, len(pre))


def sealed_size(n: int) -> int:
    """Ciphertext for n plaintext bytes sealed in one go."""
    return n + OVERHEAD * math.ceil(n / MAX_PAYLOAD)


def counters4(env: Env, h: int) -> tuple[int, ...] | None:
    c = env.relay.counters(h)
    return None if c is None else tuple(c[:4])


# ---------------------------------------------------------------------------


def test_encryptor_exposes_subkey_and_nonce() -> None:
    cipher = CIPHERS["aes-256-gcm"]
    key = master_key("k", cipher.key_size)
    enc = Encryptor(cipher, key, salt=bytes(32))
    assert enc.nonce_counter == 0
    sealed = enc.seal(b"x" * (MAX_PAYLOAD + 1))
    assert enc.nonce_counter == 4  # two chunks, two seals each
    # Another sealer continuing from subkey and counter produces the same stream.
    aead = cipher.aead(enc.subkey)
    first = aead.encrypt((0).to_bytes(12, "little"), MAX_PAYLOAD.to_bytes(2, "big"), None)
    assert sealed.startswith(first)


@pytest.mark.parametrize("name", NAMES)
def test_bulk_both_directions_exact(env: Env, name: str) -> None:
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    rng = random.Random(name)
    up, down = os.urandom(4 * MiB + 1), os.urandom(4 * MiB + 3)
    got_up: list[bytes] = []
    got_down: list[bytes] = []
    run(
        lambda: link.client.sendall(up),
        lambda: got_up.append(srv.recv_plain(len(up))),
        lambda: srv.send(down, rng),
        lambda: got_down.append(recv_exact(link.client, len(down))),
    )
    assert got_up[0] == up
    assert got_down[0] == down

    link.client.shutdown(socket.SHUT_WR)
    assert srv.recv_eof() == b""
    link.server.close()
    assert recv_eof(link.client) == b""
    done = env.completion(flow.handle)
    assert (done.cause, done.errno, done.side) == (Cause.DONE, 0, None)
    c = done.counters
    assert (c.client_rx, c.client_tx, c.upstream_rx) == (len(up), len(down), srv.ct_out)
    assert c.upstream_tx == srv.ct_in - flow.pre
    chunks, rest = divmod(c.upstream_tx - len(up), OVERHEAD)
    assert rest == 0
    assert chunks >= math.ceil(len(up) / MAX_PAYLOAD)
    assert fd_closed(link.cfd)
    assert fd_closed(link.ufd)


@pytest.mark.parametrize("name", NAMES)
def test_server_stream_split_at_every_boundary(env: Env, name: str) -> None:
    """Fragments of 1..n bytes, each read by the relay before the next is sent,
    cut the salt, the lengths and the payloads everywhere; after each one the
    client has exactly the plaintext of the chunks completed so far."""
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    pieces = [b"a", os.urandom(100), os.urandom(MAX_PAYLOAD), os.urandom(MAX_PAYLOAD + 1)]
    stream = b"".join(srv.sealed(p) for p in pieces)
    reference = Decryptor(CIPHERS[name], srv.key)
    sizes = [1, 2, 3, 5, 8, 13, 17, 18, 19, 33, 1, 1, 16, 2, 100, 4000, 12345, 20]
    pos = opened = 0
    for size in sizes * 3:
        frag = stream[pos : pos + size]
        if not frag:
            break
        link.server.sendall(frag)
        pos += len(frag)
        opened += len(reference.feed(frag))
        want = (0, opened, pos, 0)
        wait_until(lambda w=want: counters4(env, flow.handle) == w, what=f"counters {want}")
    link.server.sendall(stream[pos:])
    opened += len(reference.feed(stream[pos:]))
    total = sum(map(len, pieces))
    assert opened == total
    assert recv_exact(link.client, total) == b"".join(pieces)
    link.server.shutdown(socket.SHUT_WR)  # FIN on a chunk boundary: a clean EOF
    assert recv_eof(link.client) == b""
    link.client.close()
    done = env.completion(flow.handle)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (0, total, len(stream), 0)


@pytest.mark.parametrize("name", NAMES)
def test_exact_counters_per_message(env: Env, name: str) -> None:
    """Messages sent one at a time are read whole, so each is sealed on its own."""
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    expected = [0, 0, 0, 0]
    for size in (1, 100, 5000, MAX_PAYLOAD, MAX_PAYLOAD + 1, 40000):
        msg = os.urandom(size)
        link.client.sendall(msg)
        assert srv.recv_plain(size) == msg
        expected[0] += size
        expected[3] += sealed_size(size)
        wait_until(lambda: counters4(env, flow.handle) == tuple(expected), what="up counters")
        assert srv.ct_in - flow.pre == expected[3]
        reply = os.urandom(size // 2 + 1)
        srv.send(reply)
        assert recv_exact(link.client, len(reply)) == reply
        expected[1] += len(reply)
        expected[2] = srv.ct_out
        wait_until(lambda: counters4(env, flow.handle) == tuple(expected), what="down counters")
    assert expected[2] == CIPHERS[name].key_size + sum(
        sealed_size(n // 2 + 1) for n in (1, 100, 5000, MAX_PAYLOAD, MAX_PAYLOAD + 1, 40000)
    )
    assert env.relay.request_close(flow.handle)
    done = env.completion(flow.handle)
    assert done.cause is Cause.CLOSED
    assert done.counters[:4] == tuple(expected)


@pytest.mark.parametrize("name", NAMES)
def test_half_close_client_first(env: Env, name: str) -> None:
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    link.client.sendall(b"request")
    link.client.shutdown(socket.SHUT_WR)
    assert srv.recv_eof() == b"request"  # EOF passed on after the sealed bytes
    reply = os.urandom(2 * MiB + 17)
    got: list[bytes] = []
    run(lambda: srv.send(reply), lambda: got.append(recv_exact(link.client, len(reply))))
    assert got == [reply]
    assert counters4(env, flow.handle) is not None  # the upstream has not closed yet
    link.server.close()
    assert recv_eof(link.client) == b""
    done = env.completion(flow.handle)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (7, len(reply), srv.ct_out, sealed_size(7))


@pytest.mark.parametrize("name", NAMES)
def test_half_close_upstream_first(env: Env, name: str) -> None:
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    srv.send(b"banner")
    link.server.shutdown(socket.SHUT_WR)
    assert recv_eof(link.client) == b"banner"
    data = os.urandom(3 * MiB)
    got: list[bytes] = []
    run(lambda: link.client.sendall(data), lambda: got.append(srv.recv_plain(len(data))))
    assert got[0] == data
    link.client.close()
    assert srv.recv_eof() == b""
    done = env.completion(flow.handle)
    assert done.cause is Cause.DONE
    c = done.counters
    assert c[:3] == (len(data), 6, srv.ct_out)
    assert c.upstream_tx == srv.ct_in - flow.pre
    assert (c.upstream_tx - len(data)) % OVERHEAD == 0


def test_upstream_closes_without_a_byte(env: Env) -> None:
    """No salt at all is a clean EOF (ss-server does this when the target fails)."""
    flow = add_aead(env, "aes-128-gcm")
    flow.link.server.close()
    assert recv_eof(flow.link.client) == b""
    flow.link.client.close()
    done = env.completion(flow.handle)
    assert (done.cause, done.errno) == (Cause.DONE, 0)
    assert done.counters[:4] == (0, 0, 0, 0)


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def _bad_stream(kind: str, srv: SsServer, good: bytes) -> tuple[bytes, int, bool]:
    """(server bytes, plaintext the client must get, FIN after them) for one failure."""
    key_size = CIPHERS[srv.name].key_size
    head = srv.sealed(good)  # salt + one good chunk
    if kind in ("length_zero", "length_oversize"):
        # Lengths SIP004 forbids, sealed with the right key and nonce.  A zero
        # length gets its (empty) payload's tag and a FIN too, so accepting it
        # would end the flow cleanly instead of failing.
        aead = CIPHERS[srv.name].aead(srv.enc.subkey)
        nonce = srv.enc.nonce_counter
        value = 0 if kind == "length_zero" else MAX_PAYLOAD + 1
        forged = aead.encrypt(nonce.to_bytes(12, "little"), value.to_bytes(2, "big"), None)
        if value == 0:
            forged += aead.encrypt((nonce + 1).to_bytes(12, "little"), b"", None)
        return head + forged, len(good), value == 0
    nxt = srv.enc.seal(b"B" * 300)
    if kind == "salt":
        return _flip(head, 3), 0, False
    if kind == "length_tag":
        return head + _flip(nxt, 2 + 5), len(good), False
    if kind == "payload":
        return head + _flip(nxt, OVERHEAD // 2 + 10), len(good), False
    if kind == "cut_salt":
        return head[: key_size - 5], 0, True
    if kind == "cut_length":
        return head + nxt[:10], len(good), True
    if kind == "cut_payload":
        return head + nxt[: 2 + TAG_SIZE + 100], len(good), True
    raise AssertionError(kind)


BAD_KINDS = [
    "salt",
    "length_tag",
    "payload",
    "length_zero",
    "length_oversize",
    "cut_salt",
    "cut_length",
    "cut_payload",
]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_tampered_or_cut_stream(env: Env, name: str, kind: str) -> None:
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    good = os.urandom(1000)
    blob, delivered, fin = _bad_stream(kind, srv, good)
    link.server.sendall(blob)
    if fin:
        link.server.shutdown(socket.SHUT_WR)
    done = env.completion(flow.handle)
    assert (done.cause, done.errno, done.side) == (Cause.ERROR, errno.EBADMSG, "upstream")
    assert done.counters[:4] == (0, delivered, len(blob), 0)
    # The chunk before the bad one is delivered, then the client is reset:
    # a cut or forged reply must not look complete.
    assert recv_exact(link.client, delivered) == good[:delivered]
    assert recv_eof(link.client) == b"<reset>"
    assert srv.recv_eof() == b""
    assert fd_closed(link.cfd)
    assert fd_closed(link.ufd)


def test_wrong_password_fails_first_chunk(env: Env) -> None:
    flow = add_aead(env, "chacha20-ietf-poly1305", server_password="other")
    flow.server.send(b"hello")
    done = env.completion(flow.handle)
    assert (done.cause, done.errno, done.side) == (Cause.ERROR, errno.EBADMSG, "upstream")
    assert done.counters[:4] == (0, 0, flow.server.ct_out, 0)
    assert "AEAD stream failed authentication" in str(RelayError(done.errno))  # sw_strerror


@pytest.mark.parametrize("name", NAMES)
def test_backpressure_bounds_buffering(env: Env, name: str) -> None:
    """With a peer that does not read, the relay stops reading the other side:
    what it holds (read minus written) stays within one pass of ~64 KiB."""
    flow = add_aead(env, name)
    srv, link = flow.server, flow.link
    total = 24 * MiB  # far more than the socket buffers on both sides can hold
    up, down = os.urandom(total), os.urandom(total)
    senders = [
        threading.Thread(target=lambda: link.client.sendall(up), daemon=True),
        threading.Thread(target=lambda: srv.send(down), daemon=True),
    ]
    for t in senders:
        t.start()

    def stalled() -> bool:
        a = counters4(env, flow.handle)
        time.sleep(0.05)
        return a is not None and a == counters4(env, flow.handle) and 0 not in a

    wait_until(stalled, what="both directions stalled")
    c = env.relay.counters(flow.handle)
    assert c is not None
    assert c.client_rx < total and c.upstream_rx < total + 32
    # Plaintext read but not yet sealed and sent / ciphertext read but not yet
    # opened and sent: at most one 64 KiB pass (+ one partial chunk).
    assert c.client_rx - c.upstream_tx < 64 * 1024  # ciphertext is longer than plaintext
    assert c.upstream_rx - c.client_tx < 64 * 1024 + MAX_PAYLOAD + 4 * OVERHEAD + 32
    got: list[bytes] = []
    run(
        lambda: got.append(srv.recv_plain(total)),
        lambda: got.append(recv_exact(link.client, total)),
    )
    for t in senders:
        t.join(10)
    assert got == [up, down] or got == [down, up]
    link.client.close()
    link.server.close()
    assert env.completion(flow.handle).cause in (Cause.DONE, Cause.RESET)


def test_idle_timeout(env: Env) -> None:
    start = time.monotonic()
    idle = add_aead(env, "aes-128-gcm", idle_timeout_ms=200)
    busy = add_aead(env, "aes-256-gcm", idle_timeout_ms=600)
    for i in range(12):  # a round trip every 50 ms keeps `busy` alive past 600 ms
        busy.link.client.sendall(b"k")
        assert busy.server.recv_plain(1) == b"k"
        busy.server.send(bytes([i]))
        assert recv_exact(busy.link.client, 1) == bytes([i])
        time.sleep(0.05)
    done = env.completion(idle.handle)
    assert done.cause is Cause.IDLE
    assert done.counters[:4] == (0, 0, 0, 0)
    assert env.relay.counters(busy.handle) is not None
    last = time.monotonic()
    busy_done = env.completion(busy.handle)
    assert busy_done.cause is Cause.IDLE
    assert busy_done.counters[:4] == (12, 12, busy.server.ct_out, 12 * sealed_size(1))
    assert time.monotonic() - last >= 0.5
    assert time.monotonic() - start < 10
    assert recv_eof(idle.link.client) == b""


def test_request_close_mid_chunk(env: Env) -> None:
    flow = add_aead(env, "chacha20-ietf-poly1305")
    srv, link = flow.server, flow.link
    blob = srv.sealed(b"x" * 5000)
    link.server.sendall(blob[: len(blob) - 7])  # the relay holds a partial chunk
    wait_until(lambda: counters4(env, flow.handle) == (0, 0, len(blob) - 7, 0), what="read")
    assert env.relay.request_close(flow.handle) is True
    done = env.completion(flow.handle)
    assert done.cause is Cause.CLOSED
    assert done.counters[:4] == (0, 0, len(blob) - 7, 0)
    assert recv_eof(link.client) == b""
    assert srv.recv_eof() == b""
    assert env.relay.request_close(flow.handle) is False


def test_shutdown_with_open_aead_flows(env: Env) -> None:
    flows = [add_aead(env, NAMES[i % 3], idle_timeout_ms=60_000) for i in range(6)]
    # Different states: fresh, mid-salt, mid-chunk, with a stash towards a full client.
    blob = flows[1].server.sealed(b"y" * 100)
    flows[1].link.server.sendall(blob[:3])
    blob2 = flows[2].server.sealed(b"z" * 9000)
    flows[2].link.server.sendall(blob2[:5000])
    flows[3].link.client.sendall(b"abc")
    assert flows[3].server.recv_plain(3) == b"abc"
    big = os.urandom(16 * MiB)

    def fill() -> None:
        with contextlib.suppress(OSError):  # fails once the relay's end is closed
            flows[4].server.send(big)

    filler = threading.Thread(target=fill)
    filler.start()
    wait_until(lambda: (env.relay.counters(flows[4].handle) or (0,) * 4)[1] > MiB, what="fill")
    env.relay.close()
    done = {c.handle: c for c in env.relay.drain()}
    assert set(done) == {f.handle for f in flows}
    assert all(c.cause is Cause.SHUTDOWN for c in done.values())
    assert done[flows[3].handle].counters[:4] == (3, 0, 0, sealed_size(3))
    assert done[flows[2].handle].counters[:4] == (0, 0, 5000, 0)
    for f in flows:
        assert fd_closed(f.link.cfd)
        assert fd_closed(f.link.ufd)
    filler.join(10)
    assert not filler.is_alive()
    assert env.relay.active_count() == 0
    spare = env.link()
    with pytest.raises(RelayError) as shut:
        add_aead(env, "aes-128-gcm", link=spare)
    assert shut.value.errno == errno.ESHUTDOWN
    os.close(spare.cfd)
    os.close(spare.ufd)


def test_bad_params(env: Env) -> None:
    a, b = env.tcp_pair()
    key16, key32 = bytes(16), bytes(32)
    relay = env.relay

    def add(**kw: object) -> int:
        args: dict = {
            "cipher": "aes-128-gcm",
            "master_key": key16,
            "enc_subkey": key16,
            "enc_nonce": 0,
        }
        args.update(kw)
        return relay.add_aead(a.fileno(), b.fileno(), 0, **args)

    with pytest.raises(ValueError, match="cipher must be one of"):
        add(cipher="aes-192-gcm")
    with pytest.raises(ValueError, match="cipher must be one of"):
        add(cipher=None)
    with pytest.raises(ValueError, match="master_key must be 16 bytes"):
        add(master_key=key32)
    with pytest.raises(ValueError, match="enc_subkey must be 32 bytes"):
        add(cipher="chacha20-ietf-poly1305", master_key=key32, enc_subkey=key16)
    with pytest.raises(TypeError, match="master_key must be bytes"):
        add(master_key="0" * 16)
    with pytest.raises(ValueError, match="enc_nonce"):
        add(enc_nonce=-1)
    with pytest.raises(ValueError, match="enc_nonce"):
        add(enc_nonce=1 << 64)
    with pytest.raises(ValueError, match="differ"):
        relay.add_aead(
            a.fileno(), a.fileno(), cipher="aes-128-gcm", master_key=key16,
            enc_subkey=key16, enc_nonce=0,
        )  # fmt: skip
    r, w = os.pipe()
    try:
        with pytest.raises(RelayError) as notsock:
            relay.add_aead(
                r, a.fileno(), cipher="aes-128-gcm", master_key=key16,
                enc_subkey=key16, enc_nonce=0,
            )  # fmt: skip
        assert notsock.value.errno == errno.ENOTSOCK
    finally:
        os.close(r)
        os.close(w)

    # The C side checks on its own, whatever the wrapper lets through.
    from spliceway._relay import ffi, lib

    ptr = relay._ptr
    out = ffi.new("uint64_t *")
    for cipher, key_len in ((0, 16), (4, 32), (1, 32), (2, 16), (3, 16), (-1, 16)):
        p = ffi.new("sw_aead_params *", {"cipher": cipher, "key_len": key_len})
        assert lib.sw_relay_add_aead(ptr, a.fileno(), b.fileno(), 0, p, out) == -errno.EINVAL
    assert lib.sw_relay_add_aead(ptr, a.fileno(), b.fileno(), 0, ffi.NULL, out) == -errno.EINVAL
    p = ffi.new("sw_aead_params *", {"cipher": 1, "key_len": 16})
    assert lib.sw_relay_add_aead(ptr, a.fileno(), b.fileno(), 0, p, ffi.NULL) == -errno.EINVAL
    # Nothing was taken: still ours, still blocking, still working.
    assert os.get_blocking(a.fileno()) and os.get_blocking(b.fileno())
    a.sendall(b"still")
    assert recv_exact(b, 5) == b"still"
    assert relay.active_count() == 0


def test_enc_nonce_continues_python_sealing(env: Env) -> None:
    """The relay continues the Python side's nonce sequence, whatever its length."""
    link = env.link()
    cipher = CIPHERS["aes-256-gcm"]
    key = master_key("secret", cipher.key_size)
    enc = Encryptor(cipher, key)
    pre = enc.header + enc.seal(HEADER) + enc.seal(b"early" * 5000)  # 2 + 4 seals
    assert enc.nonce_counter == 6
    write_all(link.ufd, pre)
    h = env.relay.add_aead(
        link.cfd,
        link.ufd,
        cipher="aes-256-gcm",
        master_key=key,
        enc_subkey=bytearray(enc.subkey),
        enc_nonce=enc.nonce_counter,
    )
    srv = SsServer(link.server, "aes-256-gcm", key)
    assert srv.recv_plain(len(HEADER) + 25000) == HEADER + b"early" * 5000
    link.client.sendall(b"late")
    assert srv.recv_plain(4) == b"late"
    assert env.relay.request_close(h)
    assert env.completion(h).cause is Cause.CLOSED


def test_bridge_hand_off_of_a_sealed_session_delivers_completion(env: Env) -> None:
    from spliceway.actors.bridge import RelayBridge
    from spliceway.actors.dispatcher import Dispatcher
    from spliceway.flows.outbounds import SealedSession

    received: list[object] = []
    got = threading.Event()

    class Sink(pykka.ThreadingActor):
        def on_receive(self, message: object) -> None:
            received.append(message)
            got.set()

    dispatcher = Dispatcher()
    dispatcher.start()
    actor = Sink.start()
    bridge = RelayBridge(dispatcher)
    try:
        dispatcher.run_sync(bridge.attach)
        link = env.link()
        cipher = CIPHERS["aes-128-gcm"]
        key = master_key("secret", cipher.key_size)
        enc = Encryptor(cipher, key)
        write_all(link.ufd, enc.header + enc.seal(HEADER))
        handle = dispatcher.run_sync(
            lambda: bridge.hand_off(
                link.cfd, link.ufd, 0, actor, SealedSession("aes-128-gcm", key, enc)
            )
        )
        srv = SsServer(link.server, "aes-128-gcm", key)
        link.client.sendall(b"via bridge")
        assert srv.recv_plain(len(HEADER) + 10) == HEADER + b"via bridge"
        assert bridge.counters([handle])[0] is not None
        link.client.close()
        link.server.close()
        assert got.wait(10)
        [msg] = received
        completion: Completion = msg.completion  # type: ignore[attr-defined]
        assert completion.handle == handle
        assert completion.cause is Cause.DONE
        assert completion.counters[:4] == (10, 0, 0, sealed_size(10))
    finally:
        bridge.shutdown()
        dispatcher.run_sync(bridge.detach)
        dispatcher.stop()
        actor.stop()
        bridge.relay = None  # type: ignore[assignment]  # free the C side for the fd check


# ---- against Debian's ss-server ------------------------------------------


@pytest.fixture(params=NAMES)
def ss(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    with ss_server(request.param) as port:
        yield request.param, port


def test_interop_ss_server_echo_5mb(env: Env, ss: tuple[str, int]) -> None:
    name, port = ss
    cipher = CIPHERS[name]
    key = master_key("secret", cipher.key_size)
    with EchoServer() as echo:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
        enc = Encryptor(cipher, key)
        upstream.sendall(enc.header + enc.seal(target_header(*echo.address)))
        app, relay_end = socket.socketpair()
        env.sockets.append(app)
        ufd, cfd = upstream.detach(), relay_end.detach()
        h = env.relay.add_aead(
            cfd,
            ufd,
            10_000,
            cipher=name,
            master_key=key,
            enc_subkey=enc.subkey,
            enc_nonce=enc.nonce_counter,
        )
        total = 5 * MiB
        data = os.urandom(total)
        got: list[bytes] = []
        run(lambda: app.sendall(data), lambda: got.append(recv_exact(app, total)))
        assert hashlib.sha256(got[0]).digest() == hashlib.sha256(data).digest()
        # ss-server closes both ways on our EOF; the echo server's FIN comes
        # back as a clean EOF on a chunk boundary.
        app.shutdown(socket.SHUT_WR)
        assert recv_eof(app) == b""
        done = env.completion(h)
    assert done.cause is Cause.DONE, done
    c = done.counters
    assert (c.client_rx, c.client_tx) == (total, total)
    assert (c.upstream_tx - total) % OVERHEAD == 0
    assert c.upstream_rx > total + cipher.key_size
    assert (c.upstream_rx - cipher.key_size - total) % OVERHEAD == 0


def test_completion_fd_poll_with_aead(env: Env) -> None:
    poll = select.poll()
    poll.register(env.relay.fileno(), select.POLLIN)
    flow = add_aead(env, "aes-256-gcm")
    assert poll.poll(0) == []
    flow.link.client.close()
    flow.link.server.close()
    assert poll.poll(5000)
    assert [c.handle for c in env.relay.drain()] == [flow.handle]
