"""Router: eligibility, availability, exclusion, snapshot contents, ledger recording."""

from __future__ import annotations

import numpy as np
import pytest

from hetroute.clock import ManualClock
from hetroute.errors import NoBackendAvailable, UnknownModel
from hetroute.policies import PolicyContext, build_policy
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import Api, EngineMetrics, RequestFeatures
from tests.unit.snapshots import spec


def make_router(available: set[int] | None = None) -> Router:
    backends = [
        spec("v1", models=("m",)),
        spec("t1", models=("m", "x"), engine="tgi"),
        spec("v2", models=("x",)),
    ]
    policy = build_policy("round_robin", {}, PolicyContext(tuple(backends)))
    metrics = {1: EngineMetrics(scraped_at_s=0.0, kv_capacity_tokens=4096)}
    return Router(
        backends,
        policy,
        Ledger([b.name for b in backends]),
        ManualClock(),
        is_available=(lambda i: available is None or i in available),
        latest_metrics=metrics.get,
    )


def feats(model: str, api: Api = "openai") -> RequestFeatures:
    return RequestFeatures(
        request_id="r",
        model=model,
        api=api,
        input_tokens=10,
        max_tokens=None,
        predicted_output_tokens=5,
    )


def test_only_backends_serving_model_and_api_are_chosen() -> None:
    r = make_router()
    assert r.serving("m", "openai") == (0, 1)
    assert r.serving("m", "tgi") == (1,)
    assert r.serving("x", "openai") == (1, 2)
    chosen = {r.route(feats("m", "tgi")).backend_name for _ in range(4)}
    assert chosen == {"t1"}


def test_unknown_model_and_no_available_backend() -> None:
    r = make_router(available={2})
    with pytest.raises(UnknownModel):
        r.route(feats("nope"))
    with pytest.raises(NoBackendAvailable):
        r.route(feats("m"))
    assert r.route(feats("x")).backend_name == "v2"


def test_exclude_skips_tried_backends() -> None:
    r = make_router()
    t = r.route(feats("m"), exclude={0})
    assert t.backend_name == "t1"
    with pytest.raises(NoBackendAvailable):
        r.route(feats("m"), exclude={0, 1})


def test_snapshot_reflects_ledger_and_metrics_and_is_read_only() -> None:
    r = make_router()
    t = r.route(feats("m"))
    snap = r.snapshot()
    assert snap.requests_in_flight[t.backend_index] == 1
    assert snap.input_tokens_in_flight[t.backend_index] == 10
    assert snap.kv_capacity_tokens[1] == 4096 and np.isnan(snap.kv_capacity_tokens[0])
    with pytest.raises(ValueError):
        snap.requests_in_flight[0] = 5
    assert r.release(t) and not r.release(t)
    assert r.ledger.is_zero()


def test_complete_feeds_the_learner_and_a_burst_stream_counts_as_e2e_only() -> None:
    from hetroute.learning.live import LiveModels, PriorModel
    from hetroute.learning.settings import LearningConfig
    from hetroute.types import BackendSpec

    clock = ManualClock()
    spec = BackendSpec("a", "http://127.0.0.1:1", "vllm", ("m",))
    policy = build_policy("round_robin", {}, PolicyContext((spec,)))
    prior = PriorModel((2e-4, 0, 0, 0, 0, 0, 0, 0.02), "test", "neutral")
    learner = LiveModels(["a"], [prior], [1e5], [256.0], LearningConfig())
    router = Router([spec], policy, Ledger(["a"]), clock, learner=learner)
    features = RequestFeatures("r1", "m", "openai", 100, None, 10)
    for streamed, decode_s in ((True, 0.5), (True, 0.0), (False, 0.5)):
        ticket = router.route(features)
        clock.advance(0.1)
        router.ledger.first_token(ticket, clock.now())
        clock.advance(decode_s)
        router.complete(ticket, 10, input_tokens=120, streamed=streamed)
        router.release(ticket)
    obs = learner.observations(0)
    assert [o.ttft_s is not None for o in obs] == [True, False, False]  # burst and non-stream: e2e only
    assert obs[0].ttft_s == pytest.approx(0.1) and obs[0].input_tokens == 120 and obs[0].output_tokens == 10
    assert learner.observed_total(0) == 3 and router.ledger.is_zero()


def test_whole_fleet_providers_and_the_candidate_cache_decide_as_per_backend_reads() -> None:
    backends = [spec(f"b{i}", models=("m",)) for i in range(4)]
    down: set[int] = set()
    metrics = {i: EngineMetrics(scraped_at_s=0.0, kv_capacity_tokens=4096 * (i + 1)) for i in range(4)}
    calls = {"available_all": 0, "metrics_all": 0}

    def available_all() -> tuple[bool, ...]:
        calls["available_all"] += 1
        return tuple(i not in down for i in range(4))

    def metrics_all() -> tuple[EngineMetrics | None, ...]:
        calls["metrics_all"] += 1
        return tuple(metrics.get(i) for i in range(4))

    def make(bulk: bool) -> Router:
        return Router(
            backends,
            build_policy("round_robin", {}, PolicyContext(tuple(backends))),
            Ledger([b.name for b in backends]),
            ManualClock(),
            is_available=lambda i: i not in down,
            latest_metrics=metrics.get,
            available_all=available_all if bulk else None,
            latest_metrics_all=metrics_all if bulk else None,
        )

    per, bulk = make(False), make(True)
    chosen: list[tuple[int, int]] = []
    for step in range(12):
        if step == 4:
            down.add(1)  # availability changes: the cached candidates must not be reused
        if step == 8:
            down.clear()
        a, b = per.route(feats("m")), bulk.route(feats("m"))
        chosen.append((a.backend_index, b.backend_index))
        per.release(a)
        bulk.release(b)
    assert all(x == y for x, y in chosen)
    assert all(b != 1 for _, b in chosen[4:8])
    assert calls == {"available_all": 12, "metrics_all": 12}
    assert np.array_equal(per.snapshot().kv_capacity_tokens, bulk.snapshot().kv_capacity_tokens)
    # An excluded backend (a retry) is never chosen, and the next first attempt may use it again.
    t = bulk.route(feats("m"), exclude=[0, 2, 3])
    assert t.backend_index == 1
    bulk.release(t)
    with pytest.raises(NoBackendAvailable):
        bulk.route(feats("m"), exclude=[0, 1, 2, 3])
