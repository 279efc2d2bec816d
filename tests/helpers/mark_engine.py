"""An engine driven line by line, to watch its socket mark: ``python -m tests.helpers.mark_engine``.

Run inside a test namespace (``Netns.python("-m", "tests.helpers.mark_engine", CONFIG)``)
with the engine's configuration as JSON; ``--mark N`` sets the engine's mark
(:func:`spliceway.support.socket_mark.set_mark`, what the TUN controller does around
auto_route) before the engine starts. It prints ``{"ready": {"socks": port, "dns":
port or null}}`` once the engine runs, then answers one JSON line per command read
from stdin:

- ``mark N``: :func:`spliceway.support.socket_mark.set_mark` (``N`` decimal or 0x-hex):
  ``{"mark": N}``.
- ``socks HOST PORT``: a SOCKS5 CONNECT to ``HOST:PORT`` through the engine's
  ``socks-in`` (an IPv4 literal as ATYP 1), then a line sent and its echo awaited:
  ``{"reply": socks reply code or null, "echo": bool}``.
- ``stats``: the C connection path's counters (``ConnPath.stats``).
- ``resolve NAME``: the engine resolver's blocking ``lookup`` (dnspython's
  synchronous path): ``{"addresses": [...]}`` or ``{"error": text}``.
- ``dns NAME TYPE``: a query over UDP to the engine's DNS server (A and AAAA are the
  resolver's asyncio path, other types are forwarded):
  ``{"rcode": name, "answer": [rrset text...]}`` or ``{"error": text}``.
- ``exit``: stop the engine and exit.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
from typing import Any

import dns.exception
import dns.message
import dns.query
import dns.rcode

from spliceway import Engine
from spliceway.support import socket_mark as mark
from tests.helpers.socks import recv_exact

PAYLOAD = b"marked or not\n"


def _socks(proxy: tuple[str, int], host: str, port: int) -> dict[str, Any]:
    try:
        addr = b"\x01" + socket.inet_aton(host)
    except OSError:
        addr = b"\x03" + bytes([len(host)]) + host.encode()
    with socket.create_connection(proxy, timeout=10) as sock:
        sock.sendall(b"\x05\x01\x00")
        recv_exact(sock, 2)
        sock.sendall(b"\x05\x01\x00" + addr + struct.pack("!H", port))
        try:
            head = recv_exact(sock, 10)
        except (ConnectionError, OSError):
            return {"reply": None, "echo": False}
        if head[1] != 0:
            return {"reply": head[1], "echo": False}
        sock.sendall(PAYLOAD)
        try:
            echoed = recv_exact(sock, len(PAYLOAD)) == PAYLOAD
        except (ConnectionError, OSError):
            echoed = False
        return {"reply": 0, "echo": echoed}


def _dns(server: tuple[str, int], name: str, rdtype: str) -> dict[str, Any]:
    query = dns.message.make_query(name, rdtype)
    try:
        answer = dns.query.udp(query, server[0], port=server[1], timeout=10)
    except (dns.exception.DNSException, OSError) as ex:
        return {"error": f"{type(ex).__name__}: {ex}"}
    return {
        "rcode": dns.rcode.to_text(answer.rcode()),
        "answer": [rrset.to_text() for rrset in answer.answer],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--mark", type=lambda s: int(s, 0), default=0)
    args = parser.parse_args(argv)
    mark.set_mark(args.mark)
    engine = Engine(json.loads(args.config)).start()

    def say(doc: dict[str, Any]) -> None:
        print(json.dumps(doc), flush=True)

    try:
        dns_port = engine.dns_address()[1]
    except Exception:
        dns_port = None
    socks = engine.listen_address("socks-in")
    say({"ready": {"socks": socks[1], "dns": dns_port}})
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "mark":
                mark.set_mark(int(cmd[1], 0))
                say({"mark": mark.current_mark()})
            elif cmd[0] == "socks":
                say(_socks(socks, cmd[1], int(cmd[2])))
            elif cmd[0] == "stats":
                say(engine.core.bridge.conn.stats())
            elif cmd[0] == "resolve":
                try:
                    say({"addresses": engine.core.resolver.lookup(cmd[1], timeout=10)})
                except Exception as ex:
                    say({"error": f"{type(ex).__name__}: {ex}"})
            elif cmd[0] == "dns":
                say(_dns(engine.dns_address(), cmd[1], cmd[2]))
            elif cmd[0] == "exit":
                break
            else:
                say({"error": f"unknown command {line.strip()!r}"})
    finally:
        engine.stop()
        mark.set_mark(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
