"""The running engine's providers: their content, status, cached copies and refreshes.

:class:`Providers` is the engine's one record of every provider (``providers.proxies``
and ``providers.rules``) and of the downloadable geodata (``runtime.geodata``):

- **content**: each proxy provider's last good body, read (its outbounds). The
  reconciler merges it into every configuration it applies (:meth:`materialise`,
  under the apply lock), so an apply and a refresh always install the newest content,
  whichever runs first: a refresh never installs what an apply since replaced.
- **cache**: a URL provider's last good body is kept in the file
  :func:`~spliceway.config.provider_paths.provider_content_path` names, written
  atomically (temporary file, fsync, rename), with a small ``.meta.json`` beside it
  (when it was fetched, ETag / Last-Modified, ``subscription-userinfo``, its SHA-256).
  At start every provider is read from that file (or its ``path``), so the engine
  starts offline with what it last had.
- **refresh** (:meth:`refresh`, run by the refresher actor, never on the dispatcher
  thread): fetch or re-read, check, cache, reload, and the events ``provider.updated``
  / ``provider.failed``. A body that fails any check leaves the last good copy in use.

A URL's query and path often hold the subscription's secret token: events, the status
and the log show only ``scheme://host[:port]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import maxminddb
import orjson

from spliceway.config import Config
from spliceway.config.provider_paths import provider_content_path
from spliceway.engine.provider_fetch import FetchError, fetch
from spliceway.errors import ApiError
from spliceway.events.log import now_ms
from spliceway.flows.probe import probe
from spliceway.providers import rule_sets
from spliceway.providers.materialise import Materialised, materialise
from spliceway.providers.subscription import (
    BodyError,
    ProxyContent,
    SubscriptionInfo,
    origin_of,
    parse_proxy_body,
    parse_userinfo,
)
from spliceway.routing.policy import PROBE_TIMEOUT_S, MemberHealth, parse_probe_url, probe_url_for
from spliceway.support.atomic_file import StagedFile, replace_file

if TYPE_CHECKING:
    from spliceway.events.log import EventLog
    from spliceway.flows.outbounds import Outbound

logger = logging.getLogger(__name__)

Kind = Literal["proxies", "rules", "geodata"]

#: The whole download, redirects included.
FETCH_DEADLINE_S = 60.0
#: The longest wait for the origin's next bytes.
STALL_TIMEOUT_S = 15.0
#: A geodata download's size limit (a full GeoLite2-City is about 70 MiB).
GEODATA_SIZE_LIMIT = 256 * 1024 * 1024
#: A provider without a good copy is tried again after at most this long.
RETRY_S = 60
META_SUFFIX = ".meta.json"
#: The geodata entries: ``runtime.geodata``'s (path, url) field names.
GEODATA = {"geoip": ("geoip_path", "geoip_url"), "geosite": ("geosite_path", "geosite_url")}


@dataclass(slots=True)
class ProviderState:
    """What the engine knows of one provider (or geodata file) now."""

    kind: Kind
    name: str
    #: What makes a read copy valid for the configured provider (its source and reading).
    identity: tuple[Any, ...]
    url: str | None
    path: str
    interval_seconds: int | None
    via: str | None
    size_limit: int
    format: str | None = None
    behavior: str | None = None
    #: A proxy provider's ``health_check``: ``(url, interval_seconds)`` when enabled.
    health_check: tuple[str, int] | None = None
    #: A proxy provider's last good content (None: none yet).
    content: ProxyContent | None = None
    #: A rule provider's entries in its last good copy (None: not counted yet).
    rule_count: int | None = None
    #: A rule provider's entries skipped as unusable in that copy.
    rule_skipped: int | None = None
    sha256: str | None = None
    #: When the copy in use was fetched or read (UNIX ms); None: there is none.
    updated_at_ms: int | None = None
    #: When the last refresh attempt ended.
    checked_at_ms: int | None = None
    last_error: str | None = None
    last_error_at_ms: int | None = None
    userinfo: SubscriptionInfo | None = None
    etag: str | None = None
    last_modified: str | None = None
    next_update_at_ms: int | None = None
    #: True while a refresh of it is running.
    updating: bool = False

    @property
    def source(self) -> str:
        """``url`` (fetched) or ``path`` (read from a file of the user's)."""
        return "url" if self.url is not None else "path"

    @property
    def has_copy(self) -> bool:
        """Whether a good copy is in use."""
        return self.updated_at_ms is not None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one refresh of one provider ended."""

    kind: Kind
    name: str
    #: ``updated`` (new content, in use), ``unchanged`` or ``failed``.
    outcome: str
    error: str | None = None

    def to_dict(self, state: ProviderState | None) -> dict[str, Any]:
        """The ``providers.update`` result item."""
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "outcome": self.outcome,
            "error": self.error,
            "updated_at_unix_ms": state.updated_at_ms if state else None,
        }
        return out


@dataclass(frozen=True, slots=True)
class RefreshPorts:
    """What a refresh uses of the running engine."""

    log: EventLog
    #: The dispatcher's loop (outbounds dial on it).
    loop: Callable[[], asyncio.AbstractEventLoop]
    #: The outbound a tag (an outbound or a group) uses now.
    outbound: Callable[[str], Outbound]
    #: Apply the running configuration again with the providers' new content
    #: (``force``: even when the merged configuration is unchanged, as for rule sets).
    reload: Callable[[bool], Any]
    #: The tags a proxy provider gives the running configuration.
    members: Callable[[str], list[str]] = lambda name: []
    #: Record a probe's result as an outbound's latest health (the policy table's).
    record: Callable[[str, MemberHealth], None] = lambda tag, health: None


@dataclass(slots=True)
class _Checked:
    """A body that passed its checks, ready to cache and use."""

    body: bytes
    sha256: str
    content: ProxyContent | None = None
    rules: rule_sets.RuleSetCounts | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = orjson.loads(f.read())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _health_check(config: Config, spec: Any) -> tuple[str, int] | None:
    check = getattr(spec, "health_check", None)
    if check is None or not check.enabled:
        return None
    url = probe_url_for(check.url, config.runtime.latency_test_url)
    return url, check.interval_seconds


def _identity(kind: Kind, spec: Any) -> tuple[Any, ...]:
    if kind == "proxies":
        return (spec.url, spec.path, spec.format)
    return (spec.url, spec.path, spec.behavior, spec.format)


class Providers:
    """Every provider's content and status (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[tuple[Kind, str], ProviderState] = {}
        #: Serialises refreshes (the refresher runs one round at a time; a command waits).
        self._refresh_lock = threading.Lock()
        #: Called (no arguments) when the set of providers or their schedules changed.
        self.on_changed: Callable[[], None] | None = None
        #: Downloads running on the dispatcher loop (cancelled by :meth:`close`).
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._closed = False

    def close(self) -> None:
        """The engine is stopping: cancel the downloads in flight (before the dispatcher
        stops) and emit no more provider events."""
        with self._lock:
            self._closed = True
            inflight = list(self._inflight)
        for future in inflight:
            future.cancel()

    # -- the configured providers ------------------------------------------------------

    def sync(self, config: Config) -> bool:
        """Track the providers of ``config``: new or changed ones are read from disk (their
        cached copy or their ``path``), removed ones forgotten. True when any changed."""
        wanted: dict[tuple[Kind, str], Any] = {}
        for name, proxy_spec in config.providers.proxies.items():
            wanted[("proxies", name)] = proxy_spec
        for name, rule_spec in config.providers.rules.items():
            wanted[("rules", name)] = rule_spec
        geodata = config.runtime.geodata
        for name, (path_key, url_key) in GEODATA.items():
            path, url = getattr(geodata, path_key), getattr(geodata, url_key)
            if path is not None and url is not None:
                wanted[("geodata", name)] = (os.path.abspath(path), url)
        changed = False
        with self._lock:
            for key in list(self._states):
                if key not in wanted:
                    del self._states[key]
                    changed = True
        for key, spec in wanted.items():
            kind, name = key
            with self._lock:
                current = self._states.get(key)
            fresh = self._new_state(config, kind, name, spec)
            if current is not None and current.identity == fresh.identity:
                settings = ("interval_seconds", "via", "size_limit", "health_check")
                if any(getattr(current, k) != getattr(fresh, k) for k in settings):
                    with self._lock:
                        for k in settings:
                            setattr(current, k, getattr(fresh, k))
                    changed = True
                continue
            self._load(fresh)
            with self._lock:
                self._states[key] = fresh
            changed = True
        if changed and self.on_changed is not None:
            with contextlib.suppress(Exception):
                self.on_changed()
        return changed

    @staticmethod
    def _new_state(config: Config, kind: Kind, name: str, spec: Any) -> ProviderState:
        if kind == "geodata":
            path, url = spec
            return ProviderState(kind, name, (path, url), url, path, None, None, GEODATA_SIZE_LIMIT)
        return ProviderState(
            kind=kind,
            name=name,
            identity=_identity(kind, spec),
            url=spec.url,
            path=provider_content_path(config, kind, name),
            interval_seconds=spec.interval_seconds,
            via=spec.via,
            size_limit=spec.size_limit_bytes,
            format=spec.format,
            behavior=getattr(spec, "behavior", None),
            health_check=_health_check(config, spec),
        )

    def _load(self, state: ProviderState) -> None:
        """Read a provider's copy on disk into ``state`` (at start, or for a new provider);
        a copy that cannot be used is an error in its status, never an exception."""
        if state.kind == "geodata":
            with contextlib.suppress(OSError):
                state.updated_at_ms = int(os.stat(state.path).st_mtime * 1000)
            return
        meta: dict[str, Any] = {}
        if state.url is not None:
            meta = _read_json(state.path + META_SUFFIX)
            if meta.get("url") != state.url:
                # Fetched for another URL (or never): not this provider's content.
                return
        try:
            with open(state.path, "rb") as f:
                body = f.read(state.size_limit + 1)
            stat = os.stat(state.path)
        except FileNotFoundError:
            if state.url is None:
                self._failed_load(state, f"{state.path} does not exist")
            return
        except OSError as ex:
            self._failed_load(state, f"cannot read {state.path}: {ex.strerror or ex}")
            return
        try:
            # A rule set is read (and refused, if it must be) by routing when the
            # configuration is built: not twice at start.
            checked = (
                _Checked(body, _sha(body)) if state.kind == "rules" else self._check(state, body)
            )
        except BodyError as ex:
            where = "the cached copy" if state.url is not None else state.path
            self._failed_load(state, f"{where} is not usable: {ex}")
            return
        state.content = checked.content
        state.sha256 = checked.sha256
        fetched = meta.get("fetched_at_unix_ms")
        same = meta.get("sha256") == checked.sha256
        if same and isinstance(fetched, int):
            state.updated_at_ms = fetched
            state.etag = meta.get("etag") if isinstance(meta.get("etag"), str) else None
            modified = meta.get("last_modified")
            state.last_modified = modified if isinstance(modified, str) else None
            info = meta.get("userinfo")
            state.userinfo = parse_userinfo(info) if isinstance(info, str) else None
        else:
            # Its metadata is missing or of another body (a crash between the two writes).
            state.updated_at_ms = int(stat.st_mtime * 1000)
        if same and isinstance(meta.get("entries"), int):
            state.rule_count = meta["entries"]
            skipped = meta.get("skipped")
            state.rule_skipped = skipped if isinstance(skipped, int) else None

    @staticmethod
    def _failed_load(state: ProviderState, message: str) -> None:
        logger.warning("provider %s/%s: %s", state.kind, state.name, message)
        state.last_error = message
        state.last_error_at_ms = now_ms()

    # -- content -----------------------------------------------------------------------

    def contents(self) -> dict[str, ProxyContent | None]:
        """Every proxy provider's current content, by name."""
        with self._lock:
            return {
                name: s.content for (kind, name), s in self._states.items() if kind == "proxies"
            }

    def materialise(self, config: Config) -> Materialised:
        """``config`` with its proxy providers' current content merged in (tracking its
        providers first); see :mod:`spliceway.providers.materialise`.

        Every body was tried against the configuration before it was taken, so the merge
        validates; should it not (a bug), the configuration is merged without any
        provider's content, each provider's status says why, and the document itself
        still applies."""
        self.sync(config)
        try:
            return materialise(config, self.contents())
        except ApiError as ex:
            logger.error("merging the proxy providers' content failed: %s", ex.message)
            at = now_ms()
            with self._lock:
                for (kind, _), state in self._states.items():
                    if kind == "proxies" and state.content is not None:
                        state.last_error = f"its content does not fit the configuration: {ex}"
                        state.last_error_at_ms = at
            return materialise(config, {})

    def state(self, kind: Kind, name: str) -> ProviderState | None:
        """A copy of one provider's state (None: not configured)."""
        with self._lock:
            s = self._states.get((kind, name))
            return None if s is None else replace(s)

    def states(self) -> list[ProviderState]:
        """Copies of every provider's state: proxies, then rules, then geodata."""
        order = {"proxies": 0, "rules": 1, "geodata": 2}
        with self._lock:
            items = [replace(s) for s in self._states.values()]
        return sorted(items, key=lambda s: order[s.kind])

    def schedule(self, kind: Kind, name: str, at_ms: int | None) -> None:
        """Record when a provider's next refresh is due (the refresher's plan)."""
        with self._lock:
            s = self._states.get((kind, name))
            if s is not None:
                s.next_update_at_ms = at_ms

    # -- checks ------------------------------------------------------------------------

    def _check(self, state: ProviderState, body: bytes) -> _Checked:
        """``body`` read as ``state``'s content; BodyError when it cannot be."""
        checked = _Checked(body, _sha(body))
        if state.kind == "proxies":
            checked.content = parse_proxy_body(body, state.format)  # type: ignore[arg-type]
        elif state.kind == "rules":
            checked.rules = rule_sets.check(body, state.behavior or "", state.format or "")
        return checked

    # -- refresh -----------------------------------------------------------------------

    def refresh(
        self,
        ports: RefreshPorts,
        targets: Iterable[tuple[Kind, str]],
        trigger: str,
        source: Callable[[], Config],
    ) -> list[tuple[Outcome, ProviderState | None]]:
        """Refresh ``targets`` (fetch or re-read, check, cache), reload once if any changed,
        then emit their events; every outcome, in order, with the provider's state after.

        ``source`` is the configuration as written (what the merge is tried on). Blocks
        the calling thread, which must not be the dispatcher's.
        """
        with self._refresh_lock:
            chosen: list[ProviderState] = []
            with self._lock:
                for key in targets:
                    s = self._states.get(key)
                    if s is not None:
                        s.updating = True
                        chosen.append(replace(s))
            # The rule sets the checks parsed, held until the reload read them (the same
            # bytes give the same set while held: parsed once, on this thread).
            parsed: list[Any] = []
            try:
                bodies = self._read_all(ports, chosen)
                outcomes = [
                    self._take(state, got, source, parsed)
                    for state, got in zip(chosen, bodies, strict=True)
                ]
                outcomes = self._reload(ports, outcomes)
            finally:
                parsed.clear()
                with self._lock:
                    for s in chosen:
                        live = self._states.get((s.kind, s.name))
                        if live is not None:
                            live.updating = False
            result: list[tuple[Outcome, ProviderState | None]] = []
            for outcome in outcomes:
                after = self.state(outcome.kind, outcome.name)
                if not self._closed:  # no event after engine.stopped
                    self._emit(ports.log, outcome, after, trigger)
                result.append((outcome, after))
            return result

    def _read_all(self, ports: RefreshPorts, chosen: list[ProviderState]) -> list[Any]:
        """Each provider's new body: fetched (all at once, on the dispatcher loop) or read;
        a FetchError, an OSError text or a Fetched-like tuple per provider."""
        loop = ports.loop()
        futures: dict[int, concurrent.futures.Future[Any]] = {}
        for i, state in enumerate(chosen):
            if state.url is None:
                continue
            try:
                outbound = ports.outbound(state.via or "direct")
            except Exception as ex:  # the via tag vanished: a configuration changed
                futures[i] = concurrent.futures.Future()
                futures[i].set_exception(FetchError(f"outbound {state.via!r}: {ex}"))
                continue
            headers: dict[str, str] = {}
            if state.has_copy and state.etag:
                headers["If-None-Match"] = state.etag
            if state.has_copy and state.last_modified:
                headers["If-Modified-Since"] = state.last_modified
            coro = fetch(
                loop,
                outbound,
                state.url,
                size_limit=state.size_limit,
                deadline_s=FETCH_DEADLINE_S,
                stall_s=STALL_TIMEOUT_S,
                headers=headers,
            )
            with self._lock:
                if self._closed:
                    coro.close()
                    futures[i] = concurrent.futures.Future()
                    futures[i].set_exception(FetchError("the engine is stopping"))
                    continue
                futures[i] = asyncio.run_coroutine_threadsafe(coro, loop)
                self._inflight.add(futures[i])
        out: list[Any] = []
        for i, state in enumerate(chosen):
            if state.url is None:
                out.append(self._read_file(state))
                continue
            try:
                out.append(futures[i].result(timeout=FETCH_DEADLINE_S + 5))
            except FetchError as ex:
                out.append(ex)
            except concurrent.futures.CancelledError:
                out.append(FetchError("the engine is stopping"))
            except concurrent.futures.TimeoutError:
                futures[i].cancel()
                out.append(FetchError(f"no complete answer within {FETCH_DEADLINE_S:g} s"))
            except Exception as ex:  # a bug of ours must not end the refresher
                logger.exception("fetching provider %s/%s failed", state.kind, state.name)
                out.append(FetchError(f"internal error: {type(ex).__name__}: {ex}"))
            finally:
                with self._lock:
                    self._inflight.discard(futures[i])
        return out

    @staticmethod
    def _read_file(state: ProviderState) -> bytes | FetchError:
        try:
            with open(state.path, "rb") as f:
                body = f.read(state.size_limit + 1)
        except OSError as ex:
            return FetchError(f"cannot read {state.path}: {ex.strerror or ex}")
        if len(body) > state.size_limit:
            return FetchError(f"{state.path} is larger than size_limit_bytes ({state.size_limit})")
        return body

    def _take(
        self, state: ProviderState, got: Any, source: Callable[[], Config], parsed: list[Any]
    ) -> Outcome:
        """Check a new body and make it the provider's copy; how that went. A rule set the
        check read is added to ``parsed``."""
        kind, name = state.kind, state.name
        if isinstance(got, FetchError):
            return self._fail(state, got.message)
        headers: Mapping[str, str] = {}
        if isinstance(got, bytes):
            body = got
        else:
            headers = got.headers
            if got.status == 304:
                return self._unchanged(state, headers)
            body = got.body
        sha = _sha(body)
        if state.kind == "geodata" and state.sha256 is None:
            state.sha256 = _file_sha(state.path)  # not hashed at start: it may be large
        if state.has_copy and sha == state.sha256:
            return self._unchanged(state, headers)
        try:
            checked = self._checked_body(state, body, source)
        except BodyError as ex:
            return self._fail(state, str(ex))
        checked.headers = headers
        if checked.rules is not None and checked.rules.data is not None:
            parsed.append(checked.rules.data)
        at = now_ms() if state.url is not None else _mtime_ms(state.path)
        try:
            if state.url is not None:
                self._write(state, checked, at)
        except BodyError as ex:  # a geodata file its reader refused
            return self._fail(state, str(ex))
        except OSError as ex:
            return self._fail(
                state, f"cannot write the cached copy {state.path}: {ex.strerror or ex}"
            )
        info = headers.get("subscription-userinfo")
        with self._lock:
            live = self._states.get((kind, name))
            if live is None or live.identity != state.identity:
                # The configuration changed meanwhile: this body is for a provider that is
                # no longer configured so.
                return Outcome(kind, name, "failed", "the provider was reconfigured meanwhile")
            live.content, live.sha256 = checked.content, checked.sha256
            if checked.rules is not None:
                live.rule_count = checked.rules.entries
                live.rule_skipped = checked.rules.skipped
            live.updated_at_ms = at
            live.checked_at_ms = now_ms()
            live.last_error = None
            live.last_error_at_ms = None
            if state.url is not None:
                live.etag = headers.get("etag")
                live.last_modified = headers.get("last-modified")
                if info is not None:
                    live.userinfo = parse_userinfo(info)
        return Outcome(kind, name, "updated")

    def _checked_body(
        self, state: ProviderState, body: bytes, source: Callable[[], Config]
    ) -> _Checked:
        if state.kind == "geodata":
            return _Checked(body, _sha(body))  # opened before it replaces the file
        checked = self._check(state, body)
        if checked.content is not None:
            # The merge must validate with it, or every later apply would fail.
            contents = self.contents()
            contents[state.name] = checked.content
            try:
                materialise(source(), contents)
            except ApiError as ex:
                raise BodyError(f"its outbounds do not fit the configuration: {ex}") from None
        return checked

    def _write(self, state: ProviderState, checked: _Checked, at: int) -> None:
        """Replace the cached copy (and its metadata) atomically; a geodata file is opened
        by its reader first, from a temporary file beside it."""
        os.makedirs(os.path.dirname(state.path), exist_ok=True)
        if state.kind == "geodata":
            install_geodata(state.name, state.path, checked.body)
            return
        replace_file(state.path, checked.body)
        headers = checked.headers
        meta = {
            "url": state.url,
            "fetched_at_unix_ms": at,
            "sha256": checked.sha256,
            "size": len(checked.body),
            "etag": headers.get("etag"),
            "last_modified": headers.get("last-modified"),
            "userinfo": headers.get("subscription-userinfo"),
            "entries": checked.rules.entries if checked.rules else None,
            "skipped": checked.rules.skipped if checked.rules else None,
        }
        replace_file(state.path + META_SUFFIX, orjson.dumps(meta, option=orjson.OPT_INDENT_2))

    def _unchanged(self, state: ProviderState, headers: Mapping[str, str]) -> Outcome:
        info = headers.get("subscription-userinfo")
        at = now_ms()
        with self._lock:
            live = self._states.get((state.kind, state.name))
            if live is not None:
                live.checked_at_ms = at
                live.last_error = None
                live.last_error_at_ms = None
                if state.url is not None:
                    live.updated_at_ms = at
                    if info is not None:
                        live.userinfo = parse_userinfo(info)
        if state.url is not None and state.kind != "geodata":
            # The copy's age restarts, so a restart does not fetch it again at once.
            self._touch_meta(state, at, info)
        return Outcome(state.kind, state.name, "unchanged")

    @staticmethod
    def _touch_meta(state: ProviderState, at: int, info: str | None) -> None:
        meta_path = state.path + META_SUFFIX
        meta = _read_json(meta_path)
        if meta.get("url") != state.url:
            return
        meta["fetched_at_unix_ms"] = at
        if info is not None:
            meta["userinfo"] = info
        with contextlib.suppress(OSError):
            replace_file(meta_path, orjson.dumps(meta, option=orjson.OPT_INDENT_2))

    def _fail(self, state: ProviderState, message: str) -> Outcome:
        at = now_ms()
        logger.warning(
            "provider %s/%s: refresh failed (%s); %s",
            state.kind,
            state.name,
            message,
            "the last good copy stays" if state.has_copy else "it has no copy yet",
        )
        with self._lock:
            live = self._states.get((state.kind, state.name))
            if live is not None:
                live.checked_at_ms = at
                live.last_error = message
                live.last_error_at_ms = at
        return Outcome(state.kind, state.name, "failed", message)

    def _reload(self, ports: RefreshPorts, outcomes: list[Outcome]) -> list[Outcome]:
        """Apply the new content (once for the round); if that fails, the updated ones are
        failures (their content stays for the next apply, which validated it)."""
        updated = [o for o in outcomes if o.outcome == "updated"]
        if not updated:
            return outcomes
        force = any(o.kind != "proxies" for o in updated)
        try:
            ports.reload(force)
        except ApiError as ex:
            logger.warning("applying the providers' new content failed: %s", ex.message)
            return [
                replace(o, outcome="failed", error=f"the reload failed: {ex.message}")
                if o.outcome == "updated"
                else o
                for o in outcomes
            ]
        return outcomes

    # -- health checks -----------------------------------------------------------------

    def health_check(self, ports: RefreshPorts, name: str) -> int:
        """Probe every outbound proxy provider ``name`` gives the running configuration
        through its ``health_check.url`` (all at once, each within the probes' budget),
        each result recorded as the outbound's latest health; how many were probed."""
        state = self.state("proxies", name)
        if state is None or state.health_check is None:
            return 0
        url = parse_probe_url(state.health_check[0])
        tags = ports.members(name)
        loop = ports.loop()
        running = []
        for tag in tags:
            try:
                outbound = ports.outbound(tag)
            except Exception:  # gone with a reload meanwhile
                continue
            coro = probe(loop, outbound, url, PROBE_TIMEOUT_S)
            with self._lock:
                if self._closed:
                    coro.close()
                    break
                future = asyncio.run_coroutine_threadsafe(coro, loop)
                self._inflight.add(future)
            running.append((tag, future))
        for tag, future in running:
            try:
                result = future.result(PROBE_TIMEOUT_S + 1)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                continue
            finally:
                with self._lock:
                    self._inflight.discard(future)
            health = MemberHealth(result.reachable, result.latency_ms, now_ms(), result.error)
            ports.record(tag, health)
        return len(running)

    # -- events ------------------------------------------------------------------------

    @staticmethod
    def _emit(log: EventLog, outcome: Outcome, state: ProviderState | None, trigger: str) -> None:
        if outcome.outcome == "unchanged":
            return
        base: dict[str, Any] = {
            "name": outcome.name,
            "kind": outcome.kind,
            "source": state.source if state else None,
            "url": origin_of(state.url) if state else None,
            "trigger": trigger,
        }
        if outcome.outcome == "updated":
            assert state is not None
            log.emit(
                "provider.updated",
                {
                    **base,
                    "updated_at_unix_ms": state.updated_at_ms,
                    "sha256": state.sha256,
                    **counts(state),
                },
            )
            return
        log.emit(
            "provider.failed",
            {
                **base,
                "error": outcome.error,
                "kept_copy_at_unix_ms": state.updated_at_ms if state else None,
            },
        )


def counts(state: ProviderState) -> dict[str, int | None]:
    """``{outbounds, skipped}`` of a proxy provider, ``{rules}`` of a rule provider, ``{}``
    for geodata."""
    if state.kind == "proxies":
        content = state.content
        return {
            "outbounds": len(content.entries) if content else None,
            "skipped": len(content.skipped) if content else None,
        }
    if state.kind == "rules":
        return {"rules": state.rule_count, "skipped": state.rule_skipped}
    return {}


def check_geodata(name: str, path: str) -> None:
    """Read geodata file ``path`` whole as ``name`` (``geoip``: a MaxMind database;
    ``geosite``: a v2fly ``geosite.dat``) with routing's readers, without their cache (a
    staged file is read once); BodyError saying why it is not one."""
    from spliceway.routing import geodata

    try:
        if name == "geoip":
            reader = maxminddb.open_database(path, maxminddb.MODE_MMAP)
            try:
                db = geodata.GeoIp(path, reader)
                db.lookup("1.1.1.1")
                if db.ip_version == 6:
                    db.lookup("2001:4860:4860::8888")
            finally:
                reader.close()
            return
        message = geodata.GeoSiteListMessage()
        with open(path, "rb") as f:
            message.ParseFromString(f.read())
        entries = {e.country_code.lower(): e for e in message.entry if e.country_code}
        if not entries:
            raise BodyError("no list in it")
        site = geodata.GeoSite(path, entries)
        for list_name in site.names():
            site.domains(list_name)
    except BodyError as ex:
        raise BodyError(f"not a usable {name} database: {ex}") from None
    except Exception as ex:  # every reader's own error: the file is not one
        raise BodyError(f"not a usable {name} database: {type(ex).__name__}: {ex}") from None


def install_geodata(name: str, path: str, body: bytes) -> None:
    """Replace geodata file ``path`` with ``body`` once it was read whole from a temporary
    file beside it (:func:`check_geodata`); BodyError when it cannot be."""
    staged = StagedFile.write(path, body)
    try:
        check_geodata(name, staged.staged_path)
        staged.commit(strict=True)
    except BaseException:
        staged.discard()
        raise


def _file_sha(path: str) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _mtime_ms(path: str) -> int:
    try:
        return int(os.stat(path).st_mtime * 1000)
    except OSError:
        return int(time.time() * 1000)
