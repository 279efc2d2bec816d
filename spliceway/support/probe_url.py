"""Probe URLs: the ``http://`` or ``https://`` URL a health probe sends HEAD to, parsed.

Pure (no sockets): the configuration validates group and ``runtime.latency_test_url``
URLs with :func:`parse_probe_url`, and the probes (:mod:`spliceway.flows.probe`) send
:meth:`ProbeUrl.head_request` through an outbound.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ProbeUrl:
    """A parsed ``http://`` or ``https://`` probe URL."""

    url: str
    host: str
    port: int
    target: str = field(default="/")
    #: ``https://``: the probe runs TLS over the dialed connection.
    tls: bool = False

    def head_request(self) -> bytes:
        """The HEAD request a probe sends (the connection closes after the answer)."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if self.port != (443 if self.tls else 80):
            host = f"{host}:{self.port}"
        return (
            f"HEAD {self.target} HTTP/1.1\r\nHost: {host}\r\n"
            "User-Agent: spliceway-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        ).encode("ascii")


def parse_probe_url(url: str) -> ProbeUrl:
    """Parse a probe URL; ``http://`` or ``https://`` with a host (else ValueError)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as ex:
        raise ValueError(f"not a valid URL: {ex}") from ex
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError("only http:// and https:// URLs can be probed")
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
    tls = scheme == "https"
    default_port = 443 if tls else 80
    return ProbeUrl(url, parts.hostname, default_port if port is None else port, target, tls)
