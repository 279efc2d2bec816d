"""Pykka actors that share one event-loop thread instead of owning a thread each.

A ``pykka.ThreadingActor`` costs an OS thread (stack, ~0.4 ms to start). A proxy
holds thousands of flows, most of them idle once the C relay owns their bytes,
so flow and listener actors are ``LoopActor``s: their inbox is drained on a
shared ``Dispatcher`` (an asyncio loop in one thread). Pykka's semantics hold:
messages to one actor are handled one at a time and in order, ``ask`` futures
are ordinary ``ThreadingFuture``s any thread can wait on, ``on_start``,
``on_stop`` and ``on_failure`` run on the actor's execution context, and the
actor is in the ``ActorRegistry`` while alive (unless its class sets
``registered = False``: a flow actor, one per connection, is tracked by the
engine's own tables instead of pykka's list, whose removal is O(n)).

Starting one is cheap, because a proxy starts one per connection: a counter URN
instead of ``uuid4``, a plain flag instead of a ``threading.Event`` (only the
dispatcher thread sets it; readers elsewhere only test it), no log line
formatted per start or stop. Started from the dispatcher thread, ``on_start``
runs at once; a message told from that thread to an idle actor is handled at
once too (still one at a time and in order), saving a loop round per message.

Handlers must never block: socket work is done with the loop's non-blocking
primitives (``sock_recv``, ``sock_connect``...), inside tasks the actor starts.
Because every ``LoopActor`` of a dispatcher runs on the same thread, a task an
actor starts may touch that actor's state directly.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from collections import deque
from typing import Any

import pykka
from pykka import ActorDeadError, ActorRef, ActorRegistry, messages

# The loop thread itself knows nothing of actors, so it sits below them (the DNS and
# TUN packages use it too); re-exported, as actors and their callers name it here.
from spliceway.support.loop import Dispatcher

__all__ = ["Dispatcher", "LoopActor"]

logger = logging.getLogger(__name__)


_urns = itertools.count(1)


class _Flag:
    """The part of ``threading.Event`` pykka uses for ``actor_stopped``: set once, on the
    dispatcher thread; tested from any thread (a bool read is atomic)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True


class _LoopInbox:
    """An actor inbox that schedules its owner's drain on the dispatcher.

    The queue exists only while messages wait: an idle flow's actor holds none
    (a deque is 760 bytes, and a proxy keeps thousands of idle flows).
    """

    __slots__ = ("_lock", "_queue", "_scheduled", "owner")

    def __init__(self) -> None:
        self._queue: deque[Any] | None = None
        self._lock = threading.Lock()
        # Scheduled from birth: nothing may drain before the actor's on_start ran.
        self._scheduled = True
        self.owner: LoopActor | None = None

    def put(self, envelope: Any, /) -> None:
        owner = self.owner
        if owner is None:
            # Stopped (and unlinked) after the sender checked it was alive.
            if envelope.reply_to is not None:
                err = ActorDeadError("actor stopped before handling the message")
                envelope.reply_to.set_exception(exc_info=(ActorDeadError, err, None))
            return
        with self._lock:
            queue = self._queue
            if queue is None:
                queue = self._queue = deque()
            queue.append(envelope)
            if self._scheduled:
                return
            self._scheduled = True
        dispatcher = owner.dispatcher
        if dispatcher.in_loop_thread:
            # Idle, and we are on its thread: handle it now (nothing can interleave).
            owner._drain()
        else:
            dispatcher.loop.call_soon_threadsafe(owner._drain)

    def get(self) -> Any:
        # Only the draining dispatcher takes, and only after empty() said no.
        assert self._queue is not None
        return self._queue.popleft()

    def empty(self) -> bool:
        return not self._queue

    def release(self) -> bool:
        """Mark the drain finished unless messages arrived meanwhile (then keep going)."""
        with self._lock:
            if self._queue and self.owner is not None and not self.owner.actor_stopped.is_set():
                return False
            if not self._queue:
                self._queue = None
            self._scheduled = False
            return True


class LoopActor(pykka.Actor):
    """A Pykka actor whose messages are handled on a shared ``Dispatcher`` thread."""

    dispatcher: Dispatcher
    #: Whether instances are listed in pykka's ActorRegistry while alive.
    registered = True

    def __init__(self, dispatcher: Dispatcher) -> None:
        # pykka.Actor.__init__'s fields, cheaply (see the module docstring).
        self.actor_urn = f"urn:spliceway:actor:{next(_urns)}"
        inbox = _LoopInbox()
        self.actor_inbox = inbox
        self.actor_stopped = _Flag()  # type: ignore[assignment]
        self._actor_ref = ActorRef(self)
        self.dispatcher = dispatcher
        inbox.owner = self

    @classmethod
    def start(cls, *args: Any, **kwargs: Any) -> ActorRef[Any]:
        """Create the actor, register it (if ``registered``) and start handling messages."""
        obj = cls(*args, **kwargs)
        if cls.registered:
            ActorRegistry.register(obj.actor_ref)
        obj._start_actor_loop()
        return obj.actor_ref

    def _stop(self) -> None:
        # pykka's, without the per-stop log line.
        if self.registered:
            ActorRegistry.unregister(self.actor_ref)
        self.actor_stopped.set()
        try:
            self.on_stop()
        except Exception:
            self._handle_failure(*sys.exc_info())

    @staticmethod
    def _create_actor_inbox() -> _LoopInbox:
        return _LoopInbox()

    @staticmethod
    def _create_future() -> pykka.Future[Any]:
        return pykka.ThreadingFuture()

    def _start_actor_loop(self) -> None:
        if self.dispatcher.in_loop_thread:
            self._setup_then_drain()
        else:
            self.dispatcher.loop.call_soon_threadsafe(self._setup_then_drain)

    def _setup_then_drain(self) -> None:
        self._actor_loop_setup()
        self._drain()

    def _drain(self) -> None:
        inbox = self.actor_inbox
        assert isinstance(inbox, _LoopInbox)
        while True:
            while not self.actor_stopped.is_set() and not inbox.empty():
                self._handle_envelope(inbox.get())
            if self.actor_stopped.is_set():
                self._actor_loop_teardown()
                inbox.release()
                # Unlink actor and inbox: the cycle would leave every finished flow
                # (its actor, state and record) to the cyclic garbage collector.
                inbox.owner = None
                return
            if inbox.release():
                return

    def _handle_envelope(self, envelope: Any) -> None:
        # Mirrors pykka's ThreadingActor loop body so the semantics are identical.
        try:
            response = self._handle_receive(envelope.message)
            if envelope.reply_to is not None:
                envelope.reply_to.set(response)
        except Exception:
            if envelope.reply_to is not None:
                envelope.reply_to.set_exception()
            else:
                self._handle_failure(*sys.exc_info())
                try:
                    self.on_failure(*sys.exc_info())
                except Exception:
                    self._handle_failure(*sys.exc_info())

    def _dropped(self, message: Any) -> None:
        """A told message the actor stopped before handling (release what it holds)."""

    def _actor_loop_teardown(self) -> None:
        inbox = self.actor_inbox
        while not inbox.empty():
            envelope = inbox.get()
            if envelope.reply_to is None:
                self._dropped(envelope.message)
                continue
            if isinstance(envelope.message, messages._ActorStop):
                envelope.reply_to.set(None)
            else:
                err = ActorDeadError(f"{self.actor_ref} stopped before handling the message")
                envelope.reply_to.set_exception(exc_info=(ActorDeadError, err, None))

    def stop_now(self) -> None:
        """Stop from inside the actor's own context without queueing a message."""
        if not self.actor_stopped.is_set():
            self._stop()
