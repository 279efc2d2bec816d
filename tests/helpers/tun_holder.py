"""A process holding a TUN's host side, driven line by line: ``python -m tests.helpers.tun_holder``.

Run inside a test namespace (``Netns.python("-m", "tests.helpers.tun_holder", PARAMS)``)
with the ``tun.start`` params as JSON. It starts a
:class:`spliceway.tun.controller.TunController` and prints one JSON line:
``{"ready": {...status...}, "name": ...}`` or ``{"error": {"code", "message"}}``. Then
it answers one JSON line per command read from stdin:

- ``status``: ``{"status": {...}}`` (``tun_status``).
- ``packets``: ``{"packets": [[version, proto, src, dst, dport], ...]}``: every packet
  the kernel routed into the TUN so far (nobody else reads the device: there is no
  packet loop here, so a captured packet ends in this list).
- ``connect HOST PORT``: a TCP connection dialled by the engine's own
  ``spliceway.flows.outbounds.open_tcp`` (which marks it while a TUN runs), sending an HTTP
  GET: ``{"connected": bool, "reply": first line or "error": text}``.
- ``webhook-connect HOST PORT``: the same through
  :func:`spliceway.support.socket_mark.create_connection`, the webhook client's dial.
- ``stop``: ``{"stopped": bool}`` (``TunController.stop``); ``exit``: exit at once.

Options: ``--state-dir DIR``; ``--fail-after-routes`` makes the start fail after its
routes and rules are in (the egress monitor refuses to start), to test that a failed
start leaves nothing.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import select
import socket
import sys
import threading

from spliceway.errors import ApiError
from spliceway.support import socket_mark as mark
from spliceway.tun.controller import TunController


def _summary(pkt: bytes) -> list | None:
    if not pkt:
        return None
    version = pkt[0] >> 4
    if version == 4 and len(pkt) >= 20:
        ihl = (pkt[0] & 0x0F) * 4
        proto = pkt[9]
        src, dst = ipaddress.IPv4Address(pkt[12:16]), ipaddress.IPv4Address(pkt[16:20])
        l4 = pkt[ihl:]
    elif version == 6 and len(pkt) >= 40:
        proto = pkt[6]
        src, dst = ipaddress.IPv6Address(pkt[8:24]), ipaddress.IPv6Address(pkt[24:40])
        l4 = pkt[40:]
    else:
        return None
    dport = int.from_bytes(l4[2:4], "big") if proto in (6, 17) and len(l4) >= 4 else None
    return [version, proto, str(src), str(dst), dport]


def _capture(fd: int, packets: list, stop: threading.Event) -> None:
    while not stop.is_set():
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            continue
        try:
            pkt = os.read(fd, 65536)
        except BlockingIOError:
            continue
        except OSError:
            return
        summary = _summary(pkt)
        if summary is not None:
            packets.append(summary)


def _exchange(sock: socket.socket) -> dict:
    sock.settimeout(3)
    sock.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
    reply = sock.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    return {"connected": True, "reply": reply}


def _connect(host: str, port: int) -> dict:
    """Dial as the engine's outbounds do (spliceway.flows.outbounds.open_tcp)."""
    import asyncio

    from spliceway.config import DnsSettings
    from spliceway.dns.resolver import Resolver
    from spliceway.flows.outbounds import DialError, open_tcp

    async def dial() -> socket.socket:
        loop = asyncio.get_running_loop()
        sock, _ = await open_tcp(loop, host, port, loop.time() + 3, Resolver(DnsSettings()))
        return sock

    try:
        sock = asyncio.run(dial())
    except (OSError, DialError) as ex:
        return {"connected": False, "error": str(ex)}
    with sock:
        sock.setblocking(True)
        try:
            return _exchange(sock)
        except OSError as ex:
            return {"connected": False, "error": str(ex)}


def _webhook_connect(host: str, port: int) -> dict:
    """Dial as webhook deliveries do (spliceway.support.socket_mark.create_connection)."""
    try:
        sock = mark.create_connection((host, port), 3)
    except OSError as ex:
        return {"connected": False, "error": str(ex)}
    with sock:
        try:
            return _exchange(sock)
        except OSError as ex:
            return {"connected": False, "error": str(ex)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("params")
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--fail-after-routes", action="store_true")
    args = parser.parse_args(argv)
    if args.fail_after_routes:
        from spliceway.tun import controller as ctl

        def refuse(self: object) -> None:
            raise OSError("egress monitor refused (test)")

        ctl.EgressMonitor.start = refuse  # type: ignore[method-assign]

    controller = TunController(state_dir=args.state_dir)

    def say(doc: dict) -> None:
        print(json.dumps(doc), flush=True)

    try:
        handle = controller.start(json.loads(args.params))
    except ApiError as ex:
        say({"error": {"code": ex.code, "message": ex.message}})
        return 1
    except Exception as ex:
        say({"error": {"code": "exception", "message": f"{type(ex).__name__}: {ex}"}})
        return 1
    packets: list = []
    stop = threading.Event()
    reader = threading.Thread(target=_capture, args=(handle.fds[0], packets, stop), daemon=True)
    reader.start()
    say({"ready": controller.status(), "name": handle.name, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "status":
            say({"status": controller.status()})
        elif cmd[0] == "packets":
            say({"packets": list(packets)})
        elif cmd[0] == "connect":
            say(_connect(cmd[1], int(cmd[2])))
        elif cmd[0] == "webhook-connect":
            say(_webhook_connect(cmd[1], int(cmd[2])))
        elif cmd[0] == "stop":
            stop.set()
            reader.join()
            try:
                say({"stopped": controller.stop()})
            except ApiError as ex:
                say({"error": {"code": ex.code, "message": ex.message}})
        elif cmd[0] == "exit":
            return 0
        else:
            say({"error": {"code": "unknown", "message": line.strip()}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
