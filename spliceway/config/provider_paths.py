"""Where each provider's content lives on disk: its own ``path``, or its cached copy.

The one place this is decided, so the loader that reads a provider at start, the
refresher that writes a fetched copy and the views that show it agree.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Literal

from spliceway.config.models import Config

ProviderKind = Literal["proxies", "rules"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def providers_cache_dir(config: Config) -> str:
    """``runtime.providers_cache_dir``, else ``providers/`` beside ``api.outbox_path``, else
    ``$XDG_STATE_HOME/spliceway/providers`` (``~/.local/state/spliceway/providers``)."""
    if config.runtime.providers_cache_dir:
        return os.path.abspath(config.runtime.providers_cache_dir)
    if config.api.outbox_path:
        parent = os.path.dirname(os.path.abspath(config.api.outbox_path))
        return os.path.join(parent, "providers")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "spliceway", "providers")


def cache_file_name(name: str) -> str:
    """A file name for provider ``name`` that no name can turn into a path.

    Names are free text (emoji, slashes, spaces): unsafe characters are replaced and a
    hex digest of the real name is appended, so two names never share a file.
    """
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{_UNSAFE.sub('_', name)[:48]}-{digest}"


def provider_content_path(config: Config, kind: ProviderKind, name: str) -> str:
    """The file holding the content of provider ``name`` of ``kind``: its ``path`` when it
    has one (made absolute), else its last good fetched copy under the cache directory
    (which may not exist yet: never fetched)."""
    spec = (config.providers.proxies if kind == "proxies" else config.providers.rules)[name]
    if spec.path is not None:
        return os.path.abspath(spec.path)
    return os.path.join(providers_cache_dir(config), kind, cache_file_name(name))
