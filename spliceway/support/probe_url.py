"""Probe URLs: the plain ``http://`` URL a health probe sends HEAD to, parsed.

Pure (no sockets): the configuration validates group and ``runtime.latency_test_url``
URLs with :func:`parse_probe_url`, and the probes (:mod:`spliceway.flows.probe`) send
:meth:`ProbeUrl.head_request` through an outbound.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ProbeUrl:
    """A parsed ``http://`` probe URL."""

    url: str
    host: str
    port: int
    target: str = field(default="/")

    def head_request(self) -> bytes:
        """The HEAD request a probe sends (the connection closes after the answer)."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if self.port != 80:
            host = f"{host}:{self.port}"
        return (
            f"HEAD {self.target} HTTP/1.1\r\nHost: {host}\r\n"
            "User-Agent: spliceway-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        ).encode("ascii")


def parse_probe_url(url: str) -> ProbeUrl:
    """Parse a probe URL; only plain ``http://`` with a host is accepted (ValueError)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as ex:
        raise ValueError(f"not a valid URL: {ex}") from ex
    if parts.scheme.lower() != "http":
        raise ValueError("only http:// URLs can be probed")
    if not parts.hostname:
        raise ValueError("the URL has no host")
    if any(c in url for c in "\r\n \t"):
        raise ValueError("the URL contains whitespace")
    try:
        url.encode("ascii")
    except UnicodeEncodeError as ex:
        raise ValueError("the URL must be ASCII (percent-encode the rest)") from ex
    if port == 0:
        raise ValueError("port 0 cannot be probed")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return ProbeUrl(url, parts.hostname, 80 if port is None else port, target)
