"""Who is calling: API keys from the environment, and the permissions they grant.

Contract (docs/security.md):
- No key configured (``api_key_env`` null and no ``api.control.keys``): no
  authentication, every permission granted.
- Otherwise every request carries ``Authorization: Bearer <key>`` or
  ``X-Service-Api-Key: <key>``. The ``api_key_env`` key is ``admin``; each scoped
  key grants its listed permissions. A missing or wrong key is ``unauthenticated``.
- Keys are compared in constant time, and every configured key is compared on
  every request, so timing reveals neither a key's prefix nor which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from spliceway.config import ControlApi, check_environment_details, control_environment_problems
from spliceway.control.commands import PERMISSIONS, grants
from spliceway.errors import ApiError

ALL_PERMISSIONS = frozenset(PERMISSIONS)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller."""

    name: str
    permissions: frozenset[str]

    def grants(self, permission: str) -> bool:
        """Whether this caller may do what ``permission`` guards (admin may do all)."""
        return grants(self.permissions, permission)

    @property
    def effective_permissions(self) -> frozenset[str]:
        """What the caller may do, admin expanded to every permission."""
        return ALL_PERMISSIONS if "admin" in self.permissions else self.permissions


ANONYMOUS_ADMIN = Principal("anonymous", ALL_PERMISSIONS)


@dataclass(frozen=True, slots=True)
class _Key:
    name: str
    digest: bytes
    permissions: frozenset[str]


def _digest(secret: str) -> bytes:
    # Hashing first makes every comparison the same length, so compare_digest
    # leaks nothing about the configured key's length either.
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class KeyTable:
    """The configured keys; ``authenticate`` maps request headers to a Principal."""

    def __init__(self, keys: list[tuple[str, str, frozenset[str]]]) -> None:
        self._keys = [_Key(name, _digest(secret), perms) for name, secret, perms in keys]

    @classmethod
    def from_config(cls, control: ControlApi, environ: Mapping[str, str] | None = None) -> KeyTable:
        """Read every key from the environment; unset variables are one error naming each."""
        env = os.environ if environ is None else environ
        check_environment_details(control_environment_problems(control, env))
        keys: list[tuple[str, str, frozenset[str]]] = []
        admin = control.read_api_key(env)
        if admin is not None:
            keys.append(("admin", admin, frozenset({"admin"})))
        keys.extend(
            (spec.name, env[spec.key_env], frozenset(spec.permissions)) for spec in control.keys
        )
        return cls(keys)

    @property
    def required(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self._keys)

    def authenticate(self, authorization: str | None, api_key: str | None) -> Principal:
        """The caller named by the headers; raises ``unauthenticated`` when none matches."""
        if not self._keys:
            return ANONYMOUS_ADMIN
        presented = api_key if api_key is not None else _bearer(authorization)
        if presented is None:
            raise ApiError("unauthenticated", "an API key is required")
        digest = _digest(presented)
        found: _Key | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        if found is None:
            raise ApiError("unauthenticated", "the API key is not valid")
        return Principal(found.name, found.permissions)


def _bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
