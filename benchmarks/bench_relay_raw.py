"""Raw goodput and CPU cost of the C relay, against a direct connection.

Each connection streams one way (client -> server) for a fixed time.  Senders use
sendfile() from a memfd and receivers splice() into /dev/null, so the traffic
generators cost little CPU and the relay (or the loopback stack) is the limit.
The relay's CPU is read from its own threads (named sw-relay-N) in /proc.

    python benchmarks/bench_relay_raw.py --conns 8 --seconds 3
    python benchmarks/bench_relay_raw.py --pipe-sizes 65536,262144,1048576
    python benchmarks/bench_relay_raw.py --transport unix --copy
    python benchmarks/bench_relay_raw.py --aead --aead-bytes 1073741824

``--aead`` instead measures one flow at a time: plaintext goodput of the C
Shadowsocks AEAD path per cipher, sealing (client -> upstream) and opening
(upstream -> client), next to a spliced flow moving the same bytes.  The opened
stream is sealed once in Python (``--aead-stream`` bytes of plaintext) and
replayed on fresh flows until ``--aead-bytes`` have been relayed.

Only 127.0.0.1 / socketpairs are used; every run stops by itself.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from run_e2e import read_stat

from spliceway.native.relay import Relay
from spliceway.protocols.shadowsocks import CIPHERS, Encryptor, master_key

CHUNK = 8 << 20


@dataclass
class Result:
    label: str
    nbytes: int
    seconds: float
    relay_cpu: float | None

    @property
    def gbps(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e9

    @property
    def cpu_per_gb(self) -> float | None:
        if self.relay_cpu is None or not self.nbytes:
            return None
        return self.relay_cpu / (self.nbytes / 1e9)


def relay_cpu_seconds() -> float:
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            comm, _, cpu_s = read_stat(f"/proc/self/task/{tid}/stat")
        except OSError:
            continue
        if comm.startswith("sw-relay"):
            total += cpu_s
    return total


def tcp_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    return a, b


def source_fd() -> int:
    fd = os.memfd_create("bench-src")
    os.write(fd, os.urandom(1 << 20) * (CHUNK >> 20))
    return fd


def sink_to_eof(sock: socket.socket, received: list[int], i: int = 0) -> None:
    """splice() everything until EOF into /dev/null, counting the bytes in received[i]."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    r, w = os.pipe()
    try:
        for _ in range(1 << 40):
            n = os.splice(sock.fileno(), w, 1 << 20)
            if n == 0:
                return
            received[i] += n
            while n:
                n -= os.splice(r, devnull, n)
    finally:
        for fd in (r, w, devnull):
            os.close(fd)


def stream(
    pairs: list[tuple[socket.socket, socket.socket]], seconds: float, src: int
) -> tuple[int, float, float]:
    """Sends on pairs[i][0], sinks pairs[i][1]; returns (bytes, elapsed, relay CPU s).

    All three are measured over the same window, after a warm-up."""
    stop = threading.Event()
    received = [0] * len(pairs)

    def send(sock: socket.socket) -> None:
        sock.settimeout(None)
        deadline = time.monotonic() + seconds + 30
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                os.sendfile(sock.fileno(), src, 0, CHUNK)
            except OSError:
                return
        sock.shutdown(socket.SHUT_WR)

    threads = [
        threading.Thread(target=sink_to_eof, args=(p[1], received, i)) for i, p in enumerate(pairs)
    ]
    threads += [threading.Thread(target=send, args=(p[0],)) for p in pairs]
    for t in threads:
        t.start()
    time.sleep(0.3)  # warm-up: slow start, pipe pool, page cache
    b0, t0, c0 = sum(received), time.monotonic(), relay_cpu_seconds()
    time.sleep(seconds)
    b1, t1, c1 = sum(received), time.monotonic(), relay_cpu_seconds()
    stop.set()
    for t in threads:
        t.join(60)
    return b1 - b0, t1 - t0, c1 - c0


def run_direct(conns: int, seconds: float, src: int, transport: str) -> Result:
    pairs, closers = make_pairs(conns, transport)
    try:
        nbytes, elapsed, _ = stream(pairs, seconds, src)
    finally:
        closers()
    return Result("direct", nbytes, elapsed, None)


def make_pairs(
    conns: int, transport: str
) -> tuple[list[tuple[socket.socket, socket.socket]], Callable[[], None]]:
    socks: list[socket.socket] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    pairs = []
    for _ in range(conns):
        pair = tcp_pair(listener) if transport == "tcp" else socket.socketpair()
        pairs.append(pair)
        socks += pair
    listener.close()

    def close() -> None:
        for s in socks:
            s.close()

    return pairs, close


def run_relay(
    conns: int, seconds: float, src: int, transport: str, pipe_size: int, copy: bool, loops: int
) -> Result:
    with Relay(loops=loops) as relay:
        relay._set_pipe_size(pipe_size)
        relay._debug_force_copy(copy)
        outer, close_outer = make_pairs(conns, transport)  # app client <-> relay client fd
        inner, close_inner = make_pairs(conns, transport)  # relay upstream fd <-> app server
        try:
            for (_, rc), (ru, _) in zip(outer, inner, strict=True):
                relay.add(rc.detach(), ru.detach())
            ends = [(o[0], i[1]) for o, i in zip(outer, inner, strict=True)]
            nbytes, elapsed, cpu = stream(ends, seconds, src)
        finally:
            close_outer()
            close_inner()
        size = f"{pipe_size >> 10}K" if pipe_size else "default"
        label = f"relay pipe={size}{' copy' if copy else ''}"
        return Result(label, nbytes, elapsed, cpu)


def send_bounded(sock: socket.socket, src: int, size: int, nbytes: int) -> None:
    """sendfile() nbytes from the memfd src (size bytes, repeated), then FIN."""
    sock.settimeout(None)
    left = nbytes
    for _ in range(1 << 40):
        if left <= 0:
            break
        sent = os.sendfile(sock.fileno(), src, 0, min(size, left))
        if sent <= 0:
            raise OSError("sendfile made no progress")
        left -= sent
    sock.shutdown(socket.SHUT_WR)


def one_flow(
    relay: Relay,
    transport: str,
    cipher: str | None,
    direction: str,
    src: tuple[int, int],
    total: int,
) -> tuple[int, float]:
    """One flow carries ``total`` bytes of the memfd ``src`` (fd, size), repeated,
    app client -> app server (``up``) or back (``down``) until EOF; returns
    (plaintext bytes the relay moved, seconds until the sink saw EOF)."""
    (outer,), close_outer = make_pairs(1, transport)
    (inner,), close_inner = make_pairs(1, transport)
    (client, rc), (ru, server) = outer, inner
    try:
        if cipher is None:
            relay.add(rc.detach(), ru.detach())
        else:
            info = CIPHERS[cipher]
            key = master_key("bench", info.key_size)
            enc = Encryptor(info, key)
            ru.sendall(enc.header + enc.seal(b"\x01\x7f\x00\x00\x01\x00\x50"))
            relay.add_aead(
                rc.detach(),
                ru.detach(),
                cipher=cipher,
                master_key=key,
                enc_subkey=enc.subkey,
                enc_nonce=enc.nonce_counter,
            )
        src_sock, dst_sock = (client, server) if direction == "up" else (server, client)
        sinker = threading.Thread(target=sink_to_eof, args=(dst_sock, [0]))
        start = time.monotonic()
        sinker.start()
        send_bounded(src_sock, src[0], src[1], total)
        sinker.join(600)
        elapsed = time.monotonic() - start
        dst_sock.shutdown(socket.SHUT_WR)  # the other direction ends too: DONE
        done = relay.wait(30)
        if not done or done[0].cause.name != "DONE":
            raise RuntimeError(f"flow did not complete cleanly: {done}")
        counters = done[0].counters
        return (counters.client_rx if direction == "up" else counters.client_tx), elapsed
    finally:
        close_outer()
        close_inner()


def sealed_stream(cipher: str, plain_src: int, plain_size: int) -> tuple[int, int]:
    """A memfd holding a server's stream (salt + chunks) for plain_size bytes of plain_src."""
    info = CIPHERS[cipher]
    enc = Encryptor(info, master_key("bench", info.key_size))
    fd = os.memfd_create(f"bench-{cipher}")
    os.write(fd, enc.header)
    size = len(enc.header)
    plain = os.pread(plain_src, 1 << 20, 0)
    for _ in range(plain_size >> 20):
        blob = enc.seal(plain)
        os.write(fd, blob)
        size += len(blob)
    return fd, size


def run_aead_bench(args: argparse.Namespace) -> None:
    nbytes, stream_plain = args.aead_bytes, min(args.aead_stream, args.aead_bytes)
    names = [c for c in args.aead_ciphers.split(",") if c]
    src = source_fd()
    rows: list[tuple[str, str, int, float, float]] = []
    with Relay(loops=1) as relay:
        for cipher in [None, *names]:
            for direction in ("up", "down"):
                label = cipher or "spliced"
                c0 = relay_cpu_seconds()
                moved, elapsed = 0, 0.0
                if cipher is None or direction == "up":
                    moved, elapsed = one_flow(
                        relay, args.transport, cipher, direction, (src, CHUNK), nbytes
                    )
                else:
                    stream = sealed_stream(cipher, src, stream_plain)
                    try:
                        for _ in range(max(1, nbytes // stream_plain)):
                            m, e = one_flow(
                                relay, args.transport, cipher, direction, stream, stream[1]
                            )
                            moved, elapsed = moved + m, elapsed + e
                    finally:
                        os.close(stream[0])
                cpu = relay_cpu_seconds() - c0
                rows.append((label, direction, moved, elapsed, cpu))
    os.close(src)
    print(f"one flow at a time over {args.transport}, {nbytes / 1e9:.2f} GB per row, 1 relay loop")
    print(f"{'flow':<24}{'direction':<18}{'MB/s':>10}{'relay CPU s/GB':>16}")
    for label, direction, moved, elapsed, cpu in rows:
        what = "client->upstream" if direction == "up" else "upstream->client"
        rate = moved / elapsed / 1e6
        print(f"{label:<24}{what:<18}{rate:>10.0f}{cpu / (moved / 1e9):>16.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--loops", type=int, default=0, help="relay threads, 0 = one per CPU")
    ap.add_argument("--pipe-sizes", default="65536", help="comma separated F_SETPIPE_SZ values")
    ap.add_argument("--transport", choices=["tcp", "unix"], default="tcp")
    ap.add_argument("--copy", action="store_true", help="force the read/write fallback")
    ap.add_argument(
        "--repeat", type=int, default=1, help="interleaved rounds; the best round is shown"
    )
    ap.add_argument(
        "--aead", action="store_true", help="one-flow goodput of the Shadowsocks AEAD path"
    )
    ap.add_argument("--aead-bytes", type=int, default=1 << 30, help="plaintext bytes per row")
    ap.add_argument(
        "--aead-stream", type=int, default=64 << 20, help="plaintext of the replayed server stream"
    )
    ap.add_argument("--aead-ciphers", default=",".join(sorted(CIPHERS)))
    args = ap.parse_args()
    if args.aead:
        run_aead_bench(args)
        return

    src = source_fd()
    best: dict[str, Result] = {}
    # Rounds interleave direct and relay runs, and the best of each is kept, so
    # a noisy neighbour on a shared machine skews the ratio less.
    for _ in range(max(1, args.repeat)):
        round_results = [run_direct(args.conns, args.seconds, src, args.transport)]
        for size in (int(s) for s in args.pipe_sizes.split(",")):
            round_results.append(
                run_relay(
                    args.conns, args.seconds, src, args.transport, size, args.copy, args.loops
                )
            )
        for r in round_results:
            if r.label not in best or r.gbps > best[r.label].gbps:
                best[r.label] = r
    os.close(src)

    results = list(best.values())
    base = results[0].gbps
    rounds = f", best of {args.repeat} rounds" if args.repeat > 1 else ""
    print(f"{args.conns} connections over {args.transport}, {args.seconds:.1f} s each{rounds}")
    print(f"{'mode':<24}{'Gbit/s':>10}{'x direct':>10}{'relay CPU s':>13}{'CPU s/GB':>10}")
    for r in results:
        cpu = "-" if r.relay_cpu is None else f"{r.relay_cpu:.2f}"
        per_gb = "-" if r.cpu_per_gb is None else f"{r.cpu_per_gb:.3f}"
        print(f"{r.label:<24}{r.gbps:>10.2f}{r.gbps / base:>10.2f}{cpu:>13}{per_gb:>10}")


if __name__ == "__main__":
    main()
