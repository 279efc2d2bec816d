"""The C relay through spliceway.native.relay, on real loopback TCP pairs and socketpairs."""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import itertools
import os
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from spliceway.native.relay import (
    ABI_VERSION,
    Cause,
    Completion,
    Counters,
    Relay,
    RelayError,
    native_abi_version,
)
from tests.conftest import wait_until

MiB = 1 << 20


def open_fds() -> dict[str, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the fd listdir itself used
            out[name] = os.readlink(f"/proc/self/fd/{name}")
    return out


@dataclass
class Link:
    """One proxied connection: the two application ends and the two fds the relay gets."""

    client: socket.socket  # the application's client end
    server: socket.socket  # the application's server end
    cfd: int  # relay's client-facing fd
    ufd: int  # relay's upstream-facing fd


@dataclass
class Env:
    """A relay plus everything a test opens, all released (and fds checked) at teardown."""

    relay: Relay
    listener: socket.socket
    sockets: list[socket.socket] = field(default_factory=list)
    seen: dict[int, Completion] = field(default_factory=dict)

    def tcp_pair(self) -> tuple[socket.socket, socket.socket]:
        a = socket.create_connection(self.listener.getsockname())
        b, _ = self.listener.accept()
        self.sockets += [a, b]
        return a, b

    def link(self) -> Link:
        """(app client, relay client fd) + (relay upstream fd, app server)."""
        client, rc = self.tcp_pair()
        ru, server = self.tcp_pair()
        self.sockets.remove(rc)
        self.sockets.remove(ru)
        return Link(client, server, rc.detach(), ru.detach())

    def add(self, link: Link, idle_timeout_ms: int = 0) -> int:
        return self.relay.add(link.cfd, link.ufd, idle_timeout_ms)

    def completions(self, handles: Iterator[int] | list[int], timeout: float = 20.0) -> dict:
        want = set(handles)
        deadline = time.monotonic() + timeout
        while not want <= self.seen.keys() and time.monotonic() < deadline:
            for c in self.relay.wait(0.2):
                assert c.handle not in self.seen, f"second completion for {c.handle:#x}"
                self.seen[c.handle] = c
        missing = want - self.seen.keys()
        assert not missing, f"{len(missing)} flows did not complete"
        return {h: self.seen[h] for h in want}

    def completion(self, handle: int, timeout: float = 20.0) -> Completion:
        return self.completions([handle], timeout)[handle]


def run(*targets: Callable[[], object], timeout: float = 30.0) -> None:
    """Runs the targets on threads, joins them and re-raises the first failure."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "threads hung"
    if errors:
        raise errors[0]


def recv_exact(sock: socket.socket, n: int, timeout: float = 20.0) -> bytes:
    sock.settimeout(timeout)
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), MiB))
        assert chunk, f"EOF after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


def recv_eof(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything until EOF (a reset counts as EOF and is reported as b'<reset>')."""
    sock.settimeout(timeout)
    buf = bytearray()
    for _ in range(100_000):
        try:
            chunk = sock.recv(MiB)
        except ConnectionResetError:
            return b"<reset>"
        if not chunk:
            return bytes(buf)
        buf += chunk
    raise AssertionError("no EOF")


def fd_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


@pytest.fixture
def make_env() -> Iterator[Callable[..., Env]]:
    """Builds Envs; at teardown closes them and checks no fd leaked."""
    gc.collect()
    baseline = open_fds()
    envs: list[Env] = []

    def make(loops: int = 2, capacity: int = 65536) -> Env:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4096)
        env = Env(Relay(loops=loops, capacity=capacity), listener)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.relay.close()
        # pytest keeps fixture values until after teardown: drop the relay
        # itself so gc frees the C side (completion eventfd) now.
        env.relay = None  # type: ignore[assignment]
        for s in env.sockets:
            s.close()
        env.listener.close()
    envs.clear()
    gc.collect()  # frees the C relay: loop epoll fds, eventfds, pooled pipes
    after = open_fds()
    assert len(after) == len(baseline), {k: v for k, v in after.items() if baseline.get(k) != v}


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


def payload(n: int, seed: int) -> bytes:
    block = hashlib.sha256(struct.pack("<Q", seed)).digest()
    return (block * (n // len(block) + 1))[:n]


def start_numbered_sender(
    sock: socket.socket, total: int, finish: Callable[[], None]
) -> tuple[threading.Thread, hashlib._Hash]:
    """Sends ``total`` random bytes as numbered 1 MiB chunks (reordering would
    show), then calls ``finish``, on a thread; returns it and the running sha256."""
    chunk = bytearray(os.urandom(MiB))
    sent = hashlib.sha256()

    def sender() -> None:
        for i in range(total // MiB):
            chunk[:8] = struct.pack("<Q", i)
            sent.update(chunk)
            sock.sendall(chunk)
        finish()

    t = threading.Thread(target=sender)
    t.start()
    return t, sent


# ---------------------------------------------------------------------------


def test_abi_version_matches() -> None:
    assert native_abi_version() == ABI_VERSION


def test_both_directions_exact_counters(env: Env) -> None:
    link = env.link()
    h = env.add(link)
    assert env.relay.active_count() == 1
    up, down = payload(100_000, 1), payload(333_333, 2)
    link.client.sendall(up)
    assert recv_exact(link.server, len(up)) == up
    link.server.sendall(down)
    assert recv_exact(link.client, len(down)) == down
    expected = (len(up), len(down), len(down), len(up))
    # The app can read bytes an instant before the relay thread counts them.
    wait_until(lambda: env.relay.counters(h)[:4] == expected, what="exact counters")
    c = env.relay.counters(h)
    assert c is not None
    assert abs(c.last_activity_unix_ms - time.time() * 1000) < 60_000

    link.client.close()
    link.server.close()
    done = env.completion(h)
    assert done.cause is Cause.DONE
    assert (done.errno, done.side) == (0, None)
    assert done.counters[:4] == (len(up), len(down), len(down), len(up))
    assert env.relay.counters(h) is None
    assert env.relay.active_count() == 0
    assert fd_closed(link.cfd)
    assert fd_closed(link.ufd)


def test_half_close_keeps_other_direction(env: Env) -> None:
    link = env.link()
    h = env.add(link)
    link.client.sendall(b"request")
    link.client.shutdown(socket.SHUT_WR)
    assert recv_eof(link.server) == b"request"  # EOF passed on after the bytes
    reply = payload(2 * MiB + 17, 3)
    link.server.sendall(reply)
    assert recv_exact(link.client, len(reply)) == reply
    assert env.relay.counters(h) is not None  # still open: upstream has not closed
    link.server.close()
    assert recv_eof(link.client) == b""
    done = env.completion(h)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (7, len(reply), len(reply), 7)


@pytest.mark.parametrize("reset_side", ["client", "upstream"])
def test_reset_propagates(env: Env, reset_side: str) -> None:
    link = env.link()
    h = env.add(link)
    link.client.sendall(b"ping")
    assert recv_exact(link.server, 4) == b"ping"
    victim, other = (
        (link.client, link.server) if reset_side == "client" else (link.server, link.client)
    )
    victim.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    victim.close()
    done = env.completion(h)
    assert done.cause is Cause.RESET
    assert done.side == reset_side
    assert done.errno == errno.ECONNRESET
    assert done.counters[:4] == (4, 0, 0, 4)
    assert recv_eof(other) in (b"", b"<reset>")


def test_large_transfer_sha256(env: Env) -> None:
    total = 256 * MiB
    link = env.link()
    h = env.add(link)
    t, sent = start_numbered_sender(
        link.client, total, lambda: link.client.shutdown(socket.SHUT_WR)
    )
    got = hashlib.sha256()
    n = 0
    buf = bytearray(MiB)
    link.server.settimeout(60)
    for _ in range(10 * total // 4096):
        k = link.server.recv_into(buf)
        if not k:
            break
        got.update(memoryview(buf)[:k])
        n += k
    t.join(60)
    assert n == total
    assert got.hexdigest() == sent.hexdigest()
    link.server.close()
    done = env.completion(h)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (total, 0, 0, total)


def test_request_close(env: Env) -> None:
    link = env.link()
    h = env.add(link)
    link.client.sendall(b"x" * 1000)
    assert recv_exact(link.server, 1000)
    assert env.relay.request_close(h) is True
    done = env.completion(h)
    assert done.cause is Cause.CLOSED
    assert done.counters[:4] == (1000, 0, 0, 1000)
    assert fd_closed(link.cfd)
    assert fd_closed(link.ufd)
    assert recv_eof(link.client) == b""
    assert recv_eof(link.server) == b""
    assert env.relay.request_close(h) is False


def test_idle_timeout(env: Env) -> None:
    idle = env.link()
    busy = env.link()
    start = time.monotonic()
    h_idle = env.add(idle, idle_timeout_ms=200)
    h_busy = env.add(busy, idle_timeout_ms=600)
    # A byte every 50 ms keeps `busy` alive well past its timeout.
    for _ in range(16):
        busy.client.sendall(b"k")
        assert recv_exact(busy.server, 1) == b"k"
        time.sleep(0.05)
    done = env.completion(h_idle)
    assert done.cause is Cause.IDLE
    assert done.counters[:4] == (0, 0, 0, 0)
    assert env.relay.counters(h_busy) is not None
    last_byte = time.monotonic()
    busy_done = env.completion(h_busy)
    assert busy_done.cause is Cause.IDLE
    assert busy_done.counters.client_rx == 16
    assert time.monotonic() - last_byte >= 0.5
    assert time.monotonic() - start < 10


def test_idle_deadline_precision(env: Env) -> None:
    link = env.link()
    start = time.monotonic()
    h = env.add(link, idle_timeout_ms=200)
    poll = select.poll()
    poll.register(env.relay.fileno(), select.POLLIN)
    assert poll.poll(5000)
    elapsed = time.monotonic() - start
    [done] = env.relay.drain()
    assert (done.handle, done.cause) == (h, Cause.IDLE)
    assert 0.19 <= elapsed < 1.0, elapsed


def test_fileno_tracks_pending_completions(env: Env) -> None:
    poll = select.poll()
    poll.register(env.relay.fileno(), select.POLLIN)
    assert poll.poll(0) == []
    link = env.link()
    h = env.add(link)
    link.client.close()
    link.server.close()
    assert poll.poll(5000)
    assert [c.handle for c in env.relay.drain()] == [h]
    assert poll.poll(0) == []


def test_many_concurrent_pairs(make_env: Callable[..., Env]) -> None:
    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * n + 500
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} fds, hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    env = make_env()
    links = [env.link() for _ in range(n)]
    handles = [env.add(link) for link in links]
    assert len(set(handles)) == n
    assert env.relay.active_count() == n
    sizes = [(100 + 37 * i % 5000, 50 + 91 * i % 7000) for i in range(n)]
    for link, (up, down) in zip(links, sizes, strict=True):
        link.client.sendall(payload(up, up))
        link.server.sendall(payload(down, down))
    for link, (up, down) in zip(links, sizes, strict=True):
        assert recv_exact(link.server, up) == payload(up, up)
        assert recv_exact(link.client, down) == payload(down, down)
        link.client.close()
        link.server.close()
    done = env.completions(handles, timeout=30)
    for h, (up, down) in zip(handles, sizes, strict=True):
        assert done[h].cause is Cause.DONE
        assert done[h].counters[:4] == (up, down, down, up)
    assert env.relay.active_count() == 0


def test_stale_and_bogus_handles(make_env: Callable[..., Env]) -> None:
    env = make_env(loops=1, capacity=1)
    first = env.link()
    h1 = env.add(first)
    second = env.link()
    with pytest.raises(RelayError) as full:
        env.add(second)
    assert full.value.errno == errno.ENOSPC
    assert not fd_closed(second.cfd)  # a failed add takes nothing
    first.client.close()
    first.server.close()
    assert env.completion(h1).cause is Cause.DONE
    assert env.relay.counters(h1) is None
    assert env.relay.request_close(h1) is False

    h2 = env.add(second)  # reuses the only slot
    assert h2 != h1
    assert env.relay.counters(h1) is None
    assert env.relay.counters(h2) is not None
    assert env.relay.counters_many([h1, h2, 0, 2**64 - 1]) == [
        None,
        env.relay.counters(h2),
        None,
        None,
    ]
    for bogus in (0, 1, 2**32, 2**64 - 1):
        assert env.relay.counters(bogus) is None
        assert env.relay.request_close(bogus) is False
    with pytest.raises(ValueError, match="handle"):
        env.relay.counters(-1)
    with pytest.raises(ValueError, match="handle"):
        env.relay.request_close(2**64)
    assert env.relay.request_close(h2) is True
    assert env.completion(h2).cause is Cause.CLOSED


def test_add_rejects_bad_fds(env: Env) -> None:
    r, w = os.pipe()
    a, b = env.tcp_pair()
    try:
        with pytest.raises(RelayError) as notsock:
            env.relay.add(r, a.fileno())
        assert notsock.value.errno == errno.ENOTSOCK
        with pytest.raises(RelayError) as badf:
            env.relay.add(a.fileno(), 1_000_000)
        assert badf.value.errno == errno.EBADF
        with pytest.raises(ValueError, match="differ"):
            env.relay.add(a.fileno(), a.fileno())
        with pytest.raises(ValueError, match="idle_timeout_ms"):
            env.relay.add(a.fileno(), b.fileno(), -1)
        with pytest.raises(TypeError):
            env.relay.add(a, b)  # type: ignore[arg-type]
        # Still ours, still blocking: a failed add changes nothing.
        assert os.get_blocking(a.fileno())
        assert os.get_blocking(b.fileno())
    finally:
        os.close(r)
        os.close(w)


def test_failed_add_is_undone(make_env: Callable[..., Env]) -> None:
    env = make_env(loops=1)
    first, second = env.link(), env.link()
    h = env.add(first)
    # epoll refuses the upstream fd (already registered by the first flow), so
    # the add fails after the client fd was registered and made non-blocking.
    with pytest.raises(RelayError) as exists:
        env.relay.add(second.cfd, first.ufd)
    assert exists.value.errno == errno.EEXIST
    assert os.get_blocking(second.cfd)
    dup = os.dup(second.cfd)
    try:
        with pytest.raises(ValueError, match="differ"):
            env.relay.add(dup, dup)
        with pytest.raises(RelayError) as same:
            env.relay.add(second.cfd, dup)  # one socket under two numbers
        assert same.value.errno == errno.EINVAL
    finally:
        os.close(dup)
    h2 = env.add(second)  # the undone fds work normally afterwards
    second.client.sendall(b"after")
    assert recv_exact(second.server, 5) == b"after"
    for link in (first, second):
        link.client.close()
        link.server.close()
    done = env.completions([h, h2])
    assert done[h2].cause is Cause.DONE
    assert done[h2].counters[:4] == (5, 0, 0, 5)


def test_close_with_active_flows(env: Env) -> None:
    links = [env.link() for _ in range(5)]
    handles = [env.add(link, idle_timeout_ms=60_000) for link in links]
    links[0].client.sendall(b"abc")
    assert recv_exact(links[0].server, 3) == b"abc"
    woken: list[list[Completion]] = []
    waiter = threading.Thread(target=lambda: woken.append(env.relay.wait(None)))
    # A waiter blocked on an empty queue must be released by close().
    env.relay.drain()
    waiter.start()
    time.sleep(0.05)
    env.relay.close()
    waiter.join(5)
    assert not waiter.is_alive()
    env.relay.close()  # idempotent
    done = {c.handle: c for c in woken[0] + env.relay.drain()}
    assert set(done) == set(handles)
    assert all(c.cause is Cause.SHUTDOWN for c in done.values())
    assert done[handles[0]].counters[:4] == (3, 0, 0, 3)
    for link in links:
        assert fd_closed(link.cfd)
        assert fd_closed(link.ufd)
        assert recv_eof(link.client) == b""
    assert env.relay.wait(None) == []
    assert env.relay.wait(1.0) == []
    assert env.relay.active_count() == 0
    assert env.relay.counters(handles[0]) is None
    assert env.relay.request_close(handles[0]) is False
    spare = env.link()
    with pytest.raises(RelayError) as shut:
        env.add(spare)
    assert shut.value.errno == errno.ESHUTDOWN
    os.close(spare.cfd)
    os.close(spare.ufd)


def test_counters_monotonic_while_running(env: Env) -> None:
    total = 64 * MiB
    link = env.link()
    h = env.add(link)
    data = os.urandom(MiB)

    def sender() -> None:
        for _ in range(total // MiB):
            link.client.sendall(data)
        link.client.shutdown(socket.SHUT_WR)

    def receiver() -> None:
        assert len(recv_eof(link.server, timeout=30)) == total
        link.server.close()

    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    samples: list[Counters] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        [c] = env.relay.counters_many([h])
        if c is None:
            break
        samples.append(c)
        time.sleep(0.001)
    for t in threads:
        t.join(30)
    assert len(samples) > 2
    for a, b in itertools.pairwise(samples):
        assert all(x <= y for x, y in zip(a, b, strict=True)), (a, b)
    assert any(0 < s.client_rx < total for s in samples)  # sampled mid-flight
    done = env.completion(h)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (total, 0, 0, total)
    assert all(s.client_rx <= total for s in samples)


@pytest.mark.parametrize("force_copy", [False, True], ids=["splice", "copy"])
def test_unix_socketpairs(env: Env, force_copy: bool) -> None:
    env.relay._debug_force_copy(force_copy)
    app_client, rc = socket.socketpair()
    ru, app_server = socket.socketpair()
    env.sockets += [app_client, app_server]
    cfd, ufd = rc.detach(), ru.detach()
    h = env.relay.add(cfd, ufd)
    up, down = payload(3 * MiB + 5, 7), payload(5 * MiB + 3, 8)
    t = threading.Thread(target=app_client.sendall, args=(up,))
    t.start()
    assert recv_exact(app_server, len(up)) == up
    t.join(10)
    t = threading.Thread(target=app_server.sendall, args=(down,))
    t.start()
    assert recv_exact(app_client, len(down)) == down
    t.join(10)
    app_client.shutdown(socket.SHUT_WR)
    assert recv_eof(app_server) == b""
    app_server.close()
    assert recv_eof(app_client) == b""
    done = env.completion(h)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (len(up), len(down), len(down), len(up))


def test_copy_fallback_tcp_sha256(env: Env) -> None:
    env.relay._debug_force_copy(True)
    total = 32 * MiB
    link = env.link()
    h = env.add(link)
    t, sent = start_numbered_sender(link.client, total, link.client.close)
    got = recv_eof(link.server, timeout=30)
    t.join(30)
    assert len(got) == total
    assert hashlib.sha256(got).hexdigest() == sent.hexdigest()
    link.server.close()
    done = env.completion(h)
    assert done.cause is Cause.DONE
    assert done.counters[:4] == (total, 0, 0, total)


def test_bulk_flow_does_not_starve_small_one(make_env: Callable[..., Env]) -> None:
    env = make_env(loops=1)
    bulk, chat = env.link(), env.link()
    h_bulk, h_chat = env.add(bulk), env.add(chat)
    stop = threading.Event()
    data = os.urandom(MiB)

    def pump() -> None:
        while not stop.is_set():
            try:
                bulk.client.sendall(data)
            except OSError:
                return

    def drain() -> None:
        bulk.server.settimeout(10)
        buf = bytearray(MiB)
        while bulk.server.recv_into(buf):
            pass

    threads = [threading.Thread(target=pump), threading.Thread(target=drain)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: (env.relay.counters(h_bulk) or (0,))[0] > 32 * MiB, what="bulk")
        start = time.monotonic()
        for i in range(50):
            chat.client.sendall(struct.pack("<I", i))
            assert recv_exact(chat.server, 4) == struct.pack("<I", i)
            chat.server.sendall(b"ok")
            assert recv_exact(chat.client, 2) == b"ok"
        assert time.monotonic() - start < 5.0
    finally:
        stop.set()
        bulk.client.shutdown(socket.SHUT_WR)
        for t in threads:
            t.join(10)
    bulk.server.close()
    chat.client.close()
    chat.server.close()
    done = env.completions([h_bulk, h_chat])
    assert done[h_chat].counters[:4] == (200, 100, 100, 200)
    assert done[h_bulk].counters.client_rx == done[h_bulk].counters.upstream_tx
