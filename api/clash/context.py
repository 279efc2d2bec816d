"""What every route of the Clash API reads: the engine's control plane and settings."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from spliceway.api.plane import ControlPlane
from spliceway.config import ClashApi

__all__ = ["ClashContext"]


@dataclass(slots=True)
class ClashContext:
    """One Clash listener's view of the engine (built once per start).

    ``secret`` is the value of ``settings.secret_env`` read at start (None: no
    secret, keyless browser protection applies). ``listen`` is the bound
    ``(address, port)``, set by the server once it has bound. ``storage_dir`` is where
    ``/storage/{key}`` keeps its documents (None: a directory could not be chosen and
    storage answers 503).
    """

    plane: ControlPlane
    settings: ClashApi
    secret: str | None
    storage_dir: str | None = None
    listen: tuple[str, int] | None = None
    #: ``GLOBAL``'s member while the mode is not ``global`` (mode ``global`` reads the
    #: routing state's outbound instead); None until a client picks one.
    global_choice: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
