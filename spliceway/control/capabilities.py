"""The capabilities resource (docs/http-api.md): what this build can do.

Everything here describes the build as it is, derived from the same tables the
engine dispatches through (commands, error codes), so a client that matches on
capabilities never sees a feature that answers ``unsupported``.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Iterable
from typing import Any

from spliceway import __version__
from spliceway.control.commands import COMMANDS
from spliceway.errors import HTTP_STATUS
from spliceway.events.log import SCHEMA_ID

API_ID = "service.api.v1"
CONFIG_ID = "spliceway.config.v1"
#: The local control socket's framing (docs/ipc.md).
IPC_ID = "spliceway.ipc.v1"
#: The gRPC service ``spliceway.v1.Control`` (docs/grpc.md).
GRPC_ID = "spliceway.grpc.v1"

#: Features built in this version.
FEATURES = (
    "query",
    "config_snapshot",
    "runtime_snapshot",
    "flow_snapshot",
    "policy_snapshot",
    "event_stream",
    "event_sinks",
    "outbox",
    "commands",
    "openapi",
    "ipc",
    "hot_reload",
    # runtime.dns.listen (UDP and TCP) and runtime.dns.answer fake_ip (docs/dns.md).
    "dns_server",
    "fake_ip",
    # tun.start / tun.stop / tun_status and runtime.tun (docs/tun.md); Linux only.
    "tun",
)

BUILD_FEATURES = (
    "splice-relay",
    "aead-copy-relay",
    "http-api",
    "policy-groups",
    "webhook-sinks",
    "durable-outbox",
    "hot-reload",
    "dns-server",
    "tun-system-stack",
)


_BASELINES = {
    "socks5": "RFC 1928, RFC 1929",
    "http": "RFC 9110 CONNECT and absolute-form forwarding",
    "mixed": "socks5 and http on one port, told apart by the first byte",
    "shadowsocks": "SIP004 AEAD",
    "tun": "Linux TUN, system stack (captured TCP NATed to a kernel listener, as sing-tun's "
    '"system" stack), routes and rules over netlink',
}


def _level(supported: bool, level: str, *notes: str) -> dict[str, Any]:
    return {"supported": supported, "level": level, "notes": list(notes)}


_YES = _level(True, "supported")
_NA = _level(False, "not_applicable")


def _protocol(
    protocol: str,
    feature: str,
    *,
    compiled: bool,
    inbound_tcp: dict[str, Any] = _NA,
    inbound_udp: dict[str, Any] = _NA,
    outbound_tcp: dict[str, Any] = _NA,
    outbound_udp: dict[str, Any] = _NA,
    limitations: Iterable[dict[str, str]] = (),
) -> dict[str, Any]:
    # The networks it carries in either direction: what the matrix above says.
    udp = inbound_udp["supported"] or outbound_udp["supported"]
    transports = ["tcp", "udp"] if udp else ["tcp"]
    return {
        "protocol": protocol,
        "feature": feature,
        "compiled": compiled,
        "status": "stable" if compiled else "not_built",
        "compatibility_baseline": _BASELINES.get(protocol, "none"),
        "inbound": {"tcp": inbound_tcp, "udp": inbound_udp},
        "outbound": {"tcp": outbound_tcp, "udp": outbound_udp},
        "transports": transports,
        "mux": _NA,
        "limitations": list(limitations),
    }


_UDP_ASSOCIATE = _level(
    True,
    "supported",
    "UDP ASSOCIATE (RFC 1928 section 7)",
    "no fragmentation: a datagram with FRAG != 0 is dropped",
)

PROTOCOLS: tuple[dict[str, Any], ...] = (
    _protocol(
        "socks5",
        "socks5",
        compiled=True,
        inbound_tcp=_YES,
        inbound_udp=_UDP_ASSOCIATE,
        outbound_tcp=_YES,
        outbound_udp=_level(
            True,
            "supported",
            "a UDP ASSOCIATE with the upstream proxy, relayed by Python",
            "one upstream association per client association (a destination named by "
            "domain has its own)",
        ),
    ),
    _protocol(
        "http",
        "http",
        compiled=True,
        inbound_tcp=_level(True, "supported", "CONNECT", "absolute-URI forwarding"),
        outbound_tcp=_level(True, "supported", "CONNECT"),
    ),
    _protocol(
        "mixed",
        "mixed",
        compiled=True,
        inbound_tcp=_YES,
        inbound_udp=_UDP_ASSOCIATE,
    ),
    _protocol(
        "direct",
        "direct",
        compiled=True,
        outbound_tcp=_YES,
        outbound_udp=_level(True, "supported", "relayed in C (recvmmsg/sendmmsg)"),
    ),
    _protocol(
        "block",
        "block",
        compiled=True,
        outbound_tcp=_YES,
        outbound_udp=_level(True, "supported", "datagrams dropped, the flow blocked"),
    ),
    _protocol(
        "shadowsocks",
        "shadowsocks",
        compiled=True,
        outbound_tcp=_level(
            True,
            "supported",
            "aes-128-gcm",
            "aes-256-gcm",
            "chacha20-ietf-poly1305",
            "relayed by the C copy path (no splice: the stream is encrypted)",
        ),
        outbound_udp=_level(
            True,
            "supported",
            "AEAD per packet (SIP004), as ss-server -u takes it",
            "relayed by Python",
        ),
    ),
    _protocol(
        "tun",
        "tun",
        compiled=True,
        inbound_tcp=_level(
            True,
            "supported",
            "the kernel terminates TCP; accepted connections take the C path (spliced)",
            "auto_route, strict_route, include_cidrs/exclude_cidrs, dns_hijack",
        ),
        inbound_udp=_level(True, "supported", "sessions relayed by Python"),
    ),
)

GLOBAL_LIMITATIONS: tuple[dict[str, str], ...] = (
    {
        "code": "udp_proxy_relay_in_python",
        "message": "UDP through socks5 and shadowsocks outbounds is relayed by Python (direct "
        "UDP is relayed in C)",
    },
    {
        "code": "udp_relay_chains_not_built",
        "message": "UDP through http outbounds and relay groups is not supported",
    },
    {
        "code": "relay_hops_fixed",
        "message": "relay group hops must be socks5, http or shadowsocks outbounds, not groups",
    },
    {
        "code": "dead_letter_replay_not_built",
        "message": "dead letters are kept and listed (spliceway connector state), not re-sent",
    },
    {
        "code": "grpc_not_built",
        "message": "the gRPC control API needs the grpc extra (pip install 'spliceway[grpc]')",
    },
)


#: What the gRPC transport imports from the ``grpc`` extra, in its import order, then
#: the checked-in stubs: generated code that imports nothing of the engine's and
#: refuses a grpcio or protobuf older than the versions that generated it.
_GRPC_EXTRA_MODULES = (
    "grpc",
    "google.protobuf.struct_pb2",
    "grpc_reflection.v1alpha.reflection",
    "spliceway.api.grpc_gen.control_pb2",
    "spliceway.api.grpc_gen.control_pb2_grpc",
)


def grpc_missing() -> str | None:
    """None when the ``grpc`` extra is installed and usable; else why it is not.

    The import is the check (RuntimeError, protobuf's VersionError from the stubs).
    It lives here, below the transports, because capabilities answer it too; the
    gRPC transport asks it before it starts.
    """
    for name in _GRPC_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except Exception as ex:
            return f"{type(ex).__name__}: {ex}"
    return None


@functools.cache
def grpc_built() -> bool:
    """Whether this installation can serve gRPC: the ``grpc`` extra (grpcio,
    grpcio-reflection, protobuf) imports, at versions the checked-in stubs accept.
    Asked once per process (the import is the check)."""
    return grpc_missing() is None


def capabilities(
    permissions: Iterable[str],
    api_enabled: bool = True,
    ipc_enabled: bool = True,
    grpc_enabled: bool = False,
    clash_enabled: bool = False,
) -> dict[str, Any]:
    """The capabilities resource for a caller holding ``permissions``.

    ``grpc_enabled`` is ``api.grpc.enabled``; the gRPC feature, contract and build
    feature are listed whenever the build has gRPC (:func:`grpc_built`), the adapter
    is enabled only when it also serves.
    """
    grpc = grpc_built()
    limitations = [
        item for item in GLOBAL_LIMITATIONS if not (grpc and item["code"] == "grpc_not_built")
    ]
    contracts = [
        {"name": "api", "id": API_ID, "min_version": 1, "max_version": 1},
        {"name": "event", "id": SCHEMA_ID, "min_version": 1, "max_version": 1},
        {"name": "config", "id": CONFIG_ID, "min_version": 1, "max_version": 1},
        {"name": "ipc", "id": IPC_ID, "min_version": 1, "max_version": 1},
    ]
    if grpc:
        contracts.append({"name": "grpc", "id": GRPC_ID, "min_version": 1, "max_version": 1})
    return {
        "api_id": API_ID,
        "schema_id": SCHEMA_ID,
        "engine_version": __version__,
        "adapters": [
            {"kind": "http", "enabled": api_enabled},
            {"kind": "cli", "enabled": True},
            {"kind": "embedded", "enabled": True},
            {"kind": "ipc", "enabled": ipc_enabled},
            {"kind": "grpc", "enabled": grpc and grpc_enabled},
            # The Clash-compatible API (api.clash, docs/clash-api.md).
            {"kind": "clash", "enabled": clash_enabled},
        ],
        "sinks": [
            {"kind": "webhook", "enabled": True},
            {"kind": "jsonl", "enabled": True},
            {"kind": "nats", "enabled": True},
        ],
        "features": [*FEATURES, "grpc"] if grpc else list(FEATURES),
        # Deep copies: the tables share their level objects, and callers may mutate.
        "protocols": copy.deepcopy(list(PROTOCOLS)),
        "build_features": [*BUILD_FEATURES, "grpc-api"] if grpc else list(BUILD_FEATURES),
        "permissions": sorted(set(permissions)),
        "contracts": contracts,
        "error_codes": [
            {"code": code, "http_status": status} for code, status in HTTP_STATUS.items()
        ],
        "commands": [
            {
                "method": c.method,
                "permission": c.permission,
                "available": c.missing is None,
                **({"missing": c.missing} if c.missing is not None else {}),
            }
            for c in COMMANDS.values()
        ],
        "global_limitations": copy.deepcopy(limitations),
    }
