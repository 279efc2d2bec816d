"""Route lookup cost: the C route table (csrc/route.c) vs spliceway.routing.rules.decide.

Configs of N ``domain_suffix`` rules (one suffix each, ``s<i>.zone<i % 13>.test``), then
lookups of hosts that hit a rule spread over the list (``www.s<i>.zone<i % 13>.test``) and
hosts that hit nothing (``www.n<i>.zone<i % 13>.test``, so they share every suffix
but the rule's own). Reports ns per lookup:

- ``python``: routing.decide on a prebuilt FlowFacts;
- ``c via cffi``: sw_table_decide on a prebuilt query, called from Python, and the same
  minus the cost of a trivial cffi call (sw_table_epoch) in the same loop, which is
  close to what the C connection path pays.

Run: ``python benchmarks/bench_route.py [N ...]`` (default 1000 10000).
"""

from __future__ import annotations

import sys
import time

from spliceway._relay import ffi, lib
from spliceway.config import Rule
from spliceway.native.route import (
    NO_INBOUND,
    NO_PRINCIPAL,
    OUT_DEFER,
    OUT_DIRECT,
    TargetSpec,
    compile_route_table,
)
from spliceway.routing import rules as routing

HOSTS = 1000


def _rules(n):
    return [
        Rule.model_validate({"domain_suffix": f"s{i}.zone{i % 13}.test", "outbound": "proxy"})
        for i in range(n)
    ]


def _hosts(n, hit):
    step = max(1, n // HOSTS)
    prefix = "s" if hit else "n"
    return [f"www.{prefix}{i}.zone{i % 13}.test" for i in range(0, n, step)][:HOSTS]


def _best_ns(fn, loops, repeat=9):
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(loops)
        dt = (time.perf_counter_ns() - t0) / loops
        best = dt if best is None else min(best, dt)
    return best


def bench(n):
    rules = _rules(n)
    t0 = time.perf_counter()
    ruleset = routing.compile_rules(rules)
    t_py_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    routes = compile_route_table(
        rules,
        mode_kind="rule",
        mode_outbound=None,
        final="direct",
        targets={"direct": TargetSpec(OUT_DIRECT), "proxy": TargetSpec(OUT_DEFER)},
        inbounds={},
        principals={},
        epoch=1,
        ruleset=ruleset,
    )
    t_c_compile = time.perf_counter() - t0
    table = routes.table
    print(f"\n{n} domain_suffix rules: compile_rules {t_py_compile * 1e3:.0f} ms, ", end="")
    print(f"compile_route_table (incl. seal) {t_c_compile * 1e3:.0f} ms")
    for hit in (True, False):
        hosts = _hosts(n, hit)
        facts = [routing.FlowFacts(network="tcp", host=h, port=443) for h in hosts]
        keep = []
        queries = []
        for h in hosts:
            data = ffi.new("char[]", h.encode())
            q = ffi.new("sw_route_query *")
            q.host, q.host_len, q.port, q.network = data, len(h), 443, lib.SW_NET_TCP
            q.inbound, q.principal = NO_INBOUND, NO_PRINCIPAL
            keep.append(data)
            queries.append(q)
        out = ffi.new("sw_route_result *")
        # Correctness first: the C answers are Python's.
        for f, q in zip(facts, queries, strict=True):
            assert lib.sw_table_decide(table, q, out) == 0
            assert routes.decision(out.action, out.rule, out.target) == routing.decide(
                ruleset, "rule", None, "direct", f
            )

        def py(loops, facts=facts):
            decide, m = routing.decide, len(facts)
            for i in range(loops):
                decide(ruleset, "rule", None, "direct", facts[i % m])

        def c(loops, queries=queries, out=out):
            decide, m = lib.sw_table_decide, len(queries)
            for i in range(loops):
                decide(table, queries[i % m], out)

        def baseline(loops, queries=queries):
            epoch, m = lib.sw_table_epoch, len(queries)
            for i in range(loops):
                epoch(table)
                queries[i % m]  # the same indexing as c()

        py_loops = 200 if n >= 10000 else 2000
        ns_py = _best_ns(py, py_loops, repeat=3)
        ns_c = _best_ns(c, 200_000)
        ns_base = _best_ns(baseline, 200_000)
        kind = "hit " if hit else "miss"
        print(
            f"  {kind}: python {ns_py:10.0f} ns/lookup | c via cffi {ns_c:6.0f} ns/lookup"
            f" | c minus cffi call {max(ns_c - ns_base, 0):5.0f} ns/lookup"
        )
    routes.close()


def main(argv):
    sizes = [int(a) for a in argv] or [1000, 10000]
    print(f"{sys.implementation.name} {sys.version.split()[0]}; best of several runs")
    for n in sizes:
        bench(n)


if __name__ == "__main__":
    main(sys.argv[1:])
