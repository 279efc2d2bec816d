"""A real ``nats-server -js`` on loopback for the NATS sink's tests, and a reader of what
its streams hold (through nats-py, as any JetStream client would)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import nats
import pytest
from nats.js.api import StreamConfig

from tests.conftest import wait_until

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"

#: .ci/run installs Debian's nats-server; only a developer's machine without it skips
#: (CI, which sets CI=true, fails instead of skipping).
needs_nats_server = pytest.mark.skipif(
    shutil.which("nats-server") is None and not os.environ.get("CI"),
    reason="needs Debian's nats-server (apt-get install nats-server)",
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """``nats-server -js`` on 127.0.0.1, its store in ``store``; stop and start it again on
    the same port and store to restart it."""

    def __init__(self, store: Path, *, user: str | None = None, password: str | None = None):
        self.store = store
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._auth = ["--user", user, "--pass", password] if user and password else []
        self._log = store.parent / f"nats-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Self:
        """Start the server and wait until it accepts connections."""
        self.store.mkdir(parents=True, exist_ok=True)
        with open(self._log, "ab") as log:
            command = [NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port)]
            self.proc = subprocess.Popen(
                [*command, "-sd", str(self.store), *self._auth],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def accepting() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self._log.read_text()
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return True
            return False

        wait_until(accepting, 10, "nats-server accepting connections")
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL), its pid only."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass(frozen=True)
class Stored:
    """One message a stream holds."""

    seq: int
    msg_id: str | None
    data: bytes


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _connect(url: str, **auth: str):  # type: ignore[no-untyped-def]
    return await nats.connect(url, connect_timeout=5, allow_reconnect=False, **auth)


def add_stream(url: str, name: str, subjects: list[str], **auth: str) -> None:
    """Create stream ``name`` capturing ``subjects`` (file storage, 2 min dedup window)."""

    async def go() -> None:
        nc = await _connect(url, **auth)
        try:
            await nc.jetstream().add_stream(
                StreamConfig(name=name, subjects=subjects, duplicate_window=120.0)
            )
        finally:
            await nc.close()

    _run(go())


def stream_messages(url: str, name: str, **auth: str) -> list[Stored]:
    """Every message stream ``name`` holds, in order."""

    async def go() -> list[Stored]:
        nc = await _connect(url, **auth)
        try:
            jsm = nc.jsm()
            info = await jsm.stream_info(name)
            out: list[Stored] = []
            if not info.state.messages:
                return out  # an empty stream reports first_seq 0, which get_msg refuses
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await jsm.get_msg(name, seq)
                headers = msg.headers or {}
                out.append(Stored(seq, headers.get("Nats-Msg-Id"), msg.data or b""))
            return out
        finally:
            await nc.close()

    return _run(go())
