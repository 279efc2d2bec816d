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
import binascii
import hashlib
import hmac
import time

SECRET_PREFIX = "whsec_"
#: The headers a signed delivery sets itself; a sink's configured headers must not.
SIGNATURE_HEADERS = frozenset({"webhook-id", "webhook-timestamp", "webhook-signature"})
#: Shorter keys are refused: the signature is only as strong as the key.
MIN_KEY_BYTES = 16


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret ``whsec_<base64>``; ``ValueError`` saying why when it is not."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("is not a Standard Webhooks secret: it must start with whsec_")
    body = secret[len(SECRET_PREFIX) :]
    try:
        # Unpadded base64 is accepted, as the reference libraries accept it.
        key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            "is not a Standard Webhooks secret: whsec_ must be followed by base64"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"holds a {len(key)}-byte key; a Standard Webhooks secret needs at least "
            f"{MIN_KEY_BYTES} (24 to 64 random bytes are usual)"
        )
    return key


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
