"""The periodic work of each member backend: its active probe and its metrics scrape, one task each.

A backend's tasks start when it joins the cluster (at start-up or by a live change,
:mod:`hetroute.backends.membership`) and are cancelled when it leaves, so a probe or scrape never
lands in a slot that a later backend has taken (a cancelled task does not run past its next await).
"""

from __future__ import annotations

import asyncio

import aiohttp

from hetroute.backends.health import HealthTracker, probe_loop
from hetroute.backends.scrape import MetricsStore, scrape_loop
from hetroute.config import ScrapeConfig
from hetroute.types import BackendSpec


class BackendTasks:
    """Probe and scrape tasks per slot, for the lifetime of one client ``session``."""

    def __init__(
        self,
        health: HealthTracker,
        metrics: MetricsStore,
        session: aiohttp.ClientSession,
        scrape: ScrapeConfig,
    ) -> None:
        self._health = health
        self._metrics = metrics
        self._session = session
        self._scrape = scrape
        self._tasks: dict[int, list[asyncio.Task[None]]] = {}

    def start(self, index: int, spec: BackendSpec) -> None:
        """Start probing (and, when scraping is on, scraping) backend ``spec`` in slot ``index``."""
        self.stop(index, spec)
        tasks = [asyncio.create_task(probe_loop(self._health, self._session, [spec.url], indices=(index,)))]
        if self._scrape.enabled:
            tasks.append(
                asyncio.create_task(scrape_loop(self._metrics, self._session, spec, index, self._scrape))
            )
        self._tasks[index] = tasks

    def stop(self, index: int, _spec: BackendSpec | None = None) -> None:
        """Cancel slot ``index``'s tasks (nothing when it has none)."""
        for task in self._tasks.pop(index, ()):
            task.cancel()

    def running(self) -> int:
        """Slots with tasks."""
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task and wait for them to end."""
        tasks = [t for group in self._tasks.values() for t in group]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
