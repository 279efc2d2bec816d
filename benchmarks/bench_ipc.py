#!/usr/bin/env python3
"""The ``stats`` query over the IPC socket, the HTTP control API and gRPC, 1 and 8 clients.

    python benchmarks/bench_ipc.py [--seconds 3]

One engine (``python -m spliceway run``, socks5 inbound, the HTTP control API on
127.0.0.1, the IPC socket in a temporary directory and, when the ``grpc`` extra is
installed, the gRPC API beside the HTTP one). Each client sends ``stats`` queries
back to back on one connection, for ``--seconds``: IPC frames ``{"id": n, "stats":
{}}``, HTTP ``GET /api/v1/stats`` on a keep-alive connection, gRPC
``Control/Query {name: "stats"}`` on its own channel. The clients are threads of
this process, each with its own connection; the engine runs in its own process.

Reported per transport and client count:
- answered queries/s;
- p50/p99 latency of the answered ones;
- the ``rate_limited`` answers (HTTP 429, gRPC RESOURCE_EXHAUSTED). HTTP and gRPC
  queries share one limit of 100/s per engine by design (docs/security.md); IPC,
  whose users are ``admin`` on the host, is not limited.

Every server listens on 127.0.0.1 or a Unix socket in a temporary directory, every
loop is bounded in time, and only the engine this script started is stopped.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_control as bc  # noqa: E402
import run_e2e as e2e  # noqa: E402

GRPC_RE = re.compile(r"gRPC control API listening on ([0-9.]+):(\d+)")


def ipc_client(path: str, seconds: float, out: list[tuple[int, list[float]]]) -> None:
    """Back-to-back stats queries on one IPC connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    reader = sock.makefile("rb")
    lat: list[float] = []
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        t0 = time.perf_counter()
        sock.sendall(b'{"id": %d, "stats": {}}\n' % n)
        reply = json.loads(reader.readline())
        lat.append(time.perf_counter() - t0)
        assert reply["ok"] and reply["id"] == n, reply
    reader.close()
    sock.close()
    out.append((0, lat))


def http_client(port: int, seconds: float, out: list[tuple[int, list[float]]]) -> None:
    """Back-to-back GET /api/v1/stats on one keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    lat: list[float] = []
    limited = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        conn.request("GET", "/api/v1/stats")
        resp = conn.getresponse()
        resp.read()
        if resp.status == 200:
            lat.append(time.perf_counter() - t0)
        elif resp.status == 429:
            limited += 1
        else:
            raise SystemExit(f"GET /api/v1/stats answered {resp.status}")
    conn.close()
    out.append((limited, lat))


def grpc_client(target: str, seconds: float, out: list[tuple[int, list[float]]]) -> None:
    """Back-to-back Control/Query stats calls on one channel."""
    import grpc

    from spliceway.api.grpc_gen import control_pb2, control_pb2_grpc

    lat: list[float] = []
    limited = 0
    request = control_pb2.QueryRequest(name="stats")
    with grpc.insecure_channel(target) as channel:
        query = control_pb2_grpc.ControlStub(channel).Query
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                reply = query(request, timeout=10)
            except grpc.RpcError as ex:
                if ex.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                    raise SystemExit(f"gRPC Query answered {ex}") from ex
                limited += 1
                continue
            assert reply.ok, reply
            lat.append(time.perf_counter() - t0)
    out.append((limited, lat))


CLIENTS = {"ipc": ipc_client, "http": http_client, "grpc": grpc_client}


def grpc_built() -> bool:
    """Whether this Python has the grpc extra (the engine runs with the same one)."""
    try:
        import grpc  # noqa: F401

        from spliceway.api.grpc_gen import control_pb2_grpc  # noqa: F401
    except ImportError:
        return False
    return True


def run(kind: str, target: str | int, clients: int, seconds: float) -> dict:
    """``clients`` threads of ``kind`` for ``seconds``; the totals."""
    out: list[tuple[int, list[float]]] = []
    fn = CLIENTS[kind]
    threads = [threading.Thread(target=fn, args=(target, seconds, out)) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    wall = time.monotonic() - t0
    lat = sorted(x for _, xs in out for x in xs)
    limited = sum(n for n, _ in out)
    return {
        "transport": kind,
        "clients": clients,
        "answered": len(lat),
        "per_s": round(len(lat) / wall, 1),
        "rate_limited": limited,
        "p50_ms": round(1000 * statistics.median(lat), 3) if lat else None,
        "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Run both transports with 1 and 8 clients; print a table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    sock_dir = tempfile.mkdtemp(prefix="sw-ipc-")  # short: AF_UNIX paths are 108 bytes
    path = os.path.join(sock_dir, "control.sock")
    results = []
    with_grpc = grpc_built()
    if not with_grpc:
        print("no grpc extra here (pip install -e '.[grpc]'): gRPC is left out")
    with tempfile.TemporaryDirectory() as tmp:
        config = {
            "inbounds": [e2e.socks_inbound()],
            "outbounds": [{"tag": "direct", "protocol": "direct"}],
            "api": {
                "control": bc.control_api(),
                "ipc": {"enabled": True, "path": path},
                "grpc": {"enabled": with_grpc},
            },
        }
        engine = bc.Engine("ipc-bench", config, Path(tmp), Path(tmp) / "engine.log")
        try:
            targets: list[tuple[str, str | int]] = [("ipc", path), ("http", engine.api_port)]
            if with_grpc:
                # Logged before the control API's line, which the engine start waited for.
                found = engine.m.wait_for(GRPC_RE, 10)
                if found is None:
                    engine.m.abort("the engine did not log its gRPC address")
                targets.append(("grpc", f"{found.group(1)}:{found.group(2)}"))
            for clients in (1, 8):
                for kind, target in targets:
                    results.append(run(kind, target, clients, args.seconds))
        finally:
            engine.m.stop(10)
            shutil.rmtree(sock_dir, ignore_errors=True)
    print(
        f"{'transport':<10}{'clients':>8}{'answered/s':>12}{'limited':>9}{'p50 ms':>9}{'p99 ms':>9}"
    )
    for r in results:
        print(
            f"{r['transport']:<10}{r['clients']:>8}{r['per_s']:>12}{r['rate_limited']:>9}"
            f"{r['p50_ms']!s:>9}{r['p99_ms']!s:>9}"
        )
    out = e2e.ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ipc.json").write_text(json.dumps({"seconds": args.seconds, "runs": results}, indent=1))
    print(f"results: {out / 'ipc.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
