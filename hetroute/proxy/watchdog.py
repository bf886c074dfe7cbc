"""Per-request inactivity deadlines for the forwarder, all served by one event-loop timer.

A :class:`Watchdog` cancels the task relaying one request when nothing arrived for
``limit_s`` (first byte, then each gap between chunks). A chunk only stores the loop time in
``last_s``; the deadline is ``last_s + limit_s``.

Invariant: while any watchdog is open, the :class:`Watchdogs` timer is armed at or before the
earliest deadline, so every watchdog fires when its deadline passes, never later than a
per-request timer would. One shared timer matters under uvloop, where each ``call_at``
allocates a libuv timer handle that is closed asynchronously: tens of µs per request.
"""

from __future__ import annotations

import asyncio


class Watchdogs:
    """The open watchdogs of one forwarder and the single timer that serves them."""

    __slots__ = ("_open", "_loop", "_handle", "_armed_at")

    def __init__(self) -> None:
        self._open: set[Watchdog] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = 0.0

    def start(self, limit_s: float) -> Watchdog:
        """A watchdog for the current task, with ``limit_s`` until the first chunk."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests): the old timer is gone with it
            self._loop, self._handle = loop, None
            self._open.clear()
        task = asyncio.current_task()
        assert task is not None
        dog = Watchdog(self, loop, task, limit_s)
        self.watch(dog)
        return dog

    def ensure(self, deadline: float) -> None:
        """Arm the timer for ``deadline`` unless it already fires at or before it."""
        if self._handle is None or deadline < self._armed_at:
            assert self._loop is not None
            if self._handle is not None:
                self._handle.cancel()
            self._armed_at = deadline
            self._handle = self._loop.call_at(deadline, self._fire)

    def watch(self, dog: Watchdog) -> None:
        """(Re-)register ``dog`` after its deadline moved."""
        self._open.add(dog)
        self.ensure(dog.last_s + dog.limit_s)

    def discard(self, dog: Watchdog) -> None:
        self._open.discard(dog)
        if not self._open and self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def expire_all(self, reason: str) -> int:
        """Cancel every open watchdog's task now, with ``reason`` (shutdown); returns how many."""
        dogs = list(self._open)
        for dog in dogs:
            self._open.discard(dog)
            dog.expired, dog.reason = True, reason
            dog.task.cancel()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        return len(dogs)

    def _fire(self) -> None:
        self._handle = None
        assert self._loop is not None
        now = self._loop.time()
        earliest: float | None = None
        for dog in list(self._open):
            deadline = dog.last_s + dog.limit_s
            if now - dog.last_s >= dog.limit_s:
                self._open.discard(dog)
                dog.expired = True
                dog.task.cancel()
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self.ensure(earliest)


class Watchdog:
    """One request's deadline; see :class:`Watchdogs`."""

    __slots__ = ("_owner", "_loop", "task", "limit_s", "last_s", "expired", "reason")

    def __init__(
        self, owner: Watchdogs, loop: asyncio.AbstractEventLoop, task: asyncio.Task[object], limit_s: float
    ) -> None:
        self._owner = owner
        self._loop = loop
        self.task = task
        self.limit_s = limit_s
        self.last_s = loop.time()
        self.expired = False
        self.reason: str | None = None
        """Why it expired when not for its deadline (``Watchdogs.expire_all``)."""

    def rearm(self, limit_s: float) -> None:
        """From now on allow ``limit_s`` between chunks."""
        self.limit_s = limit_s
        self.last_s = self._loop.time()
        self._owner.watch(self)

    def fired(self) -> bool:
        """After a CancelledError: True when this watchdog caused it (and it is absorbed)."""
        return self.expired and self.task.uncancel() == 0

    def close(self) -> None:
        self._owner.discard(self)
