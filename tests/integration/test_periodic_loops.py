"""The periodic loops (health probes, scrapes) driven tick by tick on a ManualClock: the injected
sleeper advances the clock instead of waiting, so no test here depends on wall-clock timing. The
backends are real emulators (and a dead port) over real HTTP."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable

import aiohttp
import pytest

from hetroute.backends.health import HealthTracker, probe_loop
from hetroute.backends.scrape import MetricsStore, scrape_loop
from hetroute.clock import ManualClock
from hetroute.config import HealthConfig, ScrapeConfig
from hetroute.types import BackendSpec
from tests.conftest import MODEL, EmulateFn


class Ticks:
    """A sleeper that advances ``clock`` by the requested delay and records it; after ``limit`` ticks
    it ends the loop (CancelledError, as the gateway's shutdown does)."""

    def __init__(self, clock: ManualClock, limit: int) -> None:
        self.clock = clock
        self.limit = limit
        self.delays: list[float] = []
        self.between: list[object] = []
        self.observe: object = None

    async def __call__(self, delay_s: float) -> None:
        self.delays.append(delay_s)
        if callable(self.observe):
            self.between.append(self.observe())
        if len(self.delays) >= self.limit:
            raise asyncio.CancelledError
        self.clock.advance(delay_s)
        await asyncio.sleep(0)


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _run(loop: Awaitable[None]) -> None:
    with pytest.raises(asyncio.CancelledError):
        await loop


async def test_probes_mark_a_dead_backend_unhealthy_after_the_threshold_and_keep_a_live_one(
    emulate: EmulateFn,
) -> None:
    live = await emulate(name="live")
    clock = ManualClock(100.0)
    cfg = HealthConfig(probe_interval_s=5.0, probe_timeout_s=1.0, unhealthy_threshold=2)
    tracker = HealthTracker(cfg, ["live", "dead"], clock)
    ticks = Ticks(clock, limit=4)
    ticks.observe = lambda: (tracker.is_available(0), tracker.is_available(1))
    async with aiohttp.ClientSession() as session:
        await _run(probe_loop(tracker, session, [live.url, _dead_url()], ticks))
    assert ticks.delays == [5.0] * 4  # one probe round per interval
    # After round 1 the dead backend has one failure (threshold 2): still available; after round 2, not.
    assert ticks.between == [(True, True), (True, False), (True, False), (True, False)]
    assert clock.now() == pytest.approx(115.0)
    described = tracker.describe(1)
    assert described["probe_healthy"] is False


async def test_scrapes_publish_each_interval_and_a_stale_scrape_is_withheld(emulate: EmulateFn) -> None:
    emu = await emulate(name="e")
    clock = ManualClock(0.0)
    store = MetricsStore(1, clock, stale_after_s=3.0)
    published: list[float] = []
    store.on_publish = lambda i, m: published.append(m.scraped_at_s)
    spec = BackendSpec(name="e", url=emu.url, engine="vllm", models=(MODEL,))
    ticks = Ticks(clock, limit=3)
    async with aiohttp.ClientSession() as session:
        await _run(scrape_loop(store, session, spec, 0, ScrapeConfig(interval_s=2.0), ticks))
    assert published == [0.0, 2.0, 4.0]  # stamped with the injected clock, one per interval
    latest = store.latest(0)
    assert latest is not None and latest.num_requests_running == 0.0
    assert store.latest_all() == (latest,)
    assert latest.kv_capacity_tokens is not None and latest.kv_capacity_tokens > 0
    clock.advance(3.5)  # 3.5 s after the newest scrape, beyond stale_after_s = 3
    assert store.latest(0) is None and store.last_seen(0) is latest
    assert store.latest_all() == (None,)
    assert store.age_s(0) == pytest.approx(3.5)


async def test_a_failing_scrape_is_recorded_and_the_loop_goes_on() -> None:
    clock = ManualClock(0.0)
    store = MetricsStore(1, clock, stale_after_s=3.0)
    spec = BackendSpec(name="gone", url=_dead_url(), engine="vllm", models=(MODEL,))
    ticks = Ticks(clock, limit=3)
    ticks.observe = lambda: store.errors[0]
    async with aiohttp.ClientSession() as session:
        await _run(scrape_loop(store, session, spec, 0, ScrapeConfig(interval_s=1.0, timeout_s=0.5), ticks))
    assert len(ticks.between) == 3 and all(isinstance(e, str) and e for e in ticks.between)
    assert store.latest(0) is None
