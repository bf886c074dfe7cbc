"""Requests other routers sent (hetroute.routing.foreign) through the real Router and Ledger."""

from __future__ import annotations

import numpy as np
import pytest

from hetroute.clock import ManualClock
from hetroute.policies import PolicyContext, build_policy
from hetroute.routing.foreign import ForeignMode
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import EngineMetrics, RequestFeatures
from tests.unit.snapshots import spec


class Scrapes:
    """The latest scrape per backend, published to the router as the gateway's MetricsStore does."""

    def __init__(self, router: Router | None = None) -> None:
        self.latest: dict[int, EngineMetrics] = {}
        self.router = router

    def get(self, i: int) -> EngineMetrics | None:
        return self.latest.get(i)

    def publish(self, i: int, running: float | None, waiting: float | None = 0.0) -> None:
        m = EngineMetrics(scraped_at_s=0.0, num_requests_running=running, num_requests_waiting=waiting)
        self.latest[i] = m
        assert self.router is not None
        self.router.scraped(i, m)


def make(mode: ForeignMode, replicas: int = 1) -> tuple[Router, Scrapes]:
    backends = [spec("a", models=("m",)), spec("b", models=("m",))]
    scrapes = Scrapes()
    router = Router(
        backends,
        build_policy("round_robin", {}, PolicyContext(tuple(backends))),
        Ledger(["a", "b"]),
        ManualClock(),
        latest_metrics=scrapes.get,
        foreign=mode,
        replicas=replicas,
    )
    scrapes.router = router
    return router, scrapes


def feats(k: int, input_tokens: int = 100, output_tokens: int = 50) -> RequestFeatures:
    return RequestFeatures(
        request_id=f"r{k}",
        model="m",
        api="openai",
        input_tokens=input_tokens,
        max_tokens=None,
        predicted_output_tokens=output_tokens,
    )


def test_an_engine_holding_only_the_routers_own_requests_adds_nothing() -> None:
    for mode in ("raw", "scaled", "scaled_excess"):
        router, scrapes = make(mode)
        tickets = [router.route(feats(k)) for k in range(4)]  # round robin: 2 on a, 2 on b
        before = router.snapshot()
        scrapes.publish(0, running=2.0)
        scrapes.publish(1, running=1.0, waiting=1.0)
        after = router.snapshot()
        assert np.array_equal(after.requests_in_flight, before.requests_in_flight), mode
        assert np.array_equal(after.workload, before.workload), mode
        for t in tickets:
            router.release(t)
        assert router.ledger.is_zero()


def test_raw_counts_the_engines_other_requests_like_the_routers_own() -> None:
    router, scrapes = make("raw")
    tickets = [router.route(feats(k)) for k in range(2)]  # one on a, one on b
    scrapes.publish(0, running=4.0, waiting=2.0)  # 5 requests there are not ours
    snap = router.snapshot()
    assert list(snap.requests_in_flight) == [6, 1]
    assert snap.input_tokens_in_flight[0] == pytest.approx(6 * 100)
    assert snap.predicted_output_tokens_in_flight[0] == pytest.approx(6 * 50)
    own_w = router.ledger.workload[0]
    assert snap.workload[0] == pytest.approx(6 * own_w)
    assert snap.prefill_pending_tokens[0] == pytest.approx(100 + 5 * (2 / 6) * 100)
    # The ledger itself holds only the router's own requests, and releases to exactly zero.
    assert list(router.ledger.requests_in_flight) == [1, 1]
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()
    # Held until the next scrape; nothing of ours in flight now: the last dispatches' profile counts.
    snap = router.snapshot()
    assert snap.requests_in_flight[0] == 5
    assert snap.input_tokens_in_flight[0] == pytest.approx(5 * 100)
    scrapes.publish(0, running=0.0)
    assert router.snapshot().requests_in_flight[0] == 0


def test_a_stale_or_missing_scrape_brings_no_foreign_load() -> None:
    router, scrapes = make("raw")
    router.route(feats(0))
    scrapes.publish(0, running=9.0)
    assert router.snapshot().requests_in_flight[0] == 9
    del scrapes.latest[0]  # the store no longer serves it (stale): latest_metrics returns None
    assert router.snapshot().requests_in_flight[0] == 1
    scrapes.publish(0, running=None)  # an engine without the metric
    assert router.snapshot().requests_in_flight[0] == 1


def test_scaled_scales_the_live_ledger_by_the_fleet_ratio_and_excess_adds_each_backends_departure() -> None:
    for mode in ("scaled", "scaled_excess"):
        router, scrapes = make(mode)
        for k in range(4):
            router.route(feats(k))  # 2 on a, 2 on b
        # Engine a: 8 in all (6 foreign); engine b: 11 (9 foreign). Fleet ratio ρ = 15 / 4 = 3.75.
        scrapes.publish(0, running=8.0)
        scrapes.publish(1, running=11.0)
        rho = 15 / 4
        snap = router.snapshot()
        extra_a = rho * 2 if mode == "scaled" else max(rho * 2 + 6 - rho * 2, 0.0)
        extra_b = rho * 2 if mode == "scaled" else max(rho * 2 + 9 - rho * 2, 0.0)
        assert snap.requests_in_flight[0] == 2 + round(extra_a), mode
        assert snap.requests_in_flight[1] == 2 + round(extra_b), mode
        assert snap.input_tokens_in_flight[1] == pytest.approx(100 * (2 + extra_b)), mode


def test_off_ignores_the_engines_counts() -> None:
    router, scrapes = make("off")
    router.route(feats(0))
    scrapes.publish(0, running=9.0)
    assert router.snapshot().requests_in_flight[0] == 1


def test_with_peers_expected_a_burst_before_any_scrape_counts_them_as_large_as_its_own() -> None:
    router, scrapes = make("scaled_excess", replicas=4)
    scrapes.publish(0, running=0.0)  # idle engines scraped before the burst: no evidence of a share
    scrapes.publish(1, running=0.0)
    tickets = [router.route(feats(k)) for k in range(3)]  # round robin: 2 on a, 1 on b
    # No scrape has seen this router's requests: each of the 3 others is assumed to have sent as many.
    assert list(router.snapshot().requests_in_flight) == [8, 4]
    scrapes.publish(0, running=2.0)  # the engine holds exactly our 2: the others sent nothing there
    scrapes.publish(1, running=1.0)
    assert list(router.snapshot().requests_in_flight) == [2, 1]
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()


def test_the_peer_hint_changes_nothing_for_one_router_or_without_scaling() -> None:
    cases: tuple[tuple[ForeignMode, int], ...] = (("scaled_excess", 1), ("off", 4), ("raw", 4))
    for mode, replicas in cases:
        router, _ = make(mode, replicas=replicas)
        tickets = [router.route(feats(k)) for k in range(3)]
        assert list(router.snapshot().requests_in_flight) == [2, 1], (mode, replicas)
        for t in tickets:
            router.release(t)
