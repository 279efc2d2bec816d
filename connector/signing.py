"""Standard Webhooks signatures (https://www.standardwebhooks.com/) for webhook deliveries.

A sink with ``secret_env`` sends three headers with every attempt: ``webhook-id`` (the
event's ``event_id``: the same on every retry, so receivers de-duplicate by it),
``webhook-timestamp`` (the attempt's Unix time in seconds) and ``webhook-signature``
(``v1,`` + base64 of HMAC-SHA256 over ``<id>.<timestamp>.<body>``). Signing at each
attempt rather than once keeps a retry hours later inside a receiver's timestamp
tolerance. The scheme is five lines of ``hmac``; the tests verify its output with the
``standardwebhooks`` package acting as the receiver.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

# The secret format is parsed below the configuration layer (the config checks it too);
# these names stay importable from here for the connector and its users.
from spliceway.support.webhook_secret import (
    MIN_KEY_BYTES,
    SECRET_PREFIX,
    SIGNATURE_HEADERS,
    secret_key,
)

__all__ = ["MIN_KEY_BYTES", "SECRET_PREFIX", "SIGNATURE_HEADERS", "Signer", "secret_key"]


class Signer:
    """Signs webhook deliveries with one key."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def signature(self, event_id: str, timestamp: int, body: bytes) -> str:
        """``v1,<base64 HMAC-SHA256 of "<event_id>.<timestamp>.<body>">``."""
        mac = hmac.new(self._key, b"%s.%d." % (event_id.encode(), timestamp), hashlib.sha256)
        mac.update(body)
        return "v1," + base64.b64encode(mac.digest()).decode("ascii")

    def headers(self, event_id: str, body: bytes, timestamp: int | None = None) -> bytes:
        """The three header lines of one attempt (CRLF-terminated), stamped now by default."""
        ts = int(time.time()) if timestamp is None else timestamp
        sig = self.signature(event_id, ts, body)
        return b"webhook-id: %s\r\nwebhook-timestamp: %d\r\nwebhook-signature: %s\r\n" % (
            event_id.encode(),
            ts,
            sig.encode(),
        )
