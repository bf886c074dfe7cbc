"""Clocks: the only place hetroute reads time (house style §7).

``MonotonicClock`` wraps ``time.monotonic`` for production; ``ManualClock`` is advanced
explicitly by tests and by the discrete-event simulator. The periodic loops (health probes, scrapes,
refits) wait through an injected :data:`Sleeper` (``asyncio.sleep`` in production), so that a test
can drive them tick by tick on a ``ManualClock``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

Sleeper = Callable[[float], Awaitable[None]]
"""Waits the given seconds (``asyncio.sleep``); a test's sleeper advances a ManualClock instead."""


class MonotonicClock:
    """Monotonic wall time in seconds."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to. Time never goes backwards."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now(self) -> float:
        return self._now_s

    def advance(self, delta_s: float) -> None:
        if delta_s < 0:
            raise ValueError(f"cannot move a clock backwards by {delta_s}")
        self._now_s += delta_s

    def set(self, now_s: float) -> None:
        if now_s < self._now_s:
            raise ValueError(f"cannot move a clock backwards from {self._now_s} to {now_s}")
        self._now_s = now_s
