"""Routing the host into the TUN: a policy table, ``ip rule``s, and cleaning them up.

The model is sing-tun's ``tun_linux.go`` (``routes()`` and ``rules()``): the routes
into the device live in their own table (:data:`~spliceway.tun.options.ROUTE_TABLE`),
never in ``main``, and a block of rules at distinctive priorities decides which
packets look that table up. The host's own routes are left untouched, so removing
the rules and flushing the table restores the host exactly.

The rules, for each captured family (``P`` = ``rule_base``, ``NOP`` = ``P + 19``)::

    P+0  fwmark <mark> goto NOP              the engine's own sockets leave normally
    P+1  iif <tun> goto NOP                  packets the stack wrote back: never re-captured
    P+2  ipproto udp|tcp dport 53 lookup D   dns_hijack: every port-53 query into the TUN
    P+3  to <exclude_cidr> goto NOP          exclude_cidrs stay on the host's routes
    P+4  unreachable                         strict_route, for a family the TUN lacks
    P+5  to <tun prefix> lookup T            the stack's replies to its second address
    P+6  lookup T suppress_prefixlength 0    include_cidrs win over the host's routes
    P+7  lookup main suppress_prefixlength 0 the host's specific (LAN) routes win over
                                             the TUN's default route
    P+8  (IPv4) not iif lo lookup T          forwarded traffic (the host as a gateway)
         (IPv4) from 0.0.0.0 iif lo lookup T local traffic before its source is chosen
         (IPv4/IPv6) from <tun prefix> iif lo lookup T
    P+9  (IPv6) from ::/1, 8000::/1 iif lo goto NOP
    P+10 (IPv6) lookup T
    P+19 nop

Local traffic is captured when its route is looked up *before* a source address is
chosen (an unbound socket): the kernel then picks the TUN's address as source, and
the packet follows the TUN. A socket already bound to a physical address (e.g. a
connection established before the TUN started) keeps its path. IPv6 needs the two
``from ::/1`` / ``from 8000::/1`` rules for the same effect, because an IPv6 rule with
a source prefix never matches a lookup without a source (``fib6_rule_match``).

Differences from sing-tun, and why:

- ``exclude_cidrs`` are rules (P+3), not a subtraction of prefixes from the table:
  an excluded network then takes the host's route, whatever it is, and the table's
  default route stays a default route (so P+7's "more specific host routes win" keeps
  meaning what it says).
- ``dns_hijack`` routes port 53 of *every* destination into the TUN through a table
  of its own (D = ``dns_table``), so it works with ``include_cidrs`` too; sing-tun
  only exempts port 53 from P+7.
- ``strict_route`` also puts an ``unreachable`` route behind each captured range in
  T (metric :data:`STRICT_METRIC`): when the device goes down or disappears its
  routes vanish, and without these the captured family would fall through to the
  physical interface. This makes strict_route a kill switch: after a crash the
  captured ranges stay unreachable until the next start (or
  ``python -m spliceway.tun.routing sweep``) removes the leftovers.
- The first rule exempts sockets carrying the engine's mark (SO_MARK), the loop
  avoidance of :mod:`spliceway.support.socket_mark` (sing-tun binds to the interface instead).

Everything added is recorded, before it is added, in a state file keyed by the
network namespace (:class:`HostState`), and every start first sweeps leftovers: the
recorded items, then every rule in the priority range and every route in the two
tables (a record lost with /run still cannot leave a rule behind).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import json
import os
import socket
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from spliceway.errors import ApiError
from spliceway.support.atomic_file import replace_file
from spliceway.tun.options import (
    DNS_TABLE,
    ROUTE_TABLE,
    RULE_PRIORITY_BASE,
    RULE_PRIORITY_SPAN,
    TunOptions,
)

#: Metric of strict_route's unreachable routes: behind any real route to the same
#: range, so they only answer once the device's routes are gone.
STRICT_METRIC = 0xFFFF_FF00

FIB_RULE_INVERT = 0x2
RT_TABLE_MAIN = 254
NOP_OFFSET = RULE_PRIORITY_SPAN - 1

_FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}
_VERSION = {socket.AF_INET: 4, socket.AF_INET6: 6}
# Netlink answers to deleting what is already gone (a route whose device vanished, a
# rule another sweep removed): success for a cleanup.
_GONE = (errno.ENOENT, errno.ESRCH, errno.ENODEV, errno.EADDRNOTAVAIL)


@dataclass(frozen=True, slots=True)
class Rule:
    """One policy routing rule, as netlink takes it."""

    family: int
    """4 or 6."""
    priority: int
    action: str
    """``table``, ``goto``, ``nop`` or ``unreachable``."""
    table: int | None = None
    goto: int | None = None
    fwmark: int | None = None
    iif: str | None = None
    src: str | None = None
    dst: str | None = None
    ip_proto: int | None = None
    dport: int | None = None
    suppress_prefixlen: int | None = None
    invert: bool = False
    """``not``: the whole selector negated."""

    def netlink(self) -> dict[str, Any]:
        """Keyword arguments of pyroute2's ``IPRoute.rule('add', ...)``."""
        kw: dict[str, Any] = {"family": _FAMILY[self.family], "priority": self.priority}
        if self.action == "table":
            kw["table"] = self.table
            kw["action"] = "FR_ACT_TO_TBL"
        elif self.action == "goto":
            kw["action"] = "FR_ACT_GOTO"
            kw["goto"] = self.goto
        elif self.action == "nop":
            kw["action"] = "FR_ACT_NOP"
        elif self.action == "unreachable":
            kw["action"] = "FR_ACT_UNREACHABLE"
        else:  # pragma: no cover - the plan builds only the four
            raise ValueError(self.action)
        if self.fwmark is not None:
            kw["fwmark"] = self.fwmark
            kw["fwmask"] = 0xFFFFFFFF
        if self.iif is not None:
            kw["iifname"] = self.iif
        for key in ("src", "dst"):
            cidr = getattr(self, key)
            if cidr is not None:
                net = ipaddress.ip_network(cidr, strict=False)
                kw[key] = str(net.network_address)
                kw[f"{key}_len"] = net.prefixlen
        if self.ip_proto is not None:
            kw["ip_proto"] = self.ip_proto
        if self.dport is not None:
            kw["dport_range"] = f"{self.dport}:{self.dport}"
        if self.suppress_prefixlen is not None:
            kw["suppress_prefixlen"] = self.suppress_prefixlen
        if self.invert:
            kw["flags"] = FIB_RULE_INVERT
        return kw

    def describe(self) -> str:
        """The rule as ``ip rule`` prints it (for logs, the state file and tests)."""
        parts = [f"{self.priority}:", "not" if self.invert else "", "from", self.src or "all"]
        if self.dst:
            parts += ["to", self.dst]
        if self.fwmark is not None:
            parts += ["fwmark", hex(self.fwmark)]
        if self.iif:
            parts += ["iif", self.iif]
        if self.ip_proto is not None:
            parts += ["ipproto", {6: "tcp", 17: "udp"}.get(self.ip_proto, str(self.ip_proto))]
        if self.dport is not None:
            parts += ["dport", str(self.dport)]
        if self.action == "table":
            parts += ["lookup", "main" if self.table == RT_TABLE_MAIN else str(self.table)]
        elif self.action == "goto":
            parts += ["goto", str(self.goto)]
        else:
            parts.append(self.action)
        if self.suppress_prefixlen is not None:
            parts += ["suppress_prefixlength", str(self.suppress_prefixlen)]
        return f"(v{self.family}) " + " ".join(p for p in parts if p)


@dataclass(frozen=True, slots=True)
class Route:
    """One route of the engine's tables: into the device, or unreachable."""

    family: int
    table: int
    dst: str
    kind: str = "dev"
    """``dev`` (through the TUN device) or ``unreachable``."""
    metric: int | None = None

    def netlink(self, ifindex: int | None) -> dict[str, Any]:
        """Keyword arguments of pyroute2's ``IPRoute.route('add', ...)``."""
        kw: dict[str, Any] = {"family": _FAMILY[self.family], "dst": self.dst, "table": self.table}
        if self.kind == "unreachable":
            kw["type"] = "unreachable"
        else:
            kw["oif"] = ifindex
        if self.metric is not None:
            kw["priority"] = self.metric
        return kw

    def describe(self) -> str:
        """The route as ``ip route`` prints it."""
        head = "unreachable " if self.kind == "unreachable" else ""
        dev = "" if self.kind == "unreachable" else " dev <tun>"
        metric = "" if self.metric is None else f" metric {self.metric}"
        return f"(v{self.family}) {head}{self.dst}{dev} table {self.table}{metric}"


@dataclass(frozen=True, slots=True)
class RoutingPlan:
    """Every route and rule one TUN adds (pure data: build it, print it, apply it)."""

    routes: tuple[Route, ...]
    rules: tuple[Rule, ...]

    def describe(self) -> list[str]:
        """Human-readable lines, routes first."""
        return [r.describe() for r in self.routes] + [r.describe() for r in self.rules]


def _plan_routes(opts: TunOptions, families: list[int]) -> list[Route]:
    """build_plan's routes: the TUN's table (its network, the included networks) and,
    with dns_hijack, the DNS table's default; each doubled by an unreachable route in
    strict mode."""
    table, dns_table, strict = opts.table, opts.dns_table, opts.strict_route
    routes: list[Route] = []
    for v in families:
        iface = opts.inet4 if v == 4 else opts.inet6
        assert iface is not None
        routes.append(Route(v, table, str(iface.network)))
        for net in opts.includes(v):
            routes.append(Route(v, table, str(net)))
            if strict:
                routes.append(Route(v, table, str(net), "unreachable", STRICT_METRIC))
        if opts.dns_hijack:
            default = "0.0.0.0/0" if v == 4 else "::/0"
            routes.append(Route(v, dns_table, default))
            if strict:
                routes.append(Route(v, dns_table, default, "unreachable", STRICT_METRIC))
    return routes


def build_plan(opts: TunOptions, ifname: str) -> RoutingPlan:
    """The routes and rules for ``opts`` on device ``ifname`` (empty without auto_route).

    Pure: it reads nothing from the host, so a unit test can check it line by line.
    """
    if not opts.auto_route:
        return RoutingPlan((), ())
    p = opts.rule_base
    nop = p + NOP_OFFSET
    table, dns_table = opts.table, opts.dns_table
    rules: list[Rule] = []
    families = [v for v in (4, 6) if opts.captured(v)]
    strict = opts.strict_route
    routes = _plan_routes(opts, families)

    for v in (4, 6):
        rules.append(Rule(v, p, "goto", goto=nop, fwmark=opts.mark))
        rules.append(Rule(v, p + 1, "goto", goto=nop, iif=ifname))
    for v in families:
        if opts.dns_hijack:
            for proto in (17, 6):
                rules.append(Rule(v, p + 2, "table", table=dns_table, ip_proto=proto, dport=53))
    for net in opts.excludes(4) + opts.excludes(6):
        rules.append(Rule(net.version, p + 3, "goto", goto=nop, dst=str(net)))
    if strict:
        for v in (4, 6):
            if v not in families:
                rules.append(Rule(v, p + 4, "unreachable"))
    for v in families:
        iface = opts.inet4 if v == 4 else opts.inet6
        assert iface is not None
        prefix = str(iface.network)
        rules.append(Rule(v, p + 5, "table", table=table, dst=prefix))
        rules.append(Rule(v, p + 6, "table", table=table, suppress_prefixlen=0))
        rules.append(Rule(v, p + 7, "table", table=RT_TABLE_MAIN, suppress_prefixlen=0))
        if v == 4:
            rules.append(Rule(v, p + 8, "table", table=table, iif="lo", invert=True))
            rules.append(Rule(v, p + 8, "table", table=table, iif="lo", src="0.0.0.0/32"))
            rules.append(Rule(v, p + 8, "table", table=table, iif="lo", src=prefix))
        else:
            rules.append(Rule(v, p + 8, "table", table=table, iif="lo", src=prefix))
            rules.append(Rule(v, p + 9, "goto", goto=nop, iif="lo", src="::/1"))
            rules.append(Rule(v, p + 9, "goto", goto=nop, iif="lo", src="8000::/1"))
            rules.append(Rule(v, p + 10, "table", table=table))
    for v in (4, 6):
        rules.append(Rule(v, nop, "nop"))
    return RoutingPlan(tuple(routes), tuple(rules))


# ---------------------------------------------------------------------------
# The state file
# ---------------------------------------------------------------------------


def default_state_dir(environ: dict[str, str] | None = None) -> str:
    """Where the state file lives: the IPC socket's directory (decisions 1, ``api.ipc.path``).

    ``$XDG_RUNTIME_DIR/spliceway`` (a tmpfs cleared at boot, when the routes are gone
    too), else ``/run/spliceway`` for root, else ``/tmp/spliceway-<uid>``.
    """
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "spliceway")
    if os.geteuid() == 0 and os.path.isdir("/run"):
        return "/run/spliceway"
    return f"/tmp/spliceway-{os.getuid()}"


def netns_id() -> str:
    """This process's network namespace as ``<dev>:<inode>`` of /proc/self/ns/net.

    Routes and rules belong to a network namespace, so the record of what was added
    must too: two engines in two namespaces share /run but never each other's rules.
    """
    st = os.stat("/proc/self/ns/net")
    return f"{st.st_dev}:{st.st_ino}"


def _process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    try:
        # The command name (field 2) may hold spaces and parentheses: split after the last ")".
        return int(data[data.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


@dataclass
class HostState:
    """What one TUN added to a network namespace, written before it is added."""

    pid: int
    pid_start: int | None
    netns: str
    ifname: str
    table: int = ROUTE_TABLE
    dns_table: int = DNS_TABLE
    rule_base: int = RULE_PRIORITY_BASE
    routes: list[dict[str, Any]] = field(default_factory=list)
    rules: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def for_plan(cls, opts: TunOptions, ifname: str, plan: RoutingPlan) -> HostState:
        """A record owned by this process."""
        pid = os.getpid()
        return cls(
            pid=pid,
            pid_start=_process_start(pid),
            netns=netns_id(),
            ifname=ifname,
            table=opts.table,
            dns_table=opts.dns_table,
            rule_base=opts.rule_base,
            routes=[asdict(r) for r in plan.routes],
            rules=[asdict(r) for r in plan.rules],
        )

    def owner_alive(self) -> bool:
        """Whether the recording process still runs (the same process: pid and start time)."""
        if self.pid == os.getpid():
            return True
        start = _process_start(self.pid)
        return start is not None and (self.pid_start is None or start == self.pid_start)

    def plan(self) -> RoutingPlan:
        """The recorded routes and rules."""
        return RoutingPlan(
            tuple(Route(**r) for r in self.routes), tuple(Rule(**r) for r in self.rules)
        )


def state_path(state_dir: str | None = None) -> str:
    """The state file of this network namespace."""
    ns = netns_id().replace(":", "-")
    return os.path.join(state_dir or default_state_dir(), f"tun-{ns}.json")


def read_state(state_dir: str | None = None) -> HostState | None:
    """The record of this namespace, or None (absent or unreadable: the sweep still runs)."""
    try:
        with open(state_path(state_dir), encoding="utf-8") as f:
            data = json.load(f)
        return HostState(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_state(state: HostState, state_dir: str | None = None) -> None:
    """Record ``state`` durably (before the first route or rule is added)."""
    path = state_path(state_dir)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    replace_file(path, json.dumps(asdict(state), indent=1).encode())


def remove_state(state_dir: str | None = None) -> None:
    """Delete this namespace's record (after everything in it was removed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_path(state_dir))


# ---------------------------------------------------------------------------
# Applying and removing
# ---------------------------------------------------------------------------


def _code(ex: BaseException) -> int | None:
    code = getattr(ex, "code", None)
    if isinstance(code, int):
        return code
    return ex.errno if isinstance(ex, OSError) else None


@contextlib.contextmanager
def _ipr() -> Iterator[Any]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        yield ipr


def apply_plan(plan: RoutingPlan, ifindex: int) -> None:
    """Add the plan's routes, then its rules (rules last: they never point at a table
    that is still empty). Raises on the first failure; the caller removes the plan."""
    with _ipr() as ipr:
        for route in plan.routes:
            ipr.route("add", **route.netlink(ifindex))
        for rule in plan.rules:
            ipr.rule("add", **rule.netlink())


def remove_plan(plan: RoutingPlan) -> list[str]:
    """Delete the plan's rules, then its routes; what is already gone is skipped.

    Returns the errors that were not "already gone" (empty on a clean removal).
    """
    errors: list[str] = []
    with _ipr() as ipr:
        for rule in plan.rules:
            try:
                ipr.rule("del", **rule.netlink())
            except Exception as ex:
                if _code(ex) not in _GONE:
                    errors.append(f"{rule.describe()}: {ex}")
        for route in plan.routes:
            kw = route.netlink(None)
            kw.pop("oif", None)  # the device may be gone; dst, table and metric identify it
            try:
                ipr.route("del", **kw)
            except Exception as ex:
                if _code(ex) not in _GONE:
                    errors.append(f"{route.describe()}: {ex}")
    return errors


def _sweep_ranges(
    priorities: Iterable[range], tables: Iterable[int]
) -> tuple[list[str], list[str]]:
    """Delete every rule whose priority is in ``priorities`` and every route in ``tables``."""
    removed: list[str] = []
    errors: list[str] = []
    spans = list(priorities)
    wanted = set(tables)
    with _ipr() as ipr:
        for family in (socket.AF_INET, socket.AF_INET6):
            for msg in list(ipr.rule("dump", family=family)):
                prio = msg.get("priority")
                if prio is None or not any(prio in s for s in spans):
                    continue
                try:
                    ipr.rule("del", family=family, priority=prio)
                    removed.append(f"(v{_VERSION[family]}) rule {prio}")
                except Exception as ex:
                    if _code(ex) not in _GONE:
                        errors.append(f"rule {prio}: {ex}")
            for table in wanted:
                for msg in list(ipr.route("dump", family=family, table=table)):
                    if msg.get("table") != table:
                        continue
                    kw: dict[str, Any] = {"family": family, "table": table}
                    any_ip = "0.0.0.0" if family == socket.AF_INET else "::"
                    kw["dst"] = f"{msg.get('dst') or any_ip}/{msg['dst_len']}"
                    kw["type"] = msg["type"]
                    if msg.get("priority") is not None:
                        kw["priority"] = msg.get("priority")
                    if msg.get("oif") is not None:
                        kw["oif"] = msg.get("oif")
                    try:
                        ipr.route("del", **kw)
                        removed.append(f"(v{_VERSION[family]}) route {kw['dst']} table {table}")
                    except Exception as ex:
                        if _code(ex) not in _GONE:
                            errors.append(f"route {kw['dst']} table {table}: {ex}")
    return removed, errors


@dataclass
class SweepResult:
    """What a sweep found and removed."""

    removed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    previous_owner: int | None = None
    """PID recorded in the state file that was swept, if any."""


def sweep(
    state_dir: str | None = None,
    *,
    rule_base: int = RULE_PRIORITY_BASE,
    tables: Iterable[int] = (ROUTE_TABLE, DNS_TABLE),
    force: bool = False,
) -> SweepResult:
    """Remove what an earlier TUN in this namespace left behind (a crash, a kill -9).

    Refuses with ``ApiError(conflict)`` while the recorded owner still runs (another
    engine's live TUN), unless ``force``. Removes the recorded routes and rules, then
    every rule in the priority range (both the recorded base and ``rule_base``) and
    every route of the recorded and given tables, then the record.
    """
    result = SweepResult()
    state = read_state(state_dir)
    spans = [range(rule_base, rule_base + RULE_PRIORITY_SPAN)]
    wanted = set(tables)
    if state is not None and state.netns != netns_id():  # pragma: no cover - named by it
        state = None
    if state is not None:
        if not force and state.pid != os.getpid() and state.owner_alive():
            raise ApiError(
                "conflict",
                f"process {state.pid} has a TUN ({state.ifname}) in this network namespace",
            )
        result.previous_owner = state.pid
        result.errors += remove_plan(state.plan())
        result.removed += state.plan().describe()
        spans.append(range(state.rule_base, state.rule_base + RULE_PRIORITY_SPAN))
        wanted |= {state.table, state.dns_table}
    removed, errors = _sweep_ranges(spans, wanted)
    result.removed += removed
    result.errors += errors
    if not result.errors:
        remove_state(state_dir)
    return result


def sweep_if_recorded(state_dir: str | None = None) -> SweepResult | None:
    """At engine start: sweep only when a dead engine's record exists in this namespace.

    Cheap when there is nothing to do (one failed ``open``), needs no privilege then,
    and never touches a live engine's TUN. Lifts strict_route's kill switch after a
    crash even when the restarted engine starts no TUN. Returns None when nothing was
    recorded or the recorded owner still runs.
    """
    state = read_state(state_dir)
    if state is None or state.owner_alive():
        return None
    return sweep(state_dir, rule_base=state.rule_base, tables=(state.table, state.dns_table))


# ---------------------------------------------------------------------------
# Command line: python -m spliceway.tun.routing sweep|show
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``sweep`` removes a crashed engine's leftovers now; ``show`` prints the record."""
    parser = argparse.ArgumentParser(
        prog="python -m spliceway.tun.routing",
        description="Inspect or remove the routes and rules a spliceway TUN added.",
    )
    parser.add_argument("action", choices=["sweep", "show"])
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--force", action="store_true", help="sweep even if the owner runs")
    args = parser.parse_args(argv)
    if args.action == "show":
        state = read_state(args.state_dir)
        print(json.dumps(None if state is None else asdict(state), indent=1))
        return 0
    try:
        result = sweep(args.state_dir, force=args.force)
    except ApiError as ex:
        print(f"not swept: {ex.message}", file=sys.stderr)
        return 1
    for line in result.removed:
        print(f"removed {line}")
    for line in result.errors:
        print(f"error {line}", file=sys.stderr)
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
