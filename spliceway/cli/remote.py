"""The CLI subcommands that talk to a running engine over its IPC socket.

Each prints a readable table by default and JSON with ``--json``; a failure prints
``spliceway: <code>: <message>`` on stderr and exits 1.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from spliceway.cli.ipc_client import IpcClient, socket_path
from spliceway.errors import ApiError

EXIT_OK = 0
EXIT_FAILED = 1


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(h) for h in headers], *[["-" if v is None else str(v) for v in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def duration_text(seconds: int) -> str:
    """``seconds`` as ``2d 3h 4m 5s``, leading zero units left out (``0s`` for none)."""
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size or parts:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    parts.append(f"{seconds}s")
    return " ".join(parts)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _status(client: IpcClient) -> tuple[Any, str]:
    health = client.query("health")
    stats = client.query("stats")
    # The socket is local, so the engine's clock is this one: uptime is computed here
    # from the engine's start time rather than asked for.
    uptime = max(0, (_now_ms() - health["started_at_unix_ms"]) // 1000)
    result = {"health": health, "stats": stats, "uptime_seconds": uptime}
    rows = [("uptime", duration_text(uptime))]
    rows += [(k, v) for k, v in {**health, **stats}.items() if not isinstance(v, dict | list)]
    return result, table(("FIELD", "VALUE"), rows)


def _flows(limit: int | None) -> Callable[[IpcClient], tuple[Any, str]]:
    def run(client: IpcClient) -> tuple[Any, str]:
        result = client.query("flows", {"limit": limit} if limit is not None else {})
        rows = []
        for r in result["active_flows"]:
            target = r["target"]
            outbound = (r["path"]["outbound"] or {}).get("tag")
            rows.append(
                (
                    r["flow_id"],
                    r["inbound"]["tag"],
                    f"{target['host']}:{target['port']}",
                    outbound,
                    r["state"],
                    r["traffic"]["bytes_up"],
                    r["traffic"]["bytes_down"],
                )
            )
        headers = ("FLOW", "INBOUND", "TARGET", "OUTBOUND", "STATE", "UP", "DOWN")
        return result, table(headers, rows)

    return run


def _member_state(member: dict[str, Any]) -> str:
    # Until its first probe a member counts as healthy (spliceway/routing/policy.py), which
    # nothing has checked yet: say so rather than "up".
    if member["last_checked_unix_ms"] is None or member["healthy"] is None:
        return "unchecked"
    return "up" if member["healthy"] else "down"


def _policies(client: IpcClient) -> tuple[Any, str]:
    result = client.query("policies")
    rows = []
    members = []
    now = _now_ms()
    for p in result["policies"]:
        probed = p["url_test_members"]
        healthy = f"{sum(m['healthy'] for m in probed)}/{len(probed)}" if probed else None
        rows.append(
            (
                p["tag"],
                p["kind"],
                p["selected"],
                p.get("latency_ms"),
                ",".join(p["outbounds"]),
                healthy,
            )
        )
        # Every group's members with the newest check of each by any probing group
        # (member_health), so a selector's members show what a url_test found; a
        # probing group's own members as it sees them (its selection follows that).
        own = {m["member_tag"]: m for m in probed}
        for m in p.get("member_health", probed):
            m = own.get(m["member_tag"], m)
            checked = m["last_checked_unix_ms"]
            members.append(
                (
                    p["tag"],
                    m["member_tag"],
                    _member_state(m),
                    m["latency_ms"],
                    None if checked is None else f"{max(0, now - checked) // 1000}s ago",
                    (p["tag"] if m["member_tag"] in own else m.get("checked_by"))
                    if checked is not None
                    else None,
                    m["last_error"],
                )
            )
    text = table(("POLICY", "KIND", "SELECTED", "LATENCY_MS", "MEMBERS", "HEALTHY"), rows)
    if members:
        # One line per member: a dead upstream, who found it so, and why.
        headers = ("POLICY", "MEMBER", "HEALTH", "LATENCY_MS", "CHECKED", "BY", "ERROR")
        text += "\n\n" + table(headers, members)
    return result, text


def _command(method: str, params: dict[str, Any]) -> Callable[[IpcClient], tuple[Any, str]]:
    def run(client: IpcClient) -> tuple[Any, str]:
        result = client.command(method, params)
        return result, table(("FIELD", "VALUE"), sorted(result.items()))

    return run


def _reload(path: str) -> Callable[[IpcClient], tuple[Any, str]]:
    def run(client: IpcClient) -> tuple[Any, str]:
        from spliceway.config import read_config_document

        result = client.command("config.apply", {"config": read_config_document(path)})
        rows = [(k, ",".join(v) if isinstance(v, list) else v) for k, v in result.items()]
        return result, table(("FIELD", "VALUE"), rows)

    return run


def _ago(now: int, at: int | None) -> str | None:
    return None if at is None else f"{max(0, now - at) // 1000}s ago"


def _in(now: int, at: int | None) -> str | None:
    return None if at is None else f"in {max(0, at - now) // 1000}s"


def _size(state: dict[str, Any]) -> str | None:
    """What a provider holds: outbounds of a proxy provider (with the group members it
    gives), entries of a rule set."""
    if state["kind"] == "proxies" and state.get("outbounds") is not None:
        return f"{state['outbounds']} outbounds, {len(state['members'])} members"
    if state["kind"] == "rules" and state.get("rules") is not None:
        return f"{state['rules']} rules"
    return None


def _providers(client: IpcClient) -> tuple[Any, str]:
    result = client.query("providers")
    now = _now_ms()
    rows = [
        (
            s["name"],
            s["kind"],
            s["url"] or s["path"],
            _ago(now, s["updated_at_unix_ms"]),
            _in(now, s["next_update_at_unix_ms"]),
            _size(s),
            s.get("skipped"),
            s["last_error"],
        )
        for s in result["providers"]
    ]
    headers = ("PROVIDER", "KIND", "SOURCE", "UPDATED", "NEXT", "HOLDS", "SKIPPED", "ERROR")
    return result, table(headers, rows)


def _providers_update(name: str | None) -> Callable[[IpcClient], tuple[Any, str]]:
    def run(client: IpcClient) -> tuple[Any, str]:
        result = client.command("providers.update", {"name": name} if name else {})
        rows = [(r["name"], r["kind"], r["outcome"], r["error"]) for r in result["results"]]
        return result, table(("PROVIDER", "KIND", "OUTCOME", "ERROR"), rows)

    return run


def _fail(ex: ApiError) -> int:
    where = f" ({ex.field_path})" if ex.field_path else ""
    print(f"spliceway: {ex.code}: {ex.message}{where}", file=sys.stderr)
    for detail in ex.details or ():
        field = f"{detail.field_path}: " if detail.field_path else ""
        print(f"spliceway: {field}{detail.message}", file=sys.stderr)
    return EXIT_FAILED


def _once(
    ipc: str | None,
    as_json: bool,
    fn: Callable[[IpcClient], tuple[Any, str]],
    timeout: float | None = 30.0,
) -> int:
    try:
        with IpcClient(socket_path(ipc), timeout=timeout) as client:
            result, text = fn(client)
    except ApiError as ex:
        return _fail(ex)
    except (KeyError, TypeError, AttributeError, ValueError) as ex:
        # A reply of another shape than this CLI knows (another engine version).
        return _fail(ApiError("internal", f"unexpected reply from the engine: {ex!r}"))
    print(_json(result) if as_json else text)
    return EXIT_OK


def cmd_status(ipc: str | None, as_json: bool) -> int:
    """``spliceway status``: health and counters."""
    return _once(ipc, as_json, _status)


def cmd_flows(ipc: str | None, as_json: bool, limit: int | None) -> int:
    """``spliceway flows``: the active flows."""
    return _once(ipc, as_json, _flows(limit))


def cmd_policies(ipc: str | None, as_json: bool) -> int:
    """``spliceway policies``: every policy group and what it selects."""
    return _once(ipc, as_json, _policies)


def cmd_select(ipc: str | None, as_json: bool, policy: str, target: str) -> int:
    """``spliceway select POLICY TARGET``: policies.select."""
    params = {"policy_tag": policy, "target_tag": target}
    return _once(ipc, as_json, _command("policies.select", params))


def cmd_mode(ipc: str | None, as_json: bool, mode: str, outbound: str | None) -> int:
    """``spliceway mode MODE [OUTBOUND]``: mode.set."""
    params: dict[str, Any] = {"mode": mode}
    if outbound is not None:
        params["outbound"] = outbound
    return _once(ipc, as_json, _command("mode.set", params))


def cmd_reload(ipc: str | None, as_json: bool, path: str) -> int:
    """``spliceway reload FILE``: config.apply of FILE's document (the engine validates it,
    saves it to its own source file and reconciles)."""
    return _once(ipc, as_json, _reload(path))


def cmd_providers(ipc: str | None, as_json: bool) -> int:
    """``spliceway providers``: every provider's source, age, schedule, size and error."""
    return _once(ipc, as_json, _providers)


def cmd_providers_update(ipc: str | None, as_json: bool, name: str | None) -> int:
    """``spliceway providers update [NAME]``: providers.update, waiting for its results
    (downloads have deadlines of their own; the engine answers within 150 s)."""
    return _once(ipc, as_json, _providers_update(name), timeout=180.0)


def cmd_events(ipc: str | None, types: list[str] | None) -> int:
    """``spliceway events``: one envelope per line until interrupted or the engine stops
    (``--json`` changes nothing: the lines are JSON)."""
    try:
        with IpcClient(socket_path(ipc)) as client:
            for envelope in client.subscribe(types):
                sys.stdout.write(orjson.dumps(envelope).decode() + "\n")
                sys.stdout.flush()
    except ApiError as ex:
        return _fail(ex)
    # SIGINT and a reader that goes away (``spliceway events | head``) end it through
    # cli.main, quietly and with the shell's status for them.
    return EXIT_OK
