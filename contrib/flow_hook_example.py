#!/usr/bin/env python3
"""An example flow hook for spliceway (docs/flow-hook.md), standard library only.

Run it, then point the engine's ``api.flow_hook.path`` at the same socket::

    python3 contrib/flow_hook_example.py /run/spliceway-hook.sock \\
        --deny-suffix .ads.example --deny-suffix tracker.example

The protocol, by example. The engine connects to the socket and writes one JSON
object per line for each new flow the hook selects::

    {"id": 7, "flow": {"flow_id": "...", "state": "opening", "network": "tcp",
                       "inbound": {"tag": "socks-in", "protocol": "socks5"},
                       "target": {"host": "www.ads.example", "port": 443}, ...}}

and this hook answers one line with the same ``id``::

    {"id": 7, "verdict": "deny"}
    {"id": 8, "verdict": "allow", "labels": {"inbound": "socks-in"}}

Requests are pipelined: the engine does not wait for one answer before sending the
next request, and answers may come in any order, matched by ``id``. This hook decides
each request in a task of its own, so a slow decision (``--delay-ms``, or a real
lookup) holds up no other flow. An answer that comes later than the engine's
``timeout_ms``, or never, lets the flow through (fail-open): a hook can deny flows,
but never stall them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
from typing import Any


def decide(flow: dict[str, Any], deny_suffixes: tuple[str, ...]) -> dict[str, Any]:
    """The answer for one flow record, without its ``id``.

    Denies a target host equal to or under one of ``deny_suffixes`` (``.ads.example``
    matches ``x.ads.example``; ``tracker.example`` matches itself and
    ``cdn.tracker.example``); allows the rest, labelled with their inbound's tag.
    """
    target = flow.get("target") or {}
    host = str(target.get("sniffed_host") or target.get("host") or "").lower().rstrip(".")
    for suffix in deny_suffixes:
        bare = suffix.lstrip(".")
        if host == bare or host.endswith("." + bare):
            return {"verdict": "deny"}
    answer: dict[str, Any] = {"verdict": "allow"}
    tag = (flow.get("inbound") or {}).get("tag")
    if isinstance(tag, str) and tag:
        # Labels are strings to strings; the engine writes them into the flow's record.
        answer["labels"] = {"inbound": tag}
    return answer


class Hook:
    """The server: one connection per engine, requests decided concurrently."""

    def __init__(self, deny_suffixes: tuple[str, ...], delay_s: float) -> None:
        self.deny_suffixes = tuple(s.lower() for s in deny_suffixes)
        self.delay_s = delay_s

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read requests until the engine disconnects; answer each as soon as decided."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while line := await reader.readline():
                task = asyncio.create_task(self.answer(line, writer))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (ConnectionError, ValueError):
            pass  # the engine went away, or sent a line over the reader's limit
        finally:
            for task in tasks:
                task.cancel()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def answer(self, line: bytes, writer: asyncio.StreamWriter) -> None:
        """Decide one request and write its answer line."""
        try:
            request = json.loads(line)
            request_id = request["id"]
            flow = request["flow"]
        except (ValueError, KeyError, TypeError):
            # Nothing sensible to answer; the engine's timeout lets the flow through.
            print(f"flow hook: ignored a malformed request: {line[:200]!r}", file=sys.stderr)
            return
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        answer = {"id": request_id, **decide(flow, self.deny_suffixes)}
        # One write of one whole line: answers of concurrent tasks never interleave.
        writer.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")


def _remove_stale_socket(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SystemExit(f"{path} exists and is not a socket")
        os.unlink(path)


async def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and serve until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(description="An example flow hook for spliceway.")
    parser.add_argument("path", help="the Unix socket to listen on (api.flow_hook.path)")
    parser.add_argument(
        "--deny-suffix",
        action="append",
        default=[],
        metavar="SUFFIX",
        help="deny flows to this host and its subdomains (repeatable)",
    )
    parser.add_argument(
        "--delay-ms",
        type=int,
        default=0,
        help="wait this long before each answer (to see timeouts)",
    )
    parser.add_argument(
        "--mode",
        type=lambda text: int(text, 8),
        default=0o600,
        help="the socket's permissions, octal (default 600: only this user's engine connects)",
    )
    args = parser.parse_args(argv)
    hook = Hook(tuple(args.deny_suffix), args.delay_ms / 1000)
    _remove_stale_socket(args.path)
    server = await asyncio.start_unix_server(hook.serve, path=args.path, limit=16 << 20)
    os.chmod(args.path, args.mode)
    print(f"flow hook listening on {args.path}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.path)


if __name__ == "__main__":
    asyncio.run(main())
