"""Engine-metrics scraping: one loop per backend publishing immutable :class:`EngineMetrics`.

Owns :class:`MetricsStore`, the latest scrape per backend. A scrape replaces the stored
object whole (reference swap), so readers never lock and never see half an update. A
scrape older than ``stale_after_s`` is not served to the router (``latest`` returns None):
stale numbers are worse than none, and the policy then falls back for every candidate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from hetroute.backends.engines import MetricsParseError, parse_metrics
from hetroute.clock import Sleeper
from hetroute.config import ScrapeConfig
from hetroute.types import BackendSpec, Clock, EngineMetrics


class MetricsStore:
    """The latest engine metrics per backend index, with staleness."""

    def __init__(
        self,
        n_backends: int,
        clock: Clock,
        stale_after_s: float,
        on_publish: Callable[[int, EngineMetrics], None] | None = None,
    ) -> None:
        """``on_publish(i, metrics)`` runs at each publish, in the same event-loop step (the router
        sets the engine's request counts against its own there: ``Router.scraped``)."""
        self.clock = clock
        self.on_publish = on_publish
        self.stale_after_s = stale_after_s
        self._latest: list[EngineMetrics | None] = [None] * n_backends
        self.errors: list[str | None] = [None] * n_backends
        self._all: tuple[EngineMetrics | None, ...] | None = None
        """The last :meth:`latest_all`, reused until a publish, a slot change or its oldest fresh scrape
        goes stale (``_all_oldest_s``: that scrape's time; None when nothing in it is fresh)."""
        self._all_oldest_s: float | None = None

    def set_slot(self, i: int) -> None:
        """Slot ``i`` holds a new backend with nothing scraped yet (one past the last: grow)."""
        if i == len(self._latest):
            self._latest.append(None)
            self.errors.append(None)
        else:
            self._latest[i] = None
            self.errors[i] = None
        self._all = None

    def publish(self, i: int, metrics: EngineMetrics) -> None:
        self._latest[i] = metrics
        self.errors[i] = None
        self._all = None
        if self.on_publish is not None:
            self.on_publish(i, metrics)

    def latest(self, i: int) -> EngineMetrics | None:
        """The newest scrape if it is fresh, else None."""
        m = self._latest[i]
        if m is None or self.clock.now() - m.scraped_at_s > self.stale_after_s:
            return None
        return m

    def latest_all(self) -> tuple[EngineMetrics | None, ...]:
        """:meth:`latest` of every backend, with one clock read (the router's snapshot: one call per
        decision instead of one per backend). The same tuple object is returned until a publish, a
        slot change or the first of its scrapes going stale (``now - t`` only grows with ``now`` and
        falls with ``t``, so the oldest fresh scrape is the first to go stale)."""
        now = self.clock.now()
        stale = self.stale_after_s
        held, oldest = self._all, self._all_oldest_s
        if held is not None and (oldest is None or now - oldest <= stale):
            return held  # nothing published since, and its oldest fresh scrape is still fresh
        out = tuple([m if m is not None and now - m.scraped_at_s <= stale else None for m in self._latest])
        fresh = [m.scraped_at_s for m in out if m is not None]
        self._all, self._all_oldest_s = out, (min(fresh) if fresh else None)
        return out

    def last_seen(self, i: int) -> EngineMetrics | None:
        """The newest scrape however old (for /admin)."""
        return self._latest[i]

    def age_s(self, i: int) -> float | None:
        m = self._latest[i]
        return None if m is None else self.clock.now() - m.scraped_at_s


async def scrape_once(
    session: aiohttp.ClientSession, spec: BackendSpec, timeout_s: float, clock: Clock
) -> EngineMetrics:
    """Fetch and parse one backend's ``/metrics`` (raises on HTTP or parse errors)."""
    async with asyncio.timeout(timeout_s), session.get(spec.url + "/metrics") as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(
                resp.request_info, (), status=resp.status, message="scrape failed"
            )
        text = await resp.text()
    return parse_metrics(spec.engine, text, clock.now())


async def scrape_loop(
    store: MetricsStore,
    session: aiohttp.ClientSession,
    spec: BackendSpec,
    index: int,
    config: ScrapeConfig,
    sleep: Sleeper = asyncio.sleep,
) -> None:
    """Scrape backend ``spec`` (slot ``index``), then wait ``interval_s`` through ``sleep``; until
    cancelled. Errors are recorded in the store, not raised."""
    while True:
        try:
            store.publish(index, await scrape_once(session, spec, config.timeout_s, store.clock))
        except (aiohttp.ClientError, TimeoutError, OSError, MetricsParseError) as exc:
            store.errors[index] = f"{type(exc).__name__}: {exc}"
        await sleep(config.interval_s)
