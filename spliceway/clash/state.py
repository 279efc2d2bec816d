"""What the importer's passes share: the report, the names given out, the files to write.

A Clash document names proxies, groups, built-ins (``DIRECT``, ``REJECT``...) and
providers; spliceway's tags live in one namespace with a reserved ``direct``. The
:class:`Names` table gives every Clash name its tag (the name itself when it is free,
else a renamed one, reported), remembers what each name is (a carried proxy, a group, a
built-in, or something skipped and why), and hands out the one ``block`` outbound every
refusal goes to (``REJECT``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from spliceway.clash.report import Report

__all__ = ["BLOCK_TAG", "BUILTINS", "ImportState", "NameInfo", "Names"]

#: Tag of the ``block`` outbound that ``REJECT`` (and every refused target) becomes.
BLOCK_TAG = "REJECT"

#: mihomo's built-in proxies (``config/config.go`` ``parseProxies``) and what each is here.
BUILTINS: dict[str, str] = {
    "DIRECT": "direct",
    "REJECT": BLOCK_TAG,
    "REJECT-DROP": BLOCK_TAG,
    "COMPATIBLE": BLOCK_TAG,
    "PASS": "",
}

#: mihomo's adapter type names (``exclude-type`` compares them, case-insensitively).
ADAPTER_TYPES: dict[str, str] = {
    "ss": "Shadowsocks",
    "ssr": "ShadowsocksR",
    "socks5": "Socks5",
    "http": "Http",
    "vmess": "Vmess",
    "vless": "Vless",
    "trojan": "Trojan",
    "hysteria": "Hysteria",
    "hysteria2": "Hysteria2",
    "tuic": "Tuic",
    "wireguard": "WireGuard",
    "snell": "Snell",
    "ssh": "Ssh",
    "mieru": "Mieru",
    "anytls": "AnyTLS",
    "direct": "Direct",
    "reject": "Reject",
    "dns": "Dns",
    "select": "Selector",
    "url-test": "URLTest",
    "fallback": "Fallback",
    "load-balance": "LoadBalance",
    "relay": "Relay",
    "DIRECT": "Direct",
    "REJECT": "Reject",
    "REJECT-DROP": "RejectDrop",
    "COMPATIBLE": "Compatible",
    "PASS": "Pass",
}

Kind = Literal["proxy", "group", "builtin", "skipped"]


@dataclass(slots=True)
class NameInfo:
    """What a Clash name is: its ``kind``, its spliceway ``tag`` (empty for a skipped
    proxy or ``PASS``), its Clash ``type`` and, when skipped, why."""

    kind: Kind
    tag: str
    type: str
    why: str = ""
    #: The outbound's protocol for a carried proxy (``shadowsocks``...), else empty.
    protocol: str = ""


class Names:
    """Clash names to spliceway tags (see the module)."""

    def __init__(self) -> None:
        self._by_name: dict[str, NameInfo] = {
            name: NameInfo("builtin", tag, name) for name, tag in BUILTINS.items()
        }
        # ``direct`` is the built-in direct outbound's; ``REJECT`` the block outbound's.
        self._taken: set[str] = {"direct", BLOCK_TAG}
        self.block_used = False

    def get(self, name: str) -> NameInfo | None:
        """What ``name`` is, or None when the document never defined it."""
        return self._by_name.get(name)

    def defined(self, name: str) -> bool:
        """Whether ``name`` is a proxy, group or built-in of the document (even skipped)."""
        return name in self._by_name

    def free_tag(self, wanted: str) -> str:
        """``wanted`` when no tag has it, else ``wanted (2)``, ``wanted (3)``...; taken."""
        tag, n = wanted, 1
        while tag in self._taken:
            n += 1
            tag = f"{wanted} ({n})"
        self._taken.add(tag)
        return tag

    def add(self, name: str, kind: Kind, ptype: str, why: str = "", protocol: str = "") -> NameInfo:
        """Register Clash ``name`` (not yet defined) and give it a tag (none when skipped)."""
        tag = "" if kind == "skipped" else self.free_tag(name)
        info = NameInfo(kind, tag, ptype, why, protocol)
        self._by_name[name] = info
        return info

    def block(self) -> str:
        """The ``block`` outbound's tag (the outbound is written when used)."""
        self.block_used = True
        return BLOCK_TAG

    def proxies(self) -> list[str]:
        """Clash names of the carried proxies, in document order."""
        return [n for n, i in self._by_name.items() if i.kind == "proxy"]


@dataclass(slots=True)
class ImportState:
    """Everything the passes build: the report, names, the spliceway document's parts,
    the files to write beside the output, and where relative paths are resolved
    (``home``, mihomo's home directory: the source file's directory)."""

    home: str
    files_dir: str
    report: Report = field(default_factory=Report)
    names: Names = field(default_factory=Names)
    outbounds: list[dict[str, Any]] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    proxy_providers: dict[str, dict[str, Any]] = field(default_factory=dict)
    rule_providers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Files to write: absolute path -> text.
    files: dict[str, str] = field(default_factory=dict)

    def resolve(self, path: str) -> str:
        """``path`` as mihomo resolves it: relative to its home directory."""
        expanded = os.path.expanduser(path)
        return os.path.normpath(os.path.join(self.home, expanded))

    def inside_home(self, resolved: str) -> bool:
        """Whether ``resolved`` is under mihomo's home: mihomo refuses a provider or
        dashboard path elsewhere (unless the user lists it in ``SAFE_PATHS``), so a
        subscription cannot make the engine read an arbitrary file."""
        home = os.path.normpath(self.home)
        return os.path.commonpath([home, resolved]) == home
