#!/usr/bin/env python3
"""What the flow hook costs per flow: connection rate and latency with and without it.

    python benchmarks/bench_flow_hook.py [--quick] [--reps 5] [--seconds 3] [--conc 1,16]

Three engines run side by side on 127.0.0.1 (one ``socks5`` inbound, ``direct``,
control API and IPC off, as run_e2e.py starts them), measured in the same run,
interleaved (a b c, c b a, ...):

- **c-path**: no hook. The C connection path accepts, routes and dials every flow.
- **python-path**: no hook, but an opaque first rule (``domain_regex`` that never
  matches), so C hands every flow to Python after its handshake: what a hooked flow
  pays without the hook itself.
- **hook**: ``api.flow_hook`` on benchmarks/flowhook_fast.c, a C epoll hook that
  allows everything (it answers each request as it reads it, without parsing the
  flow record), so the hook process costs next to nothing and what is measured is the
  engine's side: the deferral to Python, the ask (one JSON line out, one in) and the
  wait.

Load: ``loadgen rate`` through the SOCKS5 inbound to tinyserver (100 B request,
1 KiB response, the server closes), ``--conc`` connections in flight, each run
``--seconds`` long after 0.5 s of warm-up; one unrecorded 1 s run per engine first.
Per run: conn/s, p50/p99 latency per connection (connect to EOF), and the CPU the
engine (and the hook) used per connection (utime + stime from /proc). The table
gives the median of the runs; "added" is hook minus c-path, split into the
deferral (python-path minus c-path) and the ask (hook minus python-path). The hook's
request count is checked against the connections the hook engine served.

Bounded: every run stops at its duration (loadgen) and is killed after 60 s; the
whole default run takes about 2 minutes (``--quick``: about 20 s). Output: the table
on stdout, progress on stderr, every run in
benchmarks/results/<timestamp>-flow-hook.json with the engines' logs beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_e2e as e2e

VARIANTS = ("c-path", "python-path", "hook")
#: A rule C cannot check (domain_regex): reaching it defers every flow to Python.
NEVER = {"domain_regex": ["^never\\.invalid$"], "outbound": "direct"}


def engine_config(variant: str, hook_path: Path) -> dict[str, Any]:
    """The engine of ``variant``: run_e2e's, plus the opaque rule or the hook."""
    cfg = json.loads(json.dumps(e2e.SPLICEWAY_CONFIG))
    cfg["runtime"] = {"stats_interval_ms": 60_000}
    if variant == "python-path":
        cfg["rules"] = [NEVER]
    elif variant == "hook":
        cfg["api"]["flow_hook"] = {"path": str(hook_path), "timeout_ms": 1000}
    return cfg


def build_hook(cc: str) -> Path:
    """benchmarks/build/flowhook_fast, rebuilt when its source is newer."""
    return e2e.build_tool(cc, "flowhook_fast")


class Hook:
    """flowhook_fast as a child process."""

    def __init__(self, exe: Path, path: Path) -> None:
        self.m = e2e.Managed("flowhook_fast", [str(exe), str(path)], stdout=subprocess.PIPE)
        assert self.m.proc.stdout is not None
        if self.m.proc.stdout.readline().strip() != "ready":
            self.m.abort("flowhook_fast did not start")

    def cpu(self) -> float:
        return e2e.proc_cpu_s(self.m.pid)

    def stop(self) -> dict[str, Any]:
        """Stop it; its final counts."""
        self.m.proc.terminate()
        out, _ = self.m.proc.communicate(timeout=10)
        return json.loads(out.strip().splitlines()[-1])


#: One engine as its own process, and its socks5 port.
Engine = e2e.EngineProcess


def rate(
    loadgen: Path, target: int, engine: Engine, conc: int, seconds: float, warmup: float
) -> dict[str, Any]:
    """One loadgen rate run through ``engine``: its JSON result."""
    argv = e2e.rate_argv(target, engine.port, conc, seconds, 1)
    if warmup:
        argv += ["--warmup", str(warmup)]
    return e2e.run_loadgen([str(loadgen), *argv], timeout=seconds + warmup + 60)


def measure(
    loadgen: Path,
    target: int,
    engine: Engine,
    hook: Hook | None,
    conc: int,
    seconds: float,
) -> dict[str, Any]:
    """One recorded run: loadgen's figures plus CPU per connection."""
    cpu0 = engine.cpu()
    hook0 = hook.cpu() if hook is not None else 0.0
    load0 = os.getloadavg()[0]
    res = rate(loadgen, target, engine, conc, seconds, 0.5)
    # Every connection of the run, warm-up included, used the engine's CPU.
    total = res["count"] + res.get("warmup_count", 0)
    res["engine_cpu_us"] = (engine.cpu() - cpu0) * 1e6 / max(total, 1)
    if hook is not None:
        res["hook_cpu_us"] = (hook.cpu() - hook0) * 1e6 / max(total, 1)
    res["loadavg_before"] = load0
    return res


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over runs of one variant and concurrency."""
    return e2e.flow_medians(runs, "hook_cpu_us")


def report(results: dict[str, Any]) -> str:
    """The table."""
    lines = [
        f"flow hook cost ({results['meta']['nproc']} CPUs, {results['meta']['reps']} runs of "
        f"{results['meta']['seconds']} s each, medians)",
        "",
        f"{'conc':>4}  {'variant':<12} {'conn/s':>8} {'p50 us':>8} {'p99 us':>8} "
        f"{'engine CPU us/conn':>19} {'hook CPU us/conn':>17}",
    ]
    for conc, by_variant in results["summary"].items():
        for variant in VARIANTS:
            s = by_variant[variant]
            hook = f"{s['hook_cpu_us']:17.1f}" if "hook_cpu_us" in s else f"{'-':>17}"
            lines.append(
                f"{conc:>4}  {variant:<12} {s['conn_per_s']:8.0f} {s['p50_us']:8.0f} "
                f"{s['p99_us']:8.0f} {s['engine_cpu_us']:19.1f} {hook}"
            )
        c, p, h = (by_variant[v] for v in VARIANTS)
        lines.append(
            f"      added by the hook: p50 {h['p50_us'] - c['p50_us']:+.0f} us "
            f"(deferral {p['p50_us'] - c['p50_us']:+.0f}, ask {h['p50_us'] - p['p50_us']:+.0f}); "
            f"engine CPU {h['engine_cpu_us'] - c['engine_cpu_us']:+.1f} us/conn "
            f"(deferral {p['engine_cpu_us'] - c['engine_cpu_us']:+.1f}, "
            f"ask {h['engine_cpu_us'] - p['engine_cpu_us']:+.1f}); "
            f"conn/s x{h['conn_per_s'] / c['conn_per_s']:.2f}"
        )
    lines.append("")
    lines.append(
        f"hook requests {results['hook']['requests']} for {results['hook_engine_conns']} "
        f"connections through the hook engine (bad {results['hook']['bad']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    e2e.add_run_options(ap, reps=5)
    a = ap.parse_args(argv)
    if a.quick:
        a.reps, a.seconds = 1, 2.0
    concs = [int(x) for x in a.conc.split(",")]
    tools = e2e.build_tools(a.cc)
    hook_exe = build_hook(a.cc)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    e2e.RESULTS.mkdir(exist_ok=True)
    out = e2e.RESULTS / f"{stamp}-flow-hook.logs"
    out.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="swbh-", dir="/tmp"))  # short: an AF_UNIX path
    hook_path = tmp / "hook.sock"
    server = e2e.Server(tools["tinyserver"], None, 900, 1)
    hook = Hook(hook_exe, hook_path)
    engines: dict[str, Engine] = {}
    results: dict[str, Any] = {"runs": [], "summary": {}}
    try:
        for variant in VARIANTS:
            engines[variant] = Engine(variant, engine_config(variant, hook_path), tmp, out)
        hook_conns = 0
        for variant, engine in engines.items():
            e2e.log(f"warm-up {variant}")
            warm = rate(tools["loadgen"], server.rate, engine, 4, 1.0, 0)
            hook_conns += warm["count"] if variant == "hook" else 0
        order = list(VARIANTS)
        for conc in concs:
            for rep in range(a.reps):
                for variant in order:
                    res = measure(
                        tools["loadgen"],
                        server.rate,
                        engines[variant],
                        hook if variant == "hook" else None,
                        conc,
                        a.seconds,
                    )
                    res.update(variant=variant, conc=conc, rep=rep)
                    results["runs"].append(res)
                    if variant == "hook":
                        hook_conns += res["count"] + res.get("warmup_count", 0)
                    e2e.log(
                        f"conc {conc} rep {rep} {variant}: {res['conn_per_s']:.0f} conn/s, "
                        f"p50 {res['lat_us']['p50']:.0f} us, p99 {res['lat_us']['p99']:.0f} us"
                    )
                order.reverse()
            results["summary"][conc] = {
                v: summary([r for r in results["runs"] if r["conc"] == conc and r["variant"] == v])
                for v in VARIANTS
            }
        results["hook_engine_conns"] = hook_conns
    finally:
        results["engines"] = {v: e.stop() for v, e in engines.items()}
        results["hook"] = hook.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["meta"] = {
        "nproc": os.cpu_count(),
        "reps": a.reps,
        "seconds": a.seconds,
        "concurrency": concs,
        "python": platform.python_version(),
        "loadavg_end": os.getloadavg(),
        "launch": next(iter(engines.values())).launch if engines else None,
        "git": e2e.git_head(),
    }
    path = e2e.RESULTS / f"{stamp}-flow-hook.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    print(f"\nresults: {path}")
    if results["hook"]["requests"] < results["hook_engine_conns"]:
        print("the hook saw fewer requests than the hook engine served flows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
