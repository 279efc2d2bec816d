"""The ``spliceway`` command line (docs/running.md).

Subcommands in this build: ``run [-c FILE]`` (foreground engine and, when
``api.control`` is enabled, its HTTP control API; SIGINT/SIGTERM stop it
cleanly with exit 0; SIGHUP re-reads FILE and applies it like ``config.apply``,
keeping the running configuration when that fails),
``validate [--json] FILE`` (offline, the environment variables the file names
included; exit 0, or 1 with one line per problem, or one JSON object with ``code``,
``message`` and ``details``), ``config-schema`` (the configuration's JSON Schema),
``connector state [--json] FILE`` (reads the outbox the file names; while an engine
holds it, asks that engine over IPC), ``connector dead-letters [--json] FILE`` (the
outbox read while the engine is stopped; exit 1 with the error code when it cannot)
and ``build-info [--json]``; ``status``, ``flows``, ``policies``, ``select``, ``mode``,
``reload``, ``providers [update [NAME]]`` and ``events`` talk to a running engine over its
IPC socket (``--ipc PATH``,
``$SPLICEWAY_IPC``, else the default; exit 1 with ``spliceway: <code>: <message>``
when the engine refuses, is not there or breaks the connection). Every subcommand
but ``events`` (JSON lines) prints a table by default and JSON with ``--json``. Exit status 2
means the engine could not start (invalid configuration, an unset key
variable, a port in use, the outbox locked by another engine, an unsupported
setting); the reason is printed one problem per line, never as a traceback.
"""

from __future__ import annotations

import argparse
import errno
import gc
import io
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from spliceway import __version__
from spliceway.errors import ApiError

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_START_FAILED = 2
#: 128 + the signal's number, as a shell reports a program SIGPIPE or SIGINT ended.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
EXIT_INTERRUPTED = 128 + signal.SIGINT

_LOG_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}


_EPILOG = """\
exit status: 0 success; 1 validate or a connector command found problems, or a
             command to a running engine failed (its error code and message on
             stderr); 2 the engine could not start (one line per problem on stderr);
             130 interrupted (SIGINT; run stops cleanly with 0 instead); 141 the
             reader of standard output went away (| head)
output:      a table by default, JSON with --json (events: JSON lines)
remote:      status, flows, policies, select, mode, reload, providers and events talk
             to a running engine over its IPC socket (docs/ipc.md); connector state
             too, while an engine holds the outbox
reference:   docs/running.md, docs/configuration.md and docs/ in the source
             distribution; spliceway config-schema prints the JSON Schema
"""

_RUN_EPILOG = """\
signals: SIGINT, SIGTERM  stop cleanly (every flow completes, engine.stopped), exit 0
         SIGHUP           re-read the config file and apply it live (as config.apply;
                          on failure the running configuration is kept and the
                          reason logged and emitted as engine.warning reload_failed)
         SIGUSR1          write every thread's stack to the log
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spliceway",
        description="spliceway: a proxy engine with a C splice relay, exact flow events and "
        "a durable event outbox.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"spliceway {__version__}")
    parser.add_argument(
        "--ipc",
        metavar="PATH",
        help="a running engine's IPC socket (default: $SPLICEWAY_IPC, else the engine's "
        "default path)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run the engine in the foreground",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("-c", "--config", help="configuration file (default: the embedded default)")
    validate = sub.add_parser(
        "validate", help="check a configuration file and the environment variables it names"
    )
    validate.add_argument("file")
    sub.add_parser("config-schema", help="print the configuration's JSON Schema")
    build_info = sub.add_parser("build-info", help="print what this build contains")
    status = sub.add_parser("status", help="a running engine's uptime, health and counters")
    flows = sub.add_parser("flows", help="a running engine's active flows")
    flows.add_argument("--limit", type=int, help="at most this many (1..10000, default 100)")
    policies = sub.add_parser(
        "policies", help="a running engine's policy groups and their members' health"
    )
    select = sub.add_parser("select", help="select a selector group's member (policies.select)")
    select.add_argument("policy_tag")
    select.add_argument("target_tag")
    mode = sub.add_parser("mode", help="set the routing mode (mode.set)")
    mode.add_argument("mode", choices=("rule", "direct", "global"))
    mode.add_argument("outbound", nargs="?", help="the outbound or group of mode global")
    reload = sub.add_parser(
        "reload",
        help="apply a configuration file to a running engine (config.apply)",
        description="Apply FILE's document to the running engine (config.apply). FILE is "
        "only read. The engine's own source file (its run -c FILE) is rewritten to hold "
        "the applied document, serialised anew (JSON, or YAML for .yaml/.yml), so its "
        "comments and formatting are not kept there; what it held before is kept as "
        "<source file>.prev (one generation, replaced by the next apply). An engine "
        "started without a file writes nothing. See docs/reload.md.",
    )
    reload.add_argument("file", help="the whole configuration to run (JSON or YAML)")
    providers = sub.add_parser(
        "providers",
        help="a running engine's providers (subscriptions, rule sets, geodata) and their "
        "status; `providers update [NAME]` refreshes them now (providers.update)",
    )
    providers_what = providers.add_subparsers(dest="providers_command")
    update = providers_what.add_parser(
        "update", help="refresh every provider, or NAME, now and print each result"
    )
    update.add_argument("name", nargs="?", help="one provider (default: every one)")
    remotes = (validate, build_info, status, flows, policies, select, mode, reload, providers)
    for remote in (*remotes, update):
        remote.add_argument("--json", action="store_true", help="print JSON")
    events = sub.add_parser(
        "events", help="print a running engine's events, one JSON envelope per line"
    )
    events.add_argument("--types", help="comma-separated event types (default: all)")
    events.add_argument(
        "--json", action="store_true", help="print JSON (what events always prints)"
    )
    connector = sub.add_parser(
        "connector",
        help="inspect the event sinks' outbox (offline, or over IPC from the engine holding it)",
    )
    what = connector.add_subparsers(dest="connector_command", required=True)
    for name, text in (
        ("state", "each sink's pending events, dead letters and storage state"),
        ("dead-letters", "every dead letter, with why it failed"),
    ):
        cmd = what.add_parser(name, help=text)
        cmd.add_argument("--json", action="store_true", help="print JSON")
        cmd.add_argument("file", help="the engine's configuration file")
    return parser


def _problems(err: ApiError) -> list[str]:
    if err.details:
        return [f"{d.field_path}: {d.message}" if d.field_path else d.message for d in err.details]
    return [f"{err.field_path}: {err.message}" if err.field_path else err.message]


def _detail(field_path: str | None, message: str) -> dict[str, str]:
    return {"field_path": field_path, "message": message} if field_path else {"message": message}


def _error_json(ex: ApiError) -> dict[str, Any]:
    """An error as ``--json`` prints it: the envelope's ``error`` object, with
    ``details`` always present (one item per problem)."""
    doc: dict[str, Any] = {"code": ex.code, "message": ex.message}
    if ex.field_path:
        doc["field_path"] = ex.field_path
    if ex.cause:
        doc["cause"] = ex.cause
    doc["details"] = [_detail(d.field_path, d.message) for d in ex.details or ()] or [
        _detail(ex.field_path, ex.message)
    ]
    return doc


def cmd_validate(path: str, as_json: bool = False) -> int:
    """``spliceway validate [--json] FILE``: the document's problems, then its environment's."""
    from spliceway.config import check_environment, load_config_file

    try:
        check_environment(load_config_file(path))
    except ApiError as ex:
        # The code on stderr, as every failing subcommand prints it; the problems on
        # stdout, one per line (or as one JSON object), for a reader or a script.
        print(f"spliceway: {ex.code}: {ex.message}", file=sys.stderr)
        if as_json:
            print(_dumps(_error_json(ex)))
        else:
            for line in _problems(ex):
                print(line)
        return EXIT_INVALID
    print(_dumps({"file": path, "valid": True}) if as_json else f"{path}: valid")
    return EXIT_OK


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()


def cmd_config_schema() -> int:
    """``spliceway config-schema``: the JSON Schema of the configuration document."""
    from spliceway.config import config_schema

    print(_dumps(config_schema()))
    return EXIT_OK


def _cannot_start(ex: ApiError) -> int:
    lines = _problems(ex)
    if len(lines) == 1:
        print(f"spliceway: cannot start: {ex.code}: {lines[0]}", file=sys.stderr)
    else:
        print(f"spliceway: cannot start: {ex.code}: {ex.message}", file=sys.stderr)
        for line in lines:
            print(f"spliceway: {line}", file=sys.stderr)
    return EXIT_START_FAILED


def _setup_logging(runtime: Any) -> None:
    level = _LOG_LEVELS.get(runtime.log_level, logging.INFO)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers.extend(logging.FileHandler(path) for path in runtime.log_files)
    logging.basicConfig(
        level=level,
        handlers=handlers,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # pykka logs every actor start/stop at debug: one line per flow is noise.
    logging.getLogger("pykka").setLevel(max(level, logging.INFO))
    # Waitress reports every SSE client that leaves at info; that is normal operation.
    logging.getLogger("waitress").setLevel(max(level, logging.WARNING))


def cmd_run(config_path: str | None) -> int:
    """``spliceway run [-c FILE]``: run until SIGINT or SIGTERM."""
    from spliceway.config import default_config, load_config_file

    try:
        config = load_config_file(config_path) if config_path else default_config()
    except ApiError as ex:
        for line in _problems(ex):
            print(f"spliceway: invalid configuration: {line}", file=sys.stderr)
        return EXIT_START_FAILED
    _setup_logging(config.runtime)
    log = logging.getLogger("spliceway")
    # Blocked in this thread before the engine starts any, so every thread inherits the
    # mask and only sigwait() below takes these signals, synchronously. (A handler would
    # run only when the main thread executes bytecode, and a signal delivered to another
    # thread does not wake a main thread blocked on a lock.)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _CONTROL_SIGNALS)
    try:
        return _run_until_signal(config, config_path, log)
    finally:
        # Signals that came during the stop are taken here, so unblocking cannot turn
        # them into a late KeyboardInterrupt or termination of a caller of main().
        for pending in signal.sigpending() & _CONTROL_SIGNALS:
            signal.sigwait({pending})
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _tune_gc() -> None:
    """Collect young objects less often, and never rescan what start-up built.

    Each flow allocates a few dozen short-lived dicts (records, events), and the
    event ring keeps thousands of them alive for a while: with CPython's default
    thresholds (700, 10, 10), cyclic collection took about 45 % of the dispatcher's
    CPU under load (measured with perf; flows themselves are freed by reference
    counting). Only the process owns these settings, so only ``run`` changes them;
    an application embedding the engine keeps its own.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


def _run_until_signal(config: Any, config_path: str | None, log: logging.Logger) -> int:
    from spliceway.app.engine import Engine

    try:
        import pykka.debug

        signal.signal(signal.SIGUSR1, pykka.debug.log_thread_tracebacks)
    except (ImportError, AttributeError):
        pass
    try:
        # The CLI's engine is the one the remote subcommands look for on the default
        # socket; an embedded engine only serves IPC when its configuration asks.
        engine = Engine(
            config,
            config_path=config_path,
            ipc_by_default=True,
            on_runtime_changed=_setup_logging,
        )
        engine.start()
    except ApiError as ex:
        return _cannot_start(ex)
    except Exception as ex:
        log.debug("start failed", exc_info=True)
        return _cannot_start(ApiError("internal", f"{type(ex).__name__}: {ex}"))
    _tune_gc()
    for active in engine.core.active_inbounds:
        spec, (address, port) = active.spec, active.bound
        log.info("inbound %s (%s) listening on %s:%d", spec.tag, spec.protocol, address, port)
    if engine.core.dns.server is not None:
        log.info("DNS server listening on %s:%d (udp, tcp)", *engine.core.dns.server.bound)
    running = engine.core.config
    if running.api.control.enabled:
        log.info("control API listening on %s/api/v1/", engine.control_url)
    if running.api.clash.enabled:
        log.info("Clash API listening on %s", engine.clash_url)
    if running.api.ipc.enabled:
        log.info("IPC socket listening on %s", running.api.ipc.resolved_path())
    while (signum := signal.sigwait(_CONTROL_SIGNALS)) == signal.SIGHUP:
        _reload(engine, config_path, log)
    # Signals that arrive during the stop stay blocked and pending: they change nothing.
    engine.stop(reason="signal")
    log.info("engine stopped on %s", signal.Signals(signum).name)
    return EXIT_OK


_CONTROL_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
RELOAD_FAILED = "reload_failed"


def _reload(engine: Any, config_path: str | None, log: logging.Logger) -> None:
    """SIGHUP: apply the config file again; a failure keeps what runs, logged and emitted."""
    from spliceway.config import load_config_file

    if config_path is None:
        message = "SIGHUP received: no configuration file to re-read (the embedded default runs)"
    else:
        log.info("SIGHUP received: reloading %s", config_path)
        try:
            result = engine.core.reconciler.apply(
                load_config_file(config_path), persist=False, trigger="sighup"
            )
        except ApiError as ex:
            lines = _problems(ex)
            message = f"reload of {config_path} failed: {ex.code}: " + "; ".join(lines)
        except Exception as ex:
            # A bug, not a refusal: logged with its traceback, and the engine goes on
            # with what it runs (the sigwait loop must not end on it).
            log.exception("reload of %s failed unexpectedly", config_path)
            message = f"reload of {config_path} failed: internal: {type(ex).__name__}: {ex}"
        else:
            changed = ", ".join(result["changed_components"]) or "nothing"
            log.info("reloaded %s (changed: %s)", config_path, changed)
            return
    log.warning("%s; the running configuration is kept", message)
    engine.core.log.emit(
        "engine.warning",
        {"code": RELOAD_FAILED, "message": f"{message}; the running configuration is kept"},
    )


def cmd_connector(command: str, path: str, as_json: bool, ipc: str | None = None) -> int:
    """``spliceway connector state|dead-letters [--json] FILE``."""
    from spliceway.config import load_config_file
    from spliceway.connector import inspect

    try:
        config = load_config_file(path)
        if command == "state":
            try:
                state = inspect.outbox_state(config)
            except ApiError as ex:
                if ex.code != "conflict":
                    raise
                # An engine holds the outbox: ask it, over its IPC socket.
                state = _state_from_engine(config, ipc, ex)
            if as_json:
                print(_dumps(state))
                return EXIT_OK
            source = " (from the running engine)" if state.get("source") == "engine" else ""
            print(f"outbox {state['outbox_path']}{source}")
            print(f"{'SINK':<20} {'TYPE':<8} {'PENDING':>9} {'DEAD':>6} {'BLOCKED':<8} RECOVERY")
            for s in state["sinks"]:
                kind = s["type"] or "removed"  # no longer configured; its events remain
                blocked = (s.get("outbox_storage") or {}).get("write_blocked")
                print(
                    f"{s['name']:<20} {kind:<8} {s['pending']:>9} {s['dead_letters']:>6} "
                    f"{'-' if blocked is None else str(blocked).lower():<8} "
                    f"{s['outbox_recovery']['state']}"
                )
            return EXIT_OK
        for letter in inspect.dead_letters(config):
            if as_json:
                print(orjson.dumps(letter).decode())
            else:
                print(
                    f"{letter['sink']} {letter['event_id']} {letter['event_type']} "
                    f"attempts={letter.get('attempts')} reason={letter.get('reason')}"
                )
    except ApiError as ex:
        print(f"spliceway: {ex.code}: {ex.message}", file=sys.stderr)
        if ex.details:
            for line in _problems(ex):
                print(f"spliceway: {line}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _state_from_engine(config: Any, ipc: str | None, held: ApiError) -> dict[str, Any]:
    """``connector state`` from the engine that holds the outbox (``held`` said so): over
    ``--ipc``, ``$SPLICEWAY_IPC``, else the socket the file configures. ``held`` again,
    with the reason, when that engine cannot be asked or is another engine."""

    from spliceway.cli.ipc_client import IPC_ENV, IpcClient

    path = ipc or os.environ.get(IPC_ENV)
    if not path:
        if not config.api.ipc.serves(unset_default=True):
            raise ApiError(
                "conflict",
                f"{held.message}; the file disables its IPC socket (api.ipc.enabled: false), "
                "so that engine cannot be asked: give its socket with --ipc",
                field_path=held.field_path,
            )
        path = config.api.ipc.resolved_path()
    try:
        with IpcClient(path) as client:
            state = client.query("connector_state")
    except ApiError as ex:
        raise ApiError(
            ex.code if ex.code != "not_found" else "conflict",
            f"{held.message}; asking the engine on {path} failed: {ex.message}",
            field_path=ex.field_path,
        ) from ex
    wanted = os.path.realpath(config.api.outbox_path)
    if os.path.realpath(str(state.get("outbox_path"))) != wanted:
        raise ApiError(
            "conflict",
            f"{held.message}; the engine on {path} uses the outbox at {state.get('outbox_path')}, "
            f"not {config.api.outbox_path}: give the holder's socket with --ipc",
            field_path=held.field_path,
        )
    return state


def cmd_build_info(as_json: bool = False) -> int:
    """``spliceway build-info [--json]``: version and what was compiled in."""
    from spliceway.control.capabilities import BUILD_FEATURES
    from spliceway.native import relay

    info = {
        "version": __version__,
        "relay_abi": relay.ABI_VERSION,
        "build_features": list(BUILD_FEATURES),
    }
    if as_json:
        print(_dumps(info))
        return EXIT_OK
    from spliceway.cli.remote import table

    rows = [
        ("version", info["version"]),
        ("relay_abi", info["relay_abi"]),
        ("build_features", ",".join(BUILD_FEATURES) or "-"),
    ]
    print(table(("FIELD", "VALUE"), rows))
    return EXIT_OK


def main(argv: Sequence[str] | None = None, *, take_sigint: bool = False) -> int:
    """Entry point of the ``spliceway`` console script.

    A reader that goes away (``spliceway config-schema | head -1``) ends the program
    quietly with 141, and SIGINT outside ``run`` (which stops its engine cleanly and
    exits 0) with 130: the statuses a shell reports for a program those signals ended,
    never a traceback. Standard output that cannot be written (closed with ``>&-``,
    ``/dev/full``) is one ``spliceway: ...`` line and 1. ``take_sigint``: SIGINT was left
    to end the process while it imported this module (:mod:`spliceway._console`); from
    here on it is a KeyboardInterrupt, ended as above.
    """
    try:
        if take_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if sys.stdout is None:
            # Started with stdout closed: only a subcommand that prints fails, when it does.
            sys.stdout = _ClosedOutput()
        try:
            status = _dispatch(argv)
        finally:
            # Output still buffered (argparse's --help before its SystemExit too) must
            # reach the pipe here, where a closed one is caught, not in the
            # interpreter's final flush.
            sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as ex:
        _discard_stdout()
        print(f"spliceway: cannot write standard output: {ex.strerror or ex}", file=sys.stderr)
        return EXIT_INVALID
    return status


class _ClosedOutput(io.TextIOBase):
    """What ``sys.stdout`` is when the process started without one: writing is EBADF,
    as it would be on the closed descriptor."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def flush(self) -> None:
        """Nothing is buffered."""


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush of what is still buffered
    does not fail on the closed pipe again (and print its own complaint)."""
    try:
        fileno = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout to its end)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fileno)
    finally:
        os.close(devnull)


def _dispatch(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "validate":
        return cmd_validate(args.file, args.json)
    if args.command == "run":
        return cmd_run(args.config)
    if args.command == "config-schema":
        return cmd_config_schema()
    if args.command == "connector":
        return cmd_connector(args.connector_command, args.file, args.json, args.ipc)
    if args.command == "build-info":
        return cmd_build_info(args.json)
    from spliceway.cli import remote

    if args.command == "status":
        return remote.cmd_status(args.ipc, args.json)
    if args.command == "flows":
        return remote.cmd_flows(args.ipc, args.json, args.limit)
    if args.command == "policies":
        return remote.cmd_policies(args.ipc, args.json)
    if args.command == "select":
        return remote.cmd_select(args.ipc, args.json, args.policy_tag, args.target_tag)
    if args.command == "mode":
        return remote.cmd_mode(args.ipc, args.json, args.mode, args.outbound)
    if args.command == "reload":
        return remote.cmd_reload(args.ipc, args.json, args.file)
    if args.command == "providers":
        if args.providers_command == "update":
            return remote.cmd_providers_update(args.ipc, args.json, args.name)
        return remote.cmd_providers(args.ipc, args.json)
    types = [t for t in (args.types or "").split(",") if t] or None
    return remote.cmd_events(args.ipc, types)


if __name__ == "__main__":
    sys.exit(main())
