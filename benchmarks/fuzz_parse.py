"""Build and run benchmarks/fuzz_parse.c, the ASan/UBSan fuzz driver of csrc/parse.c
and csrc/pkt.c.

    python benchmarks/fuzz_parse.py                      # 5 million inputs (or 600 s)
    python benchmarks/fuzz_parse.py --count 20000000 --seconds 1800 --seed 7
    python benchmarks/fuzz_parse.py --prefix-every 8     # more prefix sweeps

The driver is compiled with ``cc -fsanitize=address,undefined -fno-sanitize-recover=all``
into benchmarks/build/ (ignored by git) whenever a source is newer than the binary.
Besides the messages the driver generates itself, it is seeded with messages built
here by the Python codecs (SOCKS5 UDP datagrams, upstream proxy response heads, some
rejected with messages that quote their bytes, and
``host\0user\0pass`` arguments for the CONNECT request builder) and with genuine
ClientHellos from the ssl module (TLS 1.2 and 1.3, with and without SNI), written to
benchmarks/build/fuzz_parse_seeds/.

Every input goes through every parser; see the driver's header comment for the
invariants.  A failure aborts with the sanitizer's or the driver's report and leaves
the input in benchmarks/build/fuzz-parse-failure.bin; the exit status is non-zero.
The run is bounded by --count and --seconds, whichever comes first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

from spliceway.protocols import http, socks5

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BUILD = BENCH / "build"
C_FILES = (
    BENCH / "fuzz_parse.c", ROOT / "csrc" / "parse.c", ROOT / "csrc" / "iplit.c",
    ROOT / "csrc" / "pkt.c",
)  # fmt: skip
SOURCES = (
    *C_FILES,
    *(ROOT / "csrc" / name for name in ("parse.h", "iplit.h", "pkt.h", "ip6text.h")),
)


def build(cc: str) -> Path:
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "fuzz_parse"
    if exe.exists() and all(exe.stat().st_mtime >= src.stat().st_mtime for src in SOURCES):
        return exe
    cmd = [
        cc, "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra",
        "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
        f"-I{ROOT / 'csrc'}", "-o", str(exe), *map(str, C_FILES),
    ]  # fmt: skip
    print("build: " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return exe


def client_hello(server_hostname: str | None, tls12: bool) -> bytes:
    """The first flight of a real ssl-module client (one record, a ClientHello)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with contextlib.suppress(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    hosts = ["example.com", "A-B_c.Example.ORG.", "xn--bcher-kva.example", "a" * 63 + ".io"]
    for i, host in enumerate([*hosts, "bücher.example", None, "192.0.2.1"]):
        for tls12 in (False, True):
            out[f"tls-{i}-{'12' if tls12 else '13'}"] = client_hello(host, tls12)
    out["s5-greeting"] = socks5.client_greeting(True) + bytes([5, 3, 0, 1, 2])
    out["s5-userpass"] = socks5.client_userpass("üser", "pässwörd:x")
    targets = [("example.com", 443), ("192.0.2.1", 80), ("2001:db8::1", 8443),
               ("::ffff:192.0.2.1", 1), ("::192.0.2.1", 2), ("bücher.example", 65535)]  # fmt: skip
    for i, (host, port) in enumerate(targets):
        out[f"s5-request-{i}"] = socks5.client_connect(host, port)
        out[f"s5-udp-{i}"] = socks5.build_udp_datagram(host, port, b"\x00payload" * i, i % 2)
        if not host.isascii():
            continue
        creds = ("user", "pass:word") if i % 2 else None
        out[f"http-connect-{i}"] = http.connect_request(host, port, creds)
        bracketed = f"[{host}]" if ":" in host else host
        out[f"http-get-{i}"] = (
            f"GET http://{bracketed}:{port}/ HTTP/1.1\r\nHost: {bracketed}:{port}\r\n\r\n".encode()
        )
    # Upstream proxy answers (sw_parse_http_response), obs-fold and a bare-LF one too.
    out["http-response-200"] = http.CONNECT_ESTABLISHED
    out["http-response-407"] = http.response(
        407, headers=[("Proxy-Authenticate", 'Basic realm="up"'), ("Via", "1.1 up")]
    )
    out["http-response-502"] = http.response(502, body=b"Bad Gateway\n")
    out["http-response-fold"] = b"HTTP/1.0 200 OK\r\nX-A: a\r\n \tb\x01\r\nVia: v\n\n"
    # Rejected ones whose messages (sw_http_response_error) quote the head's bytes.
    out["http-response-bad-version"] = b"HTTP/1.\xa0\xa1\xad'\"\\\t\x7f 200 OK\r\nVia: v\r\n\r\n"
    out["http-response-bad-name"] = b"HTTP/1.1 407 Nope\r\nX\xe9 'Y': z\r\nVia: v\r\n\r\n"
    out["http-response-bad-value"] = b"HTTP/2.0 502\r\nVia: \x01\r\nX Y: z\r\n\r\n"
    # sw_http_connect_request arguments, "host\0user\0pass" (see run_builder).
    for i, (host, creds) in enumerate(
        [("example.com", ("user", "p\xe4ss:word")), ("[2001:db8::1]", None),
         ("fe80::1%eth0", ("u", "")), ("::ffff:192.0.2.1", ("\U0001f600", "x")),
         ("192.0.2.1", ("", "pw"))]
    ):  # fmt: skip
        args = host.encode()
        if creds is not None:
            args += b"\0" + creds[0].encode() + b"\0" + creds[1].encode()
        out[f"connect-request-{i}"] = args
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--count", type=int, default=5_000_000, help="inputs to run (default 5e6)")
    ap.add_argument("--seconds", type=float, default=600, help="time bound (default 600)")
    ap.add_argument("--seed", type=int, default=1, help="PRNG seed (default 1)")
    ap.add_argument("--prefix-every", type=int, default=64, help="1 in N inputs: every prefix")
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = ap.parse_args()

    exe = build(args.cc)
    seed_dir = BUILD / "fuzz_parse_seeds"
    seed_dir.mkdir(exist_ok=True)
    files = []
    for name, data in seeds().items():
        path = seed_dir / f"{name}.bin"
        path.write_bytes(data)
        files.append(str(path))

    cmd = [str(exe), "-n", str(args.count), "-t", str(args.seconds), "-s", str(args.seed)]
    cmd += ["-p", str(args.prefix_every), *files]
    env = dict(
        os.environ,
        # A small quarantine: the parsers free nothing, and the driver's many short
        # blocks would otherwise hold hundreds of MB.
        ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:quarantine_size_mb=16",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    shown = f"{exe.name} -n {args.count} -t {args.seconds} -s {args.seed} -p {args.prefix_every}"
    print(f"run: {shown} + {len(files)} seed files", file=sys.stderr, flush=True)
    start = time.monotonic()
    status = subprocess.run(cmd, cwd=BUILD, env=env, check=False).returncode
    print(f"fuzz_parse exited {status} after {time.monotonic() - start:.1f} s wall", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
