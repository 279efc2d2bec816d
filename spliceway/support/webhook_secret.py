"""Standard Webhooks secrets (``whsec_<base64>``): the key inside one, and the headers it owns.

The pure part of :mod:`spliceway.connector.signing`, here so that the configuration's
checks (a sink's ``secret_env``, its ``headers``) need nothing from the connector.
"""

from __future__ import annotations

import base64
import binascii

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
