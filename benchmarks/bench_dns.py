#!/usr/bin/env python3
"""The engine's DNS server against dnsmasq: cached answers per second and latency.

    python benchmarks/bench_dns.py [--quick] [--reps 3] [--seconds 3] [--inflight 1,16,64]

Three servers run side by side on 127.0.0.1, measured in the same run, interleaved
(a b c, c b a, ...):

- **dnsmasq**: Debian's dnsmasq with a cache (``--cache-size=10000``, no hosts file,
  no resolv.conf), forwarding to the zone server below.
- **spliceway**: the engine as its own process (``spliceway run``, one socks5 inbound,
  control API and IPC off) with ``runtime.dns.listen``, ``answer.type: real``, the
  resolver asking the zone server, ``cache.max_entries`` 10000, and no
  ``client_rate_limit`` (the load comes from one address).
- **spliceway-fakeip**: the same with ``answer.type: fake_ip`` (no upstream at all).

The zone: ``n0.bench.test`` .. ``n99.bench.test`` (A, TTL 3600), served by a small
authoritative dnspython server in this process (tests/helpers/dnsserver.py). Every
server first gets a 1 s unrecorded run, so each name is in its cache: what is measured
is the cached path (the upstream is asked again only when an entry expires, which it
does not within a run).

Load: benchmarks/dnsload.c (built with ``cc -O2`` into benchmarks/build/), a C
generator keeping ``--inflight`` A queries in flight on one UDP socket (no EDNS, RD,
the names in turn), sending and receiving in sendmmsg/recvmmsg batches so it is not
the bottleneck; each answer is timed from its query's send. Per run (``--seconds``
after 0.5 s of warm-up): answers/s, p50/p99 latency, and the CPU the server used per
query (utime + stime from /proc). The table gives the median of the runs and the
ratio to dnsmasq.

``--flows`` measures instead where the server's loop should run: an engine in this
process (one socks5 inbound, the C connection path) serves TCP flows
(``loadgen rate``, 16 in flight, to tinyserver) while its DNS server answers cached
queries (dnsload, 16 in flight, no rate limit), with the server on the dispatcher's
loop (where the flows' actors run) and on a thread of its own (what the engine does);
each alone, then both at once, for both placements.

Bounded: every run stops at its duration and is killed after 60 s; the default takes
about 2 minutes (``--quick``: about 25 s; ``--flows``: about 40 s). Output: the table
on stdout, progress on stderr, every run in benchmarks/results/<timestamp>-dns.json
with the servers' logs beside it (``--flows``: the table only).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_e2e as e2e

sys.path.insert(0, str(e2e.ROOT))
from tests.helpers.dnsserver import DnsServer

VARIANTS = ("dnsmasq", "spliceway", "spliceway-fakeip")
NAMES = 100
SUFFIX = "bench.test"
DNS_RE = re.compile(r"DNS server listening on ([0-9.]+):(\d+)")


def build_dnsload(cc: str) -> Path:
    """benchmarks/build/dnsload, rebuilt when its source is newer."""
    return e2e.build_tool(cc, "dnsload")


class Server:
    """One DNS server under test, as its own process: its port and CPU time."""

    def __init__(self, variant: str, zone_port: int, tmp: Path, out: Path) -> None:
        self.variant = variant
        if variant == "dnsmasq":
            self.port = e2e.free_port()
            cmd = [
                "dnsmasq",
                "--no-daemon",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                f"--server=127.0.0.1#{zone_port}",
                f"--port={self.port}",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--cache-size=10000",
                "--user=root",
            ]
            self.m = e2e.Managed("dnsmasq", cmd)
            self.m.keep_log(out / "dnsmasq.log")
            if not self.m.alive() and self.m.proc.wait(1) is not None:
                self.m.abort("dnsmasq did not start")
            self.launch = "dnsmasq"
            return
        answer = {"type": "fake_ip"} if variant == "spliceway-fakeip" else {"type": "real"}
        cfg = json.loads(json.dumps(e2e.SPLICEWAY_CONFIG))
        cfg["runtime"] = {
            "stats_interval_ms": 60_000,
            "dns": {
                "servers": [f"udp://127.0.0.1:{zone_port}"],
                "cache": {"max_entries": 10000},
                "answer": answer,
                "listen": {"address": "127.0.0.1", "port": 0},
                # One client asks everything: the server is measured, not its limit.
                "client_rate_limit": None,
            },
        }
        self.m, self.launch = e2e.start_spliceway(
            cfg, tmp / f"{variant}.json", out / f"{variant}.log"
        )
        self.port = self.m.reported_port(
            DNS_RE, f"{variant}: spliceway did not report its DNS server"
        )

    def cpu(self) -> float:
        return e2e.proc_cpu_s(self.m.pid)

    def stop(self) -> dict[str, Any]:
        return self.m.finish()


def load(exe: Path, server: Server, inflight: int, seconds: float, warmup: float) -> dict:
    """One dnsload run against ``server``: its JSON line."""
    argv = [
        str(exe),
        "--target",
        f"127.0.0.1:{server.port}",
        "--inflight",
        str(inflight),
        "--duration",
        str(seconds),
        "--warmup",
        str(warmup),
        "--names",
        str(NAMES),
        "--suffix",
        SUFFIX,
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=seconds + warmup + 60, check=True
    )
    return json.loads(done.stdout)


def measure(exe: Path, server: Server, inflight: int, seconds: float) -> dict[str, Any]:
    """One recorded run: dnsload's figures plus the server's CPU per query."""
    cpu0 = server.cpu()
    res = load(exe, server, inflight, seconds, 0.5)
    res["server_cpu_us"] = (server.cpu() - cpu0) * 1e6 / max(res["answered"], 1)
    return res


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    med = statistics.median
    return {
        "qps": med(r["qps"] for r in runs),
        "p50_us": med(r["p50_us"] for r in runs),
        "p99_us": med(r["p99_us"] for r in runs),
        "server_cpu_us": med(r["server_cpu_us"] for r in runs),
        "lost": sum(r["lost"] for r in runs),
        "not_noerror": sum(r["other_rcode"] for r in runs),
        "runs": len(runs),
    }


def report(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"cached A answers over UDP, {NAMES} names ({meta['nproc']} CPUs, {meta['reps']} runs "
        f"of {meta['seconds']} s each, medians)",
        "",
        f"{'inflight':>8}  {'server':<17} {'answers/s':>10} {'p50 us':>7} {'p99 us':>7} "
        f"{'CPU us/query':>13} {'x dnsmasq':>10}",
    ]
    for inflight, by_variant in results["summary"].items():
        base = by_variant["dnsmasq"]["qps"]
        for variant in VARIANTS:
            s = by_variant[variant]
            lines.append(
                f"{inflight:>8}  {variant:<17} {s['qps']:10.0f} {s['p50_us']:7.0f} "
                f"{s['p99_us']:7.0f} {s['server_cpu_us']:13.2f} {s['qps'] / base:10.2f}"
            )
        bad = {
            v: (s["lost"], s["not_noerror"])
            for v, s in by_variant.items()
            if any((s["lost"], s["not_noerror"]))
        }
        if bad:
            lines.append(f"          lost / not NOERROR: {bad}")
    return "\n".join(lines)


def flows_experiment(exe: Path, cc: str, seconds: float) -> dict[str, Any]:
    """Flows and DNS answers per second, alone and together, for both placements."""
    from spliceway import Engine
    from spliceway.dns.server import DnsResponder, bind_dns
    from spliceway.dns.server import DnsServer as EngineDnsServer

    tools = e2e.build_tools(cc)
    target = e2e.Server(tools["tinyserver"], None, 900, 1)
    zone = DnsServer({f"n{i}.{SUFFIX}": ["10.0.0.1"] for i in range(NAMES)}, ttl=3600)
    cfg = json.loads(json.dumps(e2e.SPLICEWAY_CONFIG))
    cfg["runtime"] = {
        "stats_interval_ms": 60_000,
        "dns": {"servers": [f"udp://127.0.0.1:{zone.port}"], "cache": {"max_entries": 10000}},
    }
    engine = Engine(cfg)
    engine.start()
    core = engine.core
    socks_port = engine.listen_address()[1]
    loadgen = [str(tools["loadgen"]), *e2e.rate_argv(target.rate, socks_port, 16, seconds, 1)]
    out: dict[str, Any] = {}
    try:
        for placement in ("own-thread", "dispatcher"):
            udp, tcp = bind_dns("127.0.0.1", 0)
            responder = DnsResponder(lambda: core.resolver, lambda: None)
            loop = None if placement == "own-thread" else core.dispatcher
            server = EngineDnsServer(udp, tcp, responder, dispatcher=loop)
            server.start()

            class _Port:
                port = server.bound[1]

            try:
                load(exe, _Port, 4, 1.0, 0)  # type: ignore[arg-type]
                flows = e2e.run_loadgen(loadgen, timeout=seconds + 60)
                dns_alone = load(exe, _Port, 16, seconds, 0.5)  # type: ignore[arg-type]
                argv = [
                    str(exe), "--target", f"127.0.0.1:{_Port.port}", "--inflight", "16",
                    "--duration", str(seconds), "--warmup", "0.5",
                    "--names", str(NAMES), "--suffix", SUFFIX,
                ]  # fmt: skip
                dns_proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
                both_flows = e2e.run_loadgen(loadgen, timeout=seconds + 60)
                dns_out, _ = dns_proc.communicate(timeout=seconds + 60)
                both_dns = json.loads(dns_out)
            finally:
                server.stop()
            out[placement] = {
                "flows_alone_conn_per_s": flows["conn_per_s"],
                "dns_alone_qps": dns_alone["qps"],
                "flows_with_dns_conn_per_s": both_flows["conn_per_s"],
                "flows_with_dns_p99_us": both_flows["lat_us"]["p99"],
                "flows_alone_p99_us": flows["lat_us"]["p99"],
                "dns_with_flows_qps": both_dns["qps"],
                "dns_with_flows_p99_us": both_dns["p99_us"],
            }
            e2e.log(f"{placement}: {out[placement]}")
    finally:
        engine.stop()
        zone.close()
        target.stop()
    return out


def flows_report(out: dict[str, Any]) -> str:
    lines = [
        "TCP flows (loadgen rate, 16 in flight) and cached DNS answers (16 in flight), one engine",
        "",
        f"{'DNS server loop':<16} {'flows alone':>12} {'DNS alone':>10} "
        f"{'flows + DNS':>12} {'DNS + flows':>12} {'flow p99 us':>12} {'DNS p99 us':>11}",
    ]
    for placement, r in out.items():
        lines.append(
            f"{placement:<16} {r['flows_alone_conn_per_s']:12.0f} {r['dns_alone_qps']:10.0f} "
            f"{r['flows_with_dns_conn_per_s']:12.0f} {r['dns_with_flows_qps']:12.0f} "
            f"{r['flows_with_dns_p99_us']:12.0f} {r['dns_with_flows_p99_us']:11.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    e2e.add_run_options(
        ap, reps=3, per="server and inflight", spread=("--inflight", "1,16,64", "queries in flight")
    )
    ap.add_argument(
        "--flows", action="store_true", help="flows and DNS on one engine, per server loop"
    )
    a = ap.parse_args(argv)
    if a.flows:
        result = flows_experiment(build_dnsload(a.cc), a.cc, a.seconds)
        print(flows_report(result))
        return 0
    if a.quick:
        a.reps, a.seconds = 1, 2.0
    if shutil.which("dnsmasq") is None:
        raise SystemExit("dnsmasq is missing: apt-get install dnsmasq")
    inflights = [int(x) for x in a.inflight.split(",")]
    exe = build_dnsload(a.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    e2e.RESULTS.mkdir(exist_ok=True)
    out = e2e.RESULTS / f"{stamp}-dns.logs"
    out.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="swdns-"))
    zone = DnsServer({f"n{i}.{SUFFIX}": ["10.0.0.1"] for i in range(NAMES)}, ttl=3600)
    servers: dict[str, Server] = {}
    results: dict[str, Any] = {"runs": [], "summary": {}}
    try:
        for variant in VARIANTS:
            servers[variant] = Server(variant, zone.port, tmp, out)
        for variant, server in servers.items():
            e2e.log(f"warm-up {variant}")
            warm = load(exe, server, 4, 1.0, 0)
            if warm["recorded"] == 0:
                raise SystemExit(f"{variant} answered nothing")
        order = list(VARIANTS)
        for inflight in inflights:
            for rep in range(a.reps):
                for variant in order:
                    res = measure(exe, servers[variant], inflight, a.seconds)
                    res.update(variant=variant, rep=rep)
                    results["runs"].append(res)
                    e2e.log(
                        f"inflight {inflight} rep {rep} {variant}: {res['qps']:.0f}/s, "
                        f"p50 {res['p50_us']:.0f} us, p99 {res['p99_us']:.0f} us"
                    )
                order.reverse()
            results["summary"][inflight] = {
                v: summary(
                    [r for r in results["runs"] if r["inflight"] == inflight and r["variant"] == v]
                )
                for v in VARIANTS
            }
    finally:
        results["servers"] = {v: s.stop() for v, s in servers.items()}
        zone.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results["zone_queries"] = zone.count()
    dnsmasq_version = subprocess.run(
        ["dnsmasq", "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    results["meta"] = {
        "stamp": stamp,
        "nproc": os.cpu_count(),
        "reps": a.reps,
        "seconds": a.seconds,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "dnsmasq": dnsmasq_version[0] if dnsmasq_version else "?",
        "launch": servers["spliceway"].launch if "spliceway" in servers else None,
        "git": e2e.git_head(),
    }
    text = report(results)
    print(text)
    path = e2e.RESULTS / f"{stamp}-dns.json"
    path.write_text(json.dumps(results, indent=1))
    e2e.log(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
