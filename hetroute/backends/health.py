"""Backend health: active ``/health`` probes plus Envoy-style passive outlier ejection.

Owns one :class:`BackendHealth` record per backend and the probe task. A backend is
*available* when its active probe state is healthy and it is not ejected; it is *confirmed* once
it has passed a probe or answered a request (``/ready`` wants one that is both).

Outlier detection (Envoy ``outlier.rst`` semantics):
- ``consecutive_failures`` upstream failures in a row (5xx, connection refused/reset,
  timeouts; 429 is back-pressure, not a failure) eject the backend for
  ``min(base_ejection_s × times_ejected, max_ejection_s)``;
- no ejection happens if it would put more than ``max_ejection_percent`` of the backends
  in ejection at once;
- the multiplier decays by one for every ``base_ejection_s`` the backend then stays healthy;
- an ejection lasts its full ejection time: a successful active probe does not end it,
  because a backend that fails every request can still pass ``/health`` (Envoy's
  ``successful_active_health_check_uneject_host: false``); re-admission happens only
  when the ejection time has passed.

Time comes from the injected clock, so the state machine is tested with a ManualClock.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from hetroute.clock import Sleeper
from hetroute.config import HealthConfig
from hetroute.types import Clock


@dataclass(slots=True)
class BackendHealth:
    """Mutable health state of one backend (owned by :class:`HealthTracker`)."""

    probe_healthy: bool = True
    probe_failures: int = 0
    probe_successes: int = 0
    consecutive_failures: int = 0
    times_ejected: int = 0
    ejected_until_s: float | None = None
    healthy_since_s: float = 0.0
    ejections_total: int = 0
    last_probe_at_s: float | None = None
    last_error: str | None = None
    last_success_at_s: float | None = None
    last_probe_ok_at_s: float | None = None
    retired: bool = False
    """Removed from the cluster (draining or free): never available again in this slot."""


class HealthTracker:
    """Availability per backend from active probes and passive outlier ejection."""

    def __init__(
        self,
        config: HealthConfig,
        names: Sequence[str],
        clock: Clock,
        *,
        on_eject: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.names = tuple(names)
        self.clock = clock
        self._on_eject = on_eject
        now = clock.now()
        self.states = [BackendHealth(healthy_since_s=now) for _ in names]
        self._available: tuple[bool, ...] | None = None
        """The last :meth:`available_all`, reused until a probe, a failure, a slot change or the end of
        its first ejection (``_available_until_s``, +inf when none)."""
        self._available_until_s = math.inf

    def set_slot(self, i: int, name: str) -> None:
        """Slot ``i`` holds backend ``name`` with a fresh record, available until heard otherwise, as at
        start-up (one past the last: grow)."""
        fresh = BackendHealth(healthy_since_s=self.clock.now())
        names = list(self.names)
        if i == len(self.states):
            self.states.append(fresh)
            names.append(name)
        else:
            self.states[i] = fresh
            names[i] = name
        self.names = tuple(names)
        self._available = None

    def retire(self, i: int) -> None:
        """Backend ``i`` left the cluster: unavailable from now on, and no longer counted."""
        h = self.states[i]
        h.probe_healthy = False
        h.retired = True
        self._available = None

    def is_ejected(self, i: int, now_s: float | None = None) -> bool:
        until = self.states[i].ejected_until_s
        if until is None:
            return False
        now = self.clock.now() if now_s is None else now_s
        if now < until:
            return True
        self._end_ejection(self.states[i], until)
        return False

    def is_available(self, i: int) -> bool:
        return self.states[i].probe_healthy and not self.is_ejected(i)

    def available_all(self) -> tuple[bool, ...]:
        """:meth:`is_available` of every backend, with one clock read (the router's snapshot: one call
        per decision instead of one per backend); ends ejections that have run out, as it does. The
        same tuple object is returned until a probe result, a failure, a slot change or the end of
        its first ejection."""
        now = self.clock.now()
        held = self._available
        if held is not None and now < self._available_until_s:
            return held  # no probe or failure since, and no ejection in it has run out
        out = []
        first_end = math.inf
        for h in self.states:
            until = h.ejected_until_s
            if until is not None:
                if now < until:
                    out.append(False)
                    first_end = min(first_end, until)
                    continue
                self._end_ejection(h, until)
            out.append(h.probe_healthy)
        self._available, self._available_until_s = tuple(out), first_end
        return self._available

    def available_count(self) -> int:
        return sum(1 for i in range(len(self.states)) if self.is_available(i))

    def confirmed(self, i: int) -> bool:
        """True once backend ``i`` has passed an active probe or answered a request successfully: a
        backend counts as available from start-up, before anything has been heard from it."""
        h = self.states[i]
        return h.last_probe_ok_at_s is not None or h.last_success_at_s is not None

    def confirmed_available_count(self) -> int:
        """Backends that are available and :meth:`confirmed` (what ``/ready`` requires one of)."""
        return sum(1 for i in range(len(self.states)) if self.confirmed(i) and self.is_available(i))

    def _end_ejection(self, h: BackendHealth, at_s: float) -> None:
        h.ejected_until_s = None
        h.consecutive_failures = 0
        h.healthy_since_s = at_s

    def _decay(self, h: BackendHealth, now: float) -> None:
        base = self.config.base_ejection_s
        while h.times_ejected > 0 and now - h.healthy_since_s >= base:
            h.times_ejected -= 1
            h.healthy_since_s += base

    def record_success(self, i: int) -> None:
        """A response that is not an upstream failure (any status below 500 except 429)."""
        h = self.states[i]
        h.consecutive_failures = 0
        now = self.clock.now()
        h.last_success_at_s = now
        if not self.is_ejected(i, now):
            self._decay(h, now)

    def succeeded_since(self, i: int, since_s: float) -> bool:
        """True when backend ``i`` answered a request successfully at or after ``since_s``."""
        last = self.states[i].last_success_at_s
        return last is not None and last >= since_s

    def record_failure(self, i: int, error: str) -> bool:
        """An upstream failure; True when it ejected the backend."""
        self._available = None
        h = self.states[i]
        now = self.clock.now()
        h.last_error = error
        if self.is_ejected(i, now):
            return False
        h.consecutive_failures += 1
        if h.consecutive_failures < self.config.consecutive_failures:
            return False
        members = [j for j, s in enumerate(self.states) if not s.retired]
        ejected = sum(1 for j in members if self.is_ejected(j, now))
        if (ejected + 1) * 100 > self.config.max_ejection_percent * len(members):
            return False  # Envoy: never eject beyond max_ejection_percent
        self._decay(h, now)
        h.times_ejected += 1
        duration = min(self.config.base_ejection_s * h.times_ejected, self.config.max_ejection_s)
        h.ejected_until_s = now + duration
        h.ejections_total += 1
        if self._on_eject is not None:
            self._on_eject(i)
        return True

    def record_probe(self, i: int, ok: bool, error: str | None = None) -> None:
        """The result of one active probe."""
        self._available = None
        h = self.states[i]
        if h.retired:
            return
        now = self.clock.now()
        h.last_probe_at_s = now
        if ok:
            h.last_probe_ok_at_s = now
            h.probe_failures = 0
            h.probe_successes += 1
            if h.probe_successes >= self.config.healthy_threshold:
                if not h.probe_healthy:
                    h.healthy_since_s = now
                h.probe_healthy = True
            return  # an ejection is not ended by a probe: it runs its full time
        h.last_error = error
        h.probe_successes = 0
        h.probe_failures += 1
        if h.probe_failures >= self.config.unhealthy_threshold:
            h.probe_healthy = False

    def describe(self, i: int) -> dict[str, object]:
        """Plain data for ``/admin/backends``."""
        h = self.states[i]
        now = self.clock.now()
        ejected = self.is_ejected(i, now)
        return {
            "available": h.probe_healthy and not ejected,
            "probe_healthy": h.probe_healthy,
            "ejected": ejected,
            "ejected_for_s": round(h.ejected_until_s - now, 3) if ejected and h.ejected_until_s else 0.0,
            "times_ejected": h.times_ejected,
            "ejections_total": h.ejections_total,
            "consecutive_failures": h.consecutive_failures,
            "last_probe_age_s": None if h.last_probe_at_s is None else round(now - h.last_probe_at_s, 3),
            "last_error": h.last_error,
        }


async def probe_once(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[bool, str | None]:
    """GET ``url``; healthy means a 200 answer within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as resp:
            await resp.read()
            if resp.status == 200:
                return True, None
            return False, f"probe status {resp.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return False, f"probe {type(exc).__name__}: {exc}"


async def probe_loop(
    tracker: HealthTracker,
    session: aiohttp.ClientSession,
    base_urls: Sequence[str],
    sleep: Sleeper = asyncio.sleep,
    *,
    indices: Sequence[int] | None = None,
) -> None:
    """Probe every backend, then wait ``probe_interval_s`` through ``sleep``; until cancelled.
    ``base_urls[k]`` is backend ``indices[k]`` (default: backend k)."""
    cfg = tracker.config
    urls = [u + cfg.probe_path for u in base_urls]
    slots = list(indices) if indices is not None else list(range(len(urls)))
    while True:
        results = await asyncio.gather(*(probe_once(session, u, cfg.probe_timeout_s) for u in urls))
        for i, (ok, error) in zip(slots, results, strict=True):
            tracker.record_probe(i, ok, error)
        await sleep(cfg.probe_interval_s)
