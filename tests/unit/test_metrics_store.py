"""MetricsStore.latest_all: the router's per-decision read of every backend's latest fresh scrape is one
tuple object, reused until a publish, a slot change or its oldest fresh scrape goes stale."""

from __future__ import annotations

from hetroute.backends.scrape import MetricsStore
from hetroute.clock import ManualClock
from hetroute.types import EngineMetrics


def _m(at_s: float, running: float = 1.0) -> EngineMetrics:
    return EngineMetrics(scraped_at_s=at_s, num_requests_running=running)


def test_latest_all_is_reused_until_a_publish_or_a_scrape_goes_stale() -> None:
    clock = ManualClock(10.0)
    store = MetricsStore(3, clock, stale_after_s=5.0)
    empty = store.latest_all()
    assert empty == (None, None, None) and store.latest_all() is empty
    old, new = _m(9.0), _m(10.0)
    store.publish(0, old)
    store.publish(1, new)
    both = store.latest_all()
    assert both == (old, new, None)
    clock.advance(4.0)  # 14.0: both still fresh
    assert store.latest_all() is both
    clock.advance(0.5)  # 14.5: the older one is 5.5 s old
    assert store.latest_all() == (None, new, None)
    clock.advance(1.0)  # 15.5: both stale
    assert store.latest_all() == (None, None, None)
    store.set_slot(2)
    assert store.latest_all() == (None, None, None)
    for i in range(3):  # the per-backend read agrees at every step
        assert store.latest(i) is None
    later = _m(15.5, 2.0)
    store.publish(2, later)
    assert store.latest_all() == (None, None, later) == tuple(store.latest(i) for i in range(3))
