#!/usr/bin/env python3
"""A scripted flow hook for the tests: a real process serving a real Unix socket.

    python tests/helpers/flow_hook_server.py PATH PLAN LOG

``PLAN`` is JSON: ``{"answers": {KEY: ANSWER}, "delay_s": {KEY: seconds}, "hold": [KEY]}``.
A request's KEY is ``"host:port"`` of its flow's target if the plan names it, else its
``host``; ANSWER is the answer line without ``id`` (default ``{"verdict": "allow"}``).
A KEY in ``delay_s`` is answered that much later. The KEYs in ``hold`` are answered
together once every one of them has arrived, in the reverse order of their arrival
(pipelining: the engine must match answers by ``id``).

Every request is appended to ``LOG`` as one JSON line (``id``, ``host``, ``port``,
``inbound``, ``state``, ``revision``) before it is answered, so a test sees exactly
which flows reached the hook. ``ready`` goes to stdout once the socket listens.
Standard library only; SIGTERM or SIGKILL ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any


class Hook:
    """Answers requests by the plan; one instance serves every connection."""

    def __init__(self, plan: dict[str, Any], log_path: str) -> None:
        self.answers: dict[str, dict[str, Any]] = plan.get("answers", {})
        self.delays: dict[str, float] = plan.get("delay_s", {})
        self.hold = set(plan.get("hold", ()))
        self.held: list[bytes] = []
        self.log = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def key(self, flow: dict[str, Any]) -> str:
        """The plan key of ``flow``: ``host:port`` when the plan has it, else ``host``."""
        target = flow.get("target") or {}
        host, port = str(target.get("host", "")), target.get("port")
        exact = f"{host}:{port}"
        known = exact in self.answers or exact in self.delays or exact in self.hold
        return exact if known else host

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read requests until the engine disconnects."""
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                request = json.loads(line)
                flow = request["flow"]
                target = flow.get("target") or {}
                self.log.write(
                    json.dumps(
                        {
                            "id": request["id"],
                            "host": target.get("host"),
                            "port": target.get("port"),
                            "inbound": (flow.get("inbound") or {}).get("tag"),
                            "state": flow.get("state"),
                            "revision": flow.get("revision"),
                        }
                    )
                    + "\n"
                )
                key = self.key(flow)
                answer = {"id": request["id"], **self.answers.get(key, {"verdict": "allow"})}
                data = json.dumps(answer).encode() + b"\n"
                if key in self.hold:
                    self.held.append(data)
                    if len(self.held) == len(self.hold):
                        writer.write(b"".join(reversed(self.held)))
                        self.held.clear()
                elif key in self.delays:
                    asyncio.get_running_loop().call_later(self.delays[key], writer.write, data)
                else:
                    writer.write(data)
        writer.close()


async def main() -> None:
    """Serve ``argv[1]`` by the plan ``argv[2]``, logging to ``argv[3]``, until killed."""
    path, plan, log_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a killed predecessor's socket file
    hook = Hook(plan, log_path)
    server = await asyncio.start_unix_server(hook.serve, path=path)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
