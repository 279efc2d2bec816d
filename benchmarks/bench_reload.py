#!/usr/bin/env python3
"""``config.apply`` of a large configuration while flows run: time to reconciled, flows lost.

    python benchmarks/bench_reload.py [--rate 1000] [--applies 10] [--rules 1000] [--groups 10]

One engine (``python -m spliceway run``: a socks5 inbound, IPC on a socket in a
temporary directory, no HTTP API) with a configuration of ``--rules`` domain
rules and ``--groups`` groups (selectors and url_test groups over direct
outbounds). The C load generator opens ``--rate`` new connections per second
through the socks5 inbound to tinyserver (100-byte request, 1 KiB answer), and
while it runs this script sends ``--applies`` ``config.apply`` commands over
IPC, alternating two documents that differ in every part an apply reconciles:
rules (the first and last rule changed), one group's members, an added
listener, a sink added and removed, the stats interval.

Reported: per apply, the wall time from sending the command to the
``reconciled: true`` answer (p50, max); the load generator's connections,
errors and unfinished ones; the engine's ``failed_sessions`` (must be 0) and
``completed_sessions``. The engine's time to apply the same document when idle
is reported beside it, for comparison.

Every server listens on 127.0.0.1 or a Unix socket in a temporary directory, every
loop is bounded in count and time, and only processes this script started are
stopped.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run_e2e as e2e  # noqa: E402


class Ipc:
    """One IPC connection: a request and its reply at a time."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(path)
        self.reader = self.sock.makefile("rb")
        self.n = 0

    def call(self, frame: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        self.sock.sendall(json.dumps({"id": self.n, **frame}).encode() + b"\n")
        reply = json.loads(self.reader.readline())
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        (result,) = reply["result"].values()
        return result

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def documents(rules: int, groups: int, ipc_path: str, tmp: Path) -> tuple[dict, dict]:
    """Two configurations that differ in every reconciled part."""
    outbounds = [{"tag": f"out-{i}", "protocol": "direct"} for i in range(4)]
    group_list = []
    for g in range(groups):
        kind = "selector" if g % 2 == 0 else "url_test"
        group: dict[str, Any] = {
            "tag": f"group-{g}",
            "kind": kind,
            "outbounds": [o["tag"] for o in outbounds],
        }
        if kind == "url_test":
            group["url"] = "http://127.0.0.1:9/"  # nothing listens: probes fail fast
            group["interval_seconds"] = 3600
        group_list.append(group)
    a = {
        "inbounds": [{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}],
        "outbounds": outbounds,
        "outbound_groups": group_list,
        "rules": [
            {"domain_suffix": [f"host{i}.example"], "outbound": f"group-{i % groups}"}
            for i in range(rules)
        ],
        "route": {"final": "direct"},
        "runtime": {"stats_interval_ms": 1000},
        "api": {
            "control": {"enabled": False},
            "ipc": {"enabled": True, "path": ipc_path},
            "outbox_path": str(tmp / "outbox"),
        },
    }
    b = copy.deepcopy(a)
    b["rules"][0]["domain_suffix"] = ["changed.example"]
    b["rules"][-1]["outbound"] = "direct"
    b["outbound_groups"][0]["outbounds"] = ["out-1", "out-0"]
    b["inbounds"].append({"tag": "extra", "protocol": "http", "listen": {"port": 0}})
    b["api"]["event_sinks"] = [{"type": "jsonl", "tag": "j", "path": str(tmp / "j.jsonl")}]
    b["runtime"]["stats_interval_ms"] = 500
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=1000, help="new connections per second")
    ap.add_argument("--applies", type=int, default=10)
    ap.add_argument("--rules", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args()
    tools = e2e.build_tools(args.cc)
    tmp = Path(tempfile.mkdtemp(prefix="sw-reload-"))
    ipc_path = str(tmp / "control.sock")
    a, b = documents(args.rules, args.groups, ipc_path, tmp)
    origin = e2e.Managed(
        "tinyserver",
        [str(tools["tinyserver"]), "--rate", "0", "--max-seconds", "300"],
        stdout=subprocess.PIPE,
    )
    engine = None
    try:
        assert origin.proc.stdout is not None
        rate_port = json.loads(origin.proc.stdout.readline())["rate"]
        engine, _ = e2e.start_spliceway(a, tmp / "config.json", tmp / "engine.log")
        match = engine.wait_for(e2e.LISTEN_RE, 30)
        if match is None:
            engine.abort("the engine did not report its socks5 port")
        socks_port = int(match.group(2))
        deadline = time.monotonic() + 10
        while not os.path.exists(ipc_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        ipc = Ipc(ipc_path)

        # Idle: the same applies with no traffic.
        idle = []
        for n in range(args.applies):
            t0 = time.perf_counter()
            result = ipc.call(
                {"command": {"method": "config.apply", "params": {"config": (b, a)[n % 2]}}}
            )
            idle.append(time.perf_counter() - t0)
            assert result["reconciled"] is True
        before = ipc.call({"stats": {}})

        # Under load: the applies spread over the load's middle.
        duration = max(6.0, args.applies * 0.5 + 3)
        argv = [str(tools["loadgen"]), *e2e.rate_argv(rate_port, socks_port, 256, duration, 1)]
        argv += ["--rate", str(args.rate)]
        load = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        timings: list[float] = []
        changed: list[list[str]] = []

        def applier() -> None:
            time.sleep(1.5)  # let the load reach its rate first
            for n in range(args.applies):
                t0 = time.perf_counter()
                result = ipc.call(
                    {"command": {"method": "config.apply", "params": {"config": (b, a)[n % 2]}}}
                )
                timings.append(time.perf_counter() - t0)
                changed.append(result["changed_components"])
                time.sleep(0.3)

        worker = threading.Thread(target=applier)
        worker.start()
        out, _ = load.communicate(timeout=duration + 60)
        worker.join(60)
        report = json.loads(out)
        deadline = time.monotonic() + 10
        while ipc.call({"stats": {}})["active_sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = ipc.call({"stats": {}})
        ipc.close()
    finally:
        if engine is not None:
            engine.stop(10)
        origin.stop(5)
    summary = {
        "rules": args.rules,
        "groups": args.groups,
        "rate_per_s": args.rate,
        "applies": len(timings),
        "changed_components": changed[0] if changed else None,
        "apply_ms_idle": {
            "p50": round(statistics.median(idle) * 1000, 1),
            "max": round(max(idle) * 1000, 1),
        },
        "apply_ms_under_load": {
            "p50": round(statistics.median(timings) * 1000, 1) if timings else None,
            "max": round(max(timings) * 1000, 1) if timings else None,
        },
        "loadgen": {
            "count": report["count"],
            "conn_per_s": report["conn_per_s"],
            "unfinished": report["unfinished"],
            "errors": sum(report["errors"].values()),
            "error_kinds": {k: v for k, v in report["errors"].items() if v},
        },
        "engine_failed_sessions": after["failed_sessions"] - before["failed_sessions"],
        "engine_completed_sessions": after["completed_sessions"] - before["completed_sessions"],
    }
    print(json.dumps(summary, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)
    ok = summary["engine_failed_sessions"] == 0 and summary["loadgen"]["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
