"""Table-driven tests of the profile-driven policies and the backend model (method.md §5, §7)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from hetroute.clock import ManualClock
from hetroute.errors import ConfigError
from hetroute.latency import EngineLimits, LatencyParams, LatencyProfile
from hetroute.policies import POLICIES, PolicyContext, build_policy
from hetroute.policies.backend_model import (
    NEUTRAL_KV_CAPACITY_TOKENS,
    NEUTRAL_PARAMS,
    BackendModels,
    describe_backend_models,
)
from hetroute.policies.peers import PeerMemo, all_peers
from hetroute.policies.workload_minmax import MAX_EXPONENT, MinMaxPolicy
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import BackendSpec, ClusterSnapshot, EngineMetrics, RequestFeatures, RoutingDecision

# A "fast" backend: 4x cheaper steps, 8x the KV of the "slow" one (the paper's TP4 vs TP1 shape).
FAST = LatencyParams(p1=1e-5, p2=1e-3, p3=2e-5, p4=5e-3, p5=1e-8, p6=2e-5, p7=1e-7, p8=5e-3)
SLOW = LatencyParams(*(4 * p for p in FAST.as_tuple()))


def profile(params: LatencyParams, cap: int, max_num_seqs: int | None = 256) -> LatencyProfile:
    return LatencyProfile(
        params=params,
        kv_capacity_tokens=cap,
        kv_capacity_source="test",
        limits=EngineLimits(max_num_seqs=max_num_seqs),
    )


def backend(name: str, prof: LatencyProfile | None = None, **kw: object) -> BackendSpec:
    url = f"http://127.0.0.1/{name}"
    return BackendSpec(name=name, url=url, engine="vllm", models=("m",), profile=prof, **kw)  # type: ignore[arg-type]


def snap(
    backends: Sequence[BackendSpec],
    *,
    workload: Sequence[float] | None = None,
    kv_tokens: Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    metrics: Sequence[EngineMetrics | None] | None = None,
    caps: Sequence[float] | None = None,
    prefill_pending: Sequence[float] | None = None,
) -> ClusterSnapshot:
    n = len(backends)
    zeros = np.zeros(n, dtype=np.float64)
    if caps is None:
        caps = [float(b.profile.kv_capacity_tokens) if b.profile else math.nan for b in backends]
    return ClusterSnapshot(
        now_s=0.0,
        backends=tuple(backends),
        metrics=tuple(metrics) if metrics is not None else (None,) * n,
        requests_in_flight=np.array(in_flight if in_flight is not None else [0] * n, dtype=np.int64),
        input_tokens_in_flight=np.array(kv_tokens if kv_tokens is not None else zeros, dtype=np.float64),
        remaining_predicted_tokens=zeros.copy(),
        generated_tokens_in_flight=zeros.copy(),
        predicted_output_tokens_in_flight=zeros.copy(),
        workload=np.array(workload if workload is not None else zeros, dtype=np.float64),
        prefill_pending_tokens=np.array(
            prefill_pending if prefill_pending is not None else zeros, dtype=np.float64
        ),
        available=np.ones(n, dtype=np.bool_),
        kv_capacity_tokens=np.array(caps, dtype=np.float64),
    )


def req(i: int = 200, o: int = 100, rid: str = "r") -> RequestFeatures:
    return RequestFeatures(
        request_id=rid, model="m", api="openai", input_tokens=i, max_tokens=None, predicted_output_tokens=o
    )


TWO = (backend("fast", profile(FAST, 800_000)), backend("slow", profile(SLOW, 100_000)))
BOTH = np.array([0, 1], dtype=np.int64)


def minmax(
    name: str = "workload_minmax", backends: Sequence[BackendSpec] = TWO, **params: object
) -> MinMaxPolicy:
    policy = build_policy(name, params, PolicyContext(tuple(backends), seed=1))
    assert isinstance(policy, MinMaxPolicy)
    return policy


# --- backend model -------------------------------------------------------------------------


@pytest.mark.parametrize(("i", "o"), [(1, 1), (200, 100), (1000, 900), (50_000, 60_000)])
def test_vectorised_amortised_time_matches_the_profile_formula(i: int, o: int) -> None:
    models = BackendModels(TWO)
    caps = np.array([800_000.0, 100_000.0])
    got = models.amortised_request_s(BOTH, i, o, caps)
    want = [b.profile.amortised_request_s(i, o) for b in TWO if b.profile is not None]
    assert got == pytest.approx(want, rel=1e-12)


def test_an_observed_sequence_limit_replaces_the_static_one_in_the_amortised_time() -> None:
    """``max_num_seqs`` (the admission queue's observed limits) caps the saturated batch b of Eq. 5-6:
    a backend seen running 8 sequences amortises over 8, not over what its KV cache would hold."""
    models = BackendModels(TWO)
    caps = np.array([800_000.0, 100_000.0])
    free = models.amortised_request_s(BOTH, 200, 100, caps)
    capped = models.amortised_request_s(BOTH, 200, 100, caps, max_num_seqs=np.array([8.0, 256.0]))
    assert capped[1] == free[1]  # its static limit (256): as before
    assert capped[0] > 2 * free[0]  # far fewer sequences to share the step with


def test_fallbacks_prior_then_neutral_and_description() -> None:
    prior_prof = profile(SLOW, 50_000, max_num_seqs=128)

    def prior(gpu: str, model: str, tp: int) -> LatencyProfile:
        if gpu != "V100":
            raise LookupError(f"unknown gpu {gpu}")
        return prior_prof

    specs = (
        backend("profiled", profile(FAST, 800_000)),
        backend("prior", gpu="V100", tp=1),
        backend("unknown-gpu", gpu="X1"),
        backend("nothing"),
        backend("configured", kv_capacity_tokens=1234),
    )
    models = BackendModels(specs, prior)
    assert models.params[0] == pytest.approx(FAST.as_tuple())
    assert models.params[1] == pytest.approx(SLOW.as_tuple())
    assert models.params[3] == pytest.approx(NEUTRAL_PARAMS.as_tuple())
    assert models.max_num_seqs[1] == 128 and math.isinf(models.max_num_seqs[3])
    # capacities: static profile/prior/config; the unknown ones get the median of the known ones
    median = float(np.median([800_000, 50_000, 1234]))
    assert models.fallback_capacity_tokens.tolist() == [800_000, 50_000, median, median, 1234]
    nan_snap = snap(specs, caps=[math.nan, math.nan, 7777, math.nan, math.nan])
    assert models.capacity_tokens(nan_snap, np.arange(5)).tolist() == [800_000, 50_000, 7777, median, 1234]
    metrics = [None, None, None, EngineMetrics(scraped_at_s=0, kv_capacity_tokens=4242), None]
    lines = describe_backend_models(specs, metrics, prior)
    assert "profile (profiled)" in lines[0] and "800000 tokens from profile (test)" in lines[0]
    assert "roofline prior (V100, tp=1, m)" in lines[1] and "max_num_seqs 128" in lines[1]
    assert "neutral default" in lines[2] and "unknown gpu X1" in lines[2]
    assert "neutral default (no gpu label)" in lines[3] and "4242 tokens from engine metrics" in lines[3]
    assert "1234 tokens from config kv_capacity_tokens" in lines[4]


def test_a_zero_capacity_or_limit_never_produces_nan_costs() -> None:
    bs = (backend("zero", kv_capacity_tokens=0, max_num_seqs=0), backend("ok", profile(FAST, 800_000)))
    policy = minmax(backends=bs)
    _, _, w = policy.costs(req(), snap(bs, caps=[0.0, 800_000.0], kv_tokens=[0.0, 10.0]), BOTH)
    assert np.isfinite(w).all()


def test_without_any_capacity_the_neutral_default_is_used() -> None:
    models = BackendModels((backend("a"), backend("b")), None)
    assert models.fallback_capacity_tokens.tolist() == [NEUTRAL_KV_CAPACITY_TOKENS] * 2


# --- workload_minmax (OS) ---------------------------------------------------------------------


def test_minimum_starts_at_infinity_so_an_idle_cluster_picks_the_cheaper_backend() -> None:
    # The paper's pseudo-code (min starting at 0) would send everything to backend 0.
    bs = (backend("slow", profile(SLOW, 100_000)), backend("fast", profile(FAST, 800_000)))
    d = minmax(backends=bs).choose(req(), snap(bs), BOTH)
    assert d.index == 1


def test_cost_is_amortised_time_times_exp_theta_kvusage_and_is_charged() -> None:
    policy = minmax(theta=2.0)
    s = snap(TWO, kv_tokens=[400_000, 20_000], workload=[5.0, 5.0])
    t, u, w = policy.costs(req(200, 100), s, BOTH)
    assert u.tolist() == pytest.approx([0.5, 0.2])
    assert t.tolist() == pytest.approx([b.profile.amortised_request_s(200, 100) for b in TWO if b.profile])
    assert w.tolist() == pytest.approx((t * np.exp(2.0 * u)).tolist())
    d = policy.choose(req(200, 100), s, BOTH)
    assert d.workload_cost == pytest.approx(w[d.index])
    assert d.scores["kv_usage"] == pytest.approx(u[d.index])


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([0.0, 0.0], 0),  # the fast one is cheaper
        ([10.0, 0.0], 1),  # min-max: adding to backend 0 raises the max
        ([0.0, 10.0], 0),
    ],
)
def test_mapper_minimises_the_maximum_load(loads: list[float], expected: int) -> None:
    assert minmax().choose(req(), snap(TWO, workload=loads), BOTH).index == expected


def test_max_over_others_includes_non_candidates_and_ties_break_on_own_load() -> None:
    three = (*TWO, backend("other", profile(FAST, 800_000)))
    # Backend 2 (not a candidate) holds the maximum: both candidates tie on max(...) = 100,
    # so the tie-break on L_s + w chooses backend 1 whose resulting own load is smaller.
    s = snap(three, workload=[3.0, 0.0, 100.0])
    d = minmax(backends=three).choose(req(), s, BOTH)
    assert d.index == 1
    assert d.scores["minmax_load"] == pytest.approx(100.0)


def test_exact_ties_are_broken_by_a_seeded_random_choice() -> None:
    same = (backend("a", profile(FAST, 800_000)), backend("b", profile(FAST, 800_000)))

    def picks(seed: int) -> list[int]:
        policy = build_policy("workload_minmax", {"seed": seed}, PolicyContext(same))
        return [policy.choose(req(), snap(same), BOTH).index for _ in range(40)]

    assert picks(3) == picks(3)
    assert set(picks(3)) == {0, 1}
    assert picks(3) != picks(4)


def test_equal_latency_floors_go_to_the_fewest_waiting_prompt_tokens_not_to_a_coin() -> None:
    # Nothing known: both backends on the neutral default, so the latency floor (which dominates
    # under light load) is the same value on each and prices no queue (p1 = 0).
    unknown = (backend("a"), backend("b"))
    big = req(5000, 200)
    for seed in range(8):
        policy = build_policy("balanced_minmax", {"seed": seed}, PolicyContext(unknown))
        assert isinstance(policy, MinMaxPolicy)
        for waiting, expected in (([6984.0, 0.0], 1), ([0.0, 3000.0], 0)):
            s = snap(unknown, caps=[100_000, 100_000], prefill_pending=waiting, workload=[0.4, 0.0])
            lat = policy.latency(big, s, BOTH)
            assert lat[0] == lat[1] > 1.0  # the floors tie, far above the drain times
            assert policy.choose(big, s, BOTH).index == expected
            assert policy.choose_vectorised(big, s, BOTH).index == expected  # the array path alike
    # Equal waiting tokens still go to the seeded coin.
    policy = build_policy("balanced_minmax", {"seed": 3}, PolicyContext(unknown))
    idle = snap(unknown, caps=[100_000, 100_000])
    assert {policy.choose(big, idle, BOTH).index for _ in range(40)} == {0, 1}


def test_exponent_is_capped_so_loads_stay_finite() -> None:
    policy = minmax(theta=100.0)
    t, _, w = policy.costs(req(), snap(TWO, kv_tokens=[1e9, 1e9]), BOTH)
    assert np.isfinite(w).all()
    assert w.tolist() == pytest.approx((t * math.exp(MAX_EXPONENT)).tolist())


def test_engine_kv_signal_is_used_only_when_every_candidate_reports_it() -> None:
    full = EngineMetrics(scraped_at_s=0, kv_usage_frac=0.9, num_requests_waiting=0)
    empty = EngineMetrics(scraped_at_s=0, kv_usage_frac=0.1, num_requests_waiting=0)
    policy = minmax(kv_signal="engine", theta=2.0)
    both = snap(TWO, kv_tokens=[0, 0], metrics=[full, empty])
    assert policy.costs(req(), both, BOTH)[1].tolist() == pytest.approx([0.9, 0.1])
    one = snap(TWO, kv_tokens=[80_000, 10_000], metrics=[full, None])
    assert policy.costs(req(), one, BOTH)[1].tolist() == pytest.approx([0.1, 0.1])  # ledger for all


def test_engine_signal_adds_waiting_requests_and_max_takes_the_larger() -> None:
    m = [
        EngineMetrics(scraped_at_s=0, kv_usage_frac=0.5, num_requests_waiting=10),
        EngineMetrics(scraped_at_s=0, kv_usage_frac=0.2, num_requests_waiting=0),
    ]
    s = snap(TWO, kv_tokens=[8_000, 50_000], in_flight=[20, 100], metrics=m)
    # backend 0: 400 tokens per in-flight request × 10 waiting / 800k = 0.005 more
    assert minmax(kv_signal="engine").costs(req(), s, BOTH)[1].tolist() == pytest.approx([0.505, 0.2])
    assert minmax(kv_signal="max").costs(req(), s, BOTH)[1].tolist() == pytest.approx([0.505, 0.5])


def test_memory_minmax_ignores_time_and_prefers_free_kv() -> None:
    policy = minmax("memory_minmax")
    t, u, w = policy.costs(req(), snap(TWO, kv_tokens=[400_000, 10_000]), BOTH)
    assert t.tolist() == [1.0, 1.0]
    assert w.tolist() == pytest.approx(np.exp(2.0 * u).tolist())
    assert policy.choose(req(), snap(TWO, kv_tokens=[400_000, 10_000]), BOTH).index == 1


def test_balanced_minmax_penalises_only_kv_overflow() -> None:
    policy = minmax("balanced_minmax", theta=1.0)
    t, _, w = policy.costs(req(), snap(TWO, kv_tokens=[400_000, 150_000]), BOTH)
    assert w[0] == pytest.approx(t[0])  # kvusage 0.5: no penalty
    assert w[1] == pytest.approx(t[1] * math.exp(0.5))  # kvusage 1.5: penalty e^(1·0.5)


def test_request_latency_is_prefill_then_decode_steps_next_to_the_batch() -> None:
    models = BackendModels(TWO)
    got = models.request_latency_s(BOTH, 200, 100, np.array([3.0, 1.0]), np.array([400.0, 250.0]))
    for k, p in enumerate((FAST, SLOW)):
        batch, kv_len = (3.0, 1.0)[k], (400.0, 250.0)[k] + 50.0
        assert got[k] == pytest.approx(p.prefill_s(1, 200) + 100 * p.decode_step_s(batch, kv_len))


def test_balanced_latency_floor_keeps_light_load_on_the_fast_backend() -> None:
    # The fast backend already carries some drain time; by drain time alone the idle slow one wins,
    # but the request would run 4x slower there, so the latency floor keeps it on the fast one.
    s = snap(TWO, workload=[0.5, 0.0], kv_tokens=[300, 0], in_flight=[1, 0])
    no_floor = minmax("balanced_minmax", latency_floor=False).choose(req(), s, BOTH)
    with_floor = minmax("balanced_minmax").choose(req(), s, BOTH)
    assert (no_floor.index, with_floor.index) == (1, 0)
    # the floor never enters the ledger: the charge is still T_r^s
    t, _, _ = minmax("balanced_minmax").costs(req(), s, BOTH)
    assert with_floor.workload_cost == pytest.approx(t[0])


def test_the_floor_adds_the_prefill_time_of_prompts_waiting_on_the_backend() -> None:
    # 100 requests decode on the fast backend; 300k prompt tokens are still waiting for prefill there.
    s = snap(TWO, kv_tokens=[300_000, 0], in_flight=[100, 0], prefill_pending=[300_000, 0])
    with_queue = minmax("balanced_minmax", ttft_weight=0.0)
    without = minmax("balanced_minmax", ttft_weight=0.0, prefill_queue=False)
    lat_q, lat_0 = with_queue.latency(req(), s, BOTH), without.latency(req(), s, BOTH)
    assert lat_q[0] - lat_0[0] == pytest.approx(FAST.p1 * 300_000)  # p1 · P_s: a batched prefill
    assert lat_q[1] == lat_0[1]  # nothing waits on the slow backend
    # without the queue the fast backend still looks best; with it, the idle slow one is sooner
    assert (without.choose(req(), s, BOTH).index, with_queue.choose(req(), s, BOTH).index) == (0, 1)
    # the queue only moves the floor: the charge is still T_r^s
    t, _, _ = with_queue.costs(req(), s, BOTH)
    assert with_queue.choose(req(), s, BOTH).workload_cost == pytest.approx(t[1])


def test_workload_minmax_uses_the_prefill_queue_only_inside_the_latency_floor() -> None:
    s = snap(TWO, kv_tokens=[300_000, 0], in_flight=[100, 0], prefill_pending=[300_000, 0])
    paper = minmax("workload_minmax", prefill_queue=True)  # no floor: the queue cannot matter
    assert paper.choose(req(), s, BOTH).index == minmax("workload_minmax").choose(req(), s, BOTH).index
    floored = minmax("workload_minmax", latency_floor=True, prefill_queue=True, theta=0.0)
    assert floored.choose(req(), s, BOTH).index == 1


def test_ttft_weight_counts_the_own_prefill_again_and_prefers_fast_prefill() -> None:
    # "prefill" prefills 3x faster; "decode" decodes a little faster. A long prompt with a short
    # output: by latency alone the decode-fast backend wins by a hair, weighting TTFT moves it.
    prefill_fast = LatencyParams(p1=1e-5, p2=0.0, p3=1e-5, p4=5e-3, p5=0.0, p6=1e-5, p7=0.0, p8=6e-3)
    decode_fast = LatencyParams(p1=3e-5, p2=0.0, p3=3e-5, p4=5e-3, p5=0.0, p6=1e-5, p7=0.0, p8=5e-3)
    pair = (
        backend("prefill", profile(prefill_fast, 500_000)),
        backend("decode", profile(decode_fast, 500_000)),
    )
    r = req(2000, 100)
    plain = minmax("balanced_minmax", backends=pair, ttft_weight=0.0)
    weighted = minmax("balanced_minmax", backends=pair)  # default ttft_weight 8
    s = snap(pair)
    lat_plain, lat_w = plain.latency(r, s, BOTH), weighted.latency(r, s, BOTH)
    models = BackendModels(pair)
    assert (lat_w - lat_plain).tolist() == pytest.approx((8.0 * models.prefill_s(BOTH, 2000)).tolist())
    assert models.prefill_s(BOTH, 2000).tolist() == pytest.approx(
        [prefill_fast.prefill_s(1, 2000), decode_fast.prefill_s(1, 2000)]
    )
    assert lat_plain[1] < lat_plain[0]
    assert (plain.choose(r, s, BOTH).index, weighted.choose(r, s, BOTH).index) == (1, 0)


@pytest.mark.parametrize("name", ["workload_minmax", "balanced_minmax", "memory_minmax", "capacity_weighted"])
def test_through_the_router_every_load_is_released_exactly_once(name: str) -> None:
    clock = ManualClock()
    ledger = Ledger([b.name for b in TWO])
    router = Router(TWO, build_policy(name, {}, PolicyContext(TWO, seed=5)), ledger, clock)
    rng = random.Random(9)
    tickets = [router.route(req(rng.randint(1, 2000), rng.randint(1, 900), f"r{k}")) for k in range(300)]
    assert float(ledger.workload.sum()) == pytest.approx(sum(t.workload_cost for t in tickets))
    for t in tickets[::3]:
        ledger.observe_generated(t, 5)
    rng.shuffle(tickets)
    for t in tickets:
        assert router.release(t) is True
        assert router.release(t) is False  # a second release (e.g. error after completion) is a no-op
    assert ledger.is_zero()


def test_paper_ordering_on_a_saturated_split() -> None:
    # 400 identical requests at once: OS sends more to the fast backend than to the slow one,
    # and far fewer to the slow one than round robin's 50 %.
    clock = ManualClock()
    ledger = Ledger([b.name for b in TWO])
    router = Router(TWO, build_policy("workload_minmax", {}, PolicyContext(TWO)), ledger, clock)
    counts = Counter(router.route(req(rid=f"r{k}")).backend_index for k in range(400))
    assert counts[0] > 2 * counts[1] > 0


# --- single -----------------------------------------------------------------------------------


def test_single_sends_everything_to_the_named_backend_and_falls_back_when_absent() -> None:
    policy = build_policy("single", {"backend": "slow"}, PolicyContext(TWO))
    assert {policy.choose(req(), snap(TWO), BOTH).index for _ in range(5)} == {1}
    d = policy.choose(req(), snap(TWO), np.array([0], dtype=np.int64))
    assert d.index == 0 and "not a candidate" in d.reason
    assert build_policy("single", {}, PolicyContext(TWO)).choose(req(), snap(TWO), BOTH).index == 0


# --- capacity_weighted ------------------------------------------------------------------------


def test_capacity_weighted_splits_in_proportion_to_saturated_throughput() -> None:
    policy = build_policy("capacity_weighted", {}, PolicyContext(TWO))
    models = BackendModels(TWO)
    rate = models.saturated_throughput_tokens_s(BOTH, 230, 200, np.array([800_000.0, 100_000.0]))
    counts = Counter(policy.choose(req(), snap(TWO), BOTH).index for _ in range(2000))
    assert counts[0] / counts[1] == pytest.approx(rate[0] / rate[1], rel=0.02)


def test_capacity_weighted_masks_backends_over_the_high_water_mark() -> None:
    policy = build_policy("capacity_weighted", {"high_water_mark": 0.5}, PolicyContext(TWO))
    over = snap(TWO, kv_tokens=[500_000, 0])  # fast over 0.5·800k
    assert {policy.choose(req(), over, BOTH).index for _ in range(20)} == {1}
    both_over = snap(TWO, kv_tokens=[500_000, 60_000])
    d = policy.choose(req(), both_over, BOTH)
    assert "all over high-water mark" in d.reason


def test_capacity_weighted_does_not_flood_a_returning_backend() -> None:
    policy = build_policy("capacity_weighted", {}, PolicyContext(TWO))
    only_fast = np.array([0], dtype=np.int64)
    for _ in range(1000):
        policy.choose(req(), snap(TWO), only_fast)
    picks = [policy.choose(req(), snap(TWO), BOTH).index for _ in range(20)]
    assert picks.count(0) >= 10  # not 20 requests in a row to the returning slow backend


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "path"),
    [
        ("workload_minmax", {"theta": -1}, "policy.params.theta"),
        ("workload_minmax", {"theta": "two"}, "policy.params.theta"),
        ("workload_minmax", {"kv_signal": "magic"}, "policy.params.kv_signal"),
        ("workload_minmax", {"batch_kv": "half"}, "policy.params.batch_kv"),
        ("workload_minmax", {"thetta": 1}, "policy.params.thetta"),
        ("balanced_minmax", {"ttft_weight": -1}, "policy.params.ttft_weight"),
        ("balanced_minmax", {"prefill_queue": "yes"}, "policy.params.prefill_queue"),
        ("memory_minmax", {"ttft_weight": 1}, "policy.params.ttft_weight"),
        ("memory_minmax", {"batch_kv": "full"}, "policy.params.batch_kv"),
        ("single", {"backend": "nope"}, "policy.params.backend"),
        ("capacity_weighted", {"high_water_mark": 1.5}, "policy.params.high_water_mark"),
        ("capacity_weighted", {"reference_output_tokens": 0}, "policy.params.reference_output_tokens"),
    ],
)
def test_config_errors_name_the_field(name: str, params: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_policy(name, params, PolicyContext(TWO))
    assert info.value.path == path


def test_new_policies_are_registered() -> None:
    new = {"workload_minmax", "memory_minmax", "single", "capacity_weighted", "balanced_minmax"}
    assert new <= set(POLICIES)


def test_paper_kv_signal_uses_dispatch_time_predictions() -> None:
    import numpy as np

    from hetroute.policies.workload_minmax import kv_usage
    from tests.unit.snapshots import snapshot, spec

    bs = (spec("a"), spec("b"))
    snap = snapshot(bs, input_tokens=[100, 300], kv_capacity=[1000, 1000])
    snap = snap._replace(
        predicted_output_tokens_in_flight=np.array([400.0, 0.0]),
        generated_tokens_in_flight=np.array([900.0, 0.0]),
    )
    idx = np.array([0, 1])
    cap = np.array([1000.0, 1000.0])
    assert list(kv_usage(snap, idx, cap, "paper")) == [0.5, 0.3]
    assert list(kv_usage(snap, idx, cap, "ledger")) == [1.0, 0.3]


@pytest.mark.parametrize("path", ["scalar", "array"])
@pytest.mark.parametrize(
    ("max_tokens", "explored"),
    [(None, True), (100, True), (256, True), (257, False), (4096, False)],
)
def test_an_exploration_probe_is_bounded_by_the_clients_max_tokens(
    path: str, max_tokens: int | None, explored: bool
) -> None:
    # The slow backend has no observations and is idle, and every eligible request is explored
    # (explore_share 1): a request predicted short (100 tokens) is a probe unless its max_tokens says
    # it may run past explore_max_output_tokens (256).
    policy = minmax("balanced_minmax", explore_share=1.0)
    s = snap(TWO)._replace(
        latency_params=policy.models.params, model_samples=np.array([50.0, 0.0], dtype=np.float64)
    )
    r = req(200, 100)._replace(max_tokens=max_tokens)
    plain = minmax("balanced_minmax", explore_share=0.0)

    def choose(p: MinMaxPolicy) -> RoutingDecision:
        return p.choose(r, s, BOTH) if path == "scalar" else p.choose_vectorised(r, s, BOTH)

    assert choose(plain).index == 0  # the fast backend, without exploration
    decision = choose(policy)
    assert (decision.index == 1) is explored
    assert decision.reason.startswith("explore") is explored


def test_peer_latency_lets_the_request_s_own_latency_decide_among_equal_backends() -> None:
    # Three equal backends. The first holds the makespan (drain 6 s against 4 s) but has no prompt
    # waiting; the others have 200k prompt tokens queued. The min-max keeps a long prompt off the
    # makespan holder, so it queues; with peer_latency (balanced_minmax's default) its own predicted
    # latency decides.
    peers = tuple(backend(n, profile(FAST, 800_000)) for n in ("a", "b", "c"))
    all3 = np.array([0, 1, 2], dtype=np.int64)
    s = snap(peers, workload=[6.0, 4.0, 4.0], prefill_pending=[0.0, 200_000.0, 200_000.0])
    long_prompt = req(8000, 50)
    plain = minmax("balanced_minmax", peers, peer_latency=False)
    peer = minmax("balanced_minmax", peers)
    assert peer.peer_latency and not minmax("workload_minmax", peers).peer_latency
    lat = peer.latency(long_prompt, s, all3)
    assert lat[0] < lat[1] == lat[2] < 6.0  # the floor binds nowhere: the drain time decides
    assert plain.choose(long_prompt, s, all3).index in (1, 2)
    moved = peer.choose(long_prompt, s, all3)
    assert moved.index == 0
    assert moved.reason.startswith("peer latency ")  # the decision says why it left the min-max
    assert peer.choose_vectorised(long_prompt, s, all3).reason == moved.reason  # the array path alike
    assert plain.choose(long_prompt, s, all3).reason.startswith("min-max load ")
    # the charge is still r's cost on the chosen backend
    _, _, w = peer.costs(long_prompt, s, all3)
    assert peer.choose(long_prompt, s, all3).workload_cost == pytest.approx(w[0])
    # Not peers (one backend has another profile): the min-max decides as without the option.
    mixed = (*peers[:2], backend("c", profile(SLOW, 800_000)))
    s_mixed = snap(mixed, workload=[6.0, 4.0, 4.0], prefill_pending=[0.0, 200_000.0, 200_000.0])
    unequal = minmax("balanced_minmax", mixed)
    assert unequal.choose(long_prompt, s_mixed, all3).index == 1


def test_peers_need_the_same_model_slots_and_a_known_equal_capacity() -> None:
    known = tuple(backend(n, profile(FAST, 800_000)) for n in ("a", "b"))
    models = BackendModels(known)
    assert all_peers(models, snap(known), BOTH)
    assert not all_peers(models, snap(known), np.array([0], dtype=np.int64))  # one is no fleet
    assert not all_peers(models, snap(known, caps=[800_000, 400_000]), BOTH)  # the engines disagree
    slots = (known[0], backend("b", profile(FAST, 800_000, max_num_seqs=128)))
    assert not all_peers(BackendModels(slots), snap(slots), BOTH)
    # Nothing known: equal only with a reported capacity, and while both publish the same live model
    # (one nothing-known pool); equal fallbacks say nothing about the hardware.
    unknown = (backend("a"), backend("b"))
    blind = BackendModels(unknown, None)
    assert not all_peers(blind, snap(unknown), BOTH)
    reported = snap(unknown, caps=[100_000, 100_000])
    assert all_peers(blind, reported, BOTH)
    pooled = np.tile(np.array(FAST.as_tuple()), (2, 1))
    assert all_peers(blind, reported._replace(latency_params=pooled), BOTH)
    own = pooled.copy()
    own[1, 0] *= 2.0
    assert not all_peers(blind, reported._replace(latency_params=own), BOTH)


def test_the_peer_test_is_kept_while_its_inputs_are_the_same_objects_and_redone_when_replaced() -> None:
    unknown = (backend("a"), backend("b"))
    models = BackendModels(unknown, None)
    caps = np.array([100_000.0, 100_000.0])
    caps.flags.writeable = False
    pooled = np.tile(np.array(FAST.as_tuple()), (2, 1))
    pooled.flags.writeable = False
    own = pooled.copy()
    own[1, 0] *= 2.0
    own.flags.writeable = False
    memo = PeerMemo()
    s = snap(unknown)._replace(kv_capacity_tokens=caps, latency_params=pooled)
    assert memo(models, s, BOTH) and memo(models, s, BOTH)
    # a refit replaces the parameter array whole: the test is done again on the new one
    assert not memo(models, s._replace(latency_params=own), BOTH)
    assert memo(models, s, BOTH)
    # other candidates (one backend is no fleet), and an array that can still change, are not kept
    assert not memo(models, s, np.array([0], dtype=np.int64))
    writable = pooled.copy()
    s_w = s._replace(latency_params=writable)
    assert memo(models, s_w, BOTH)
    writable[1, 0] *= 2.0
    assert not memo(models, s_w, BOTH)
