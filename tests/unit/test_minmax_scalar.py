"""The scalar min-max decision (small fleets) equals the array one exactly, on random snapshots.

Each case draws a fleet of 1-16 backends (some sharing parameters, capacities and loads, so that exact
ties happen), a random state (loads, in-flight tokens, capacities known or not, learned or static
parameters, prefix matches and trust, a session's backend, sample counts), a random request and a
random policy configuration; two policies with the same seed decide, one through
:func:`choose_scalar`, one through ``choose_vectorised``: index, reason, cost, scores and the RNG's
state afterwards must be identical.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from hetroute.latency import EngineLimits, LatencyParams, LatencyProfile
from hetroute.policies.backend_model import BackendModels
from hetroute.policies.minmax_scalar import SCALAR_MAX_BACKENDS, choose_scalar
from hetroute.policies.workload_minmax import MinMaxPolicy
from hetroute.types import BackendSpec, ClusterSnapshot, IntArray, RequestFeatures

CASES = 6000


def _params(rng: random.Random) -> LatencyParams:
    def p(scale: float) -> float:
        return rng.choice([0.0, scale * rng.uniform(0.2, 5.0)])

    return LatencyParams(
        p(5e-5), p(1e-4), p(5e-6), p(1e-3), p(4e-8), p(4e-5), p(1e-7), rng.uniform(5e-3, 3e-2)
    )


def _fleet(rng: random.Random, n: int) -> tuple[BackendSpec, ...]:
    shared = _params(rng)
    peers = rng.random() < 0.2  # every backend the same profile: a fleet of peers (``peer_latency``)
    twin = LatencyProfile(
        params=shared,
        kv_capacity_tokens=97_000,
        kv_capacity_source="test",
        limits=EngineLimits(max_num_seqs=256),
    )
    out = []
    for j in range(n):
        profile = twin if peers else None
        if not peers and rng.random() < 0.7:
            seqs = rng.choice([None, 8, 256])
            profile = LatencyProfile(
                params=shared if rng.random() < 0.4 else _params(rng),
                kv_capacity_tokens=rng.choice([1000, 97_000, 786_000]),
                kv_capacity_source="test",
                limits=EngineLimits(max_num_seqs=seqs),
            )
        out.append(
            BackendSpec(
                name=f"b{j}",
                url=f"http://127.0.0.1:{9000 + j}",
                engine="vllm",
                models=("m",),
                profile=profile,
            )
        )
    return tuple(out)


def _snapshot(
    rng: random.Random, backends: tuple[BackendSpec, ...], models: BackendModels
) -> ClusterSnapshot:
    n = len(backends)
    tie = rng.random() < 0.3  # many equal values: exact ties in the scores

    def values(scale: float, *, zero: float = 0.3) -> np.ndarray:
        pool = [0.0, scale, 2 * scale] if tie else None
        out = [
            (rng.choice(pool) if pool else rng.uniform(0, scale)) if rng.random() > zero else 0.0
            for _ in range(n)
        ]
        return np.array(out, dtype=np.float64)

    requests = np.array([rng.choice([0, 0, 1, 3, 40]) for _ in range(n)], dtype=np.int64)
    caps = np.array([rng.choice([np.nan, 500.0, 50_000.0, 400_000.0]) for _ in range(n)], dtype=np.float64)
    if rng.random() < 0.3:
        caps = np.full(n, rng.choice([np.nan, 97_000.0]))  # equal (or none): peers stay peers
    learned = models.params * rng.uniform(0.5, 2.0) if rng.random() < 0.5 else None
    matched = values(2000.0) if rng.random() < 0.5 else None
    trust = np.array([rng.choice([0.05, 0.5, 1.0]) for _ in range(n)]) if matched is not None else None
    return ClusterSnapshot(
        now_s=1.0,
        backends=backends,
        metrics=(None,) * n,
        requests_in_flight=requests,
        input_tokens_in_flight=values(50_000.0),
        remaining_predicted_tokens=values(20_000.0),
        generated_tokens_in_flight=values(20_000.0),
        predicted_output_tokens_in_flight=values(30_000.0),
        workload=values(rng.choice([0.01, 5.0, 100.0]), zero=0.5),
        prefill_pending_tokens=values(rng.choice([10_000.0, 60_000.0])),  # 60k: the pending guard acts
        available=np.ones(n, dtype=np.bool_),
        kv_capacity_tokens=caps,
        latency_params=learned,
        model_samples=np.array([float(rng.choice([0, 1, 2, 5])) for _ in range(n)])
        if learned is not None
        else None,
        prefix_matched_tokens=matched,
        prefix_trust=trust if rng.random() < 0.8 else None,
        session_backend=rng.choice([-1, rng.randrange(n)]),
    )


def _policy_kwargs(rng: random.Random) -> dict[str, Any]:
    return {
        "theta": rng.choice([0.0, 0.0, 2.0, rng.uniform(0.0, 20.0)]),
        "unit_time": rng.random() < 0.15,
        "kv_signal": rng.choice(["ledger", "paper"]),
        "batch_kv": rng.choice(["full", "average"]),
        "overflow_only": rng.random() < 0.5,
        "latency_floor": rng.random() < 0.6,
        "prefill_queue": rng.random() < 0.5,
        "ttft_weight": rng.choice([0.0, 8.0, rng.uniform(0.0, 20.0)]),
        "explore_share": rng.choice([0.0, 0.02, 1.0]),
        "explore_min_samples": rng.choice([0, 3, 10]),
        "explore_max_output_tokens": rng.choice([1, 256, 100_000]),
        "prefix": rng.random() < 0.7,
        "cache_weight": rng.choice([1.0, 2.0, rng.uniform(1.0, 10.0)]),
        "session_slack": rng.choice([0.0, 0.1, 1.0]),
        "peer_latency": rng.random() < 0.5,
        "fresh_prompt_tokens": rng.choice([0, 1, 500, 7168]),
        "fresh_near_ratio": rng.choice([1.0, 3.0, rng.uniform(1.0, 10.0)]),
        "fresh_queue_weight": rng.choice([0.0, 1.5, rng.uniform(0.0, 5.0)]),
        "duplicate_weight": rng.choice([0.0, 16.0, rng.uniform(0.0, 40.0)]),
    }


def _case(
    rng: random.Random, *, one: bool
) -> tuple[MinMaxPolicy, MinMaxPolicy, ClusterSnapshot, IntArray, RequestFeatures, dict[str, Any]]:
    """A random fleet, snapshot and policy (two instances with the same seed), candidates (``one``: a
    single one) and request."""
    n = rng.randint(1, SCALAR_MAX_BACKENDS)
    backends = _fleet(rng, n)
    models = BackendModels(backends)
    snap = _snapshot(rng, backends, models)
    kwargs = _policy_kwargs(rng)
    seed = rng.randrange(1 << 30)
    first = MinMaxPolicy("p", models, random.Random(seed), **kwargs)
    second = MinMaxPolicy("p", models, random.Random(seed), **kwargs)
    chosen = [rng.randrange(n)] if one else sorted(rng.sample(range(n), rng.randint(1, n)))
    features = RequestFeatures(
        "r",
        "m",
        "openai",
        rng.choice([0, 1, 37, 900, 20_000]),
        rng.choice([None, None, 1, 300, 5000]),
        rng.choice([1, 16, 300, 4000]),
    )
    return first, second, snap, np.array(chosen, dtype=np.int64), features, kwargs


def _decide(rng: random.Random) -> None:
    scalar, arrays, snap, candidates, features, kwargs = _case(rng, one=False)
    chosen = candidates.tolist()
    a = choose_scalar(scalar, scalar._rng, features, snap, candidates)
    b = arrays.choose_vectorised(features, snap, candidates)
    assert a is not None
    assert (a.index, a.reason, a.workload_cost, dict(a.scores)) == (
        b.index,
        b.reason,
        b.workload_cost,
        dict(b.scores),
    ), (
        kwargs,
        snap,
        features,
        chosen,
    )
    assert scalar._rng.getstate() == arrays._rng.getstate()


@pytest.mark.parametrize("block", range(4))
def test_scalar_decision_equals_the_array_decision(block: int) -> None:
    rng = random.Random(1000 + block)
    for _ in range(CASES // 4):
        _decide(rng)


def test_one_candidate_is_charged_what_the_full_decision_charges() -> None:
    """``choose_forced`` (one candidate) charges exactly the array path's w, picks the same backend and
    leaves the RNG where the full decision leaves it."""
    rng = random.Random(2024)
    for _ in range(CASES // 4):
        forced, arrays, snap, candidates, features, kwargs = _case(rng, one=True)
        a = forced.choose(features, snap, candidates)
        b = arrays.choose_vectorised(features, snap, candidates)
        assert a.reason.startswith("only candidate") and "minmax_load" not in a.scores
        assert (a.index, a.workload_cost) == (b.index, b.workload_cost), (kwargs, snap, features)
        assert {k: a.scores[k] for k in ("T_s", "kv_usage", "w")} == {
            k: b.scores[k] for k in ("T_s", "kv_usage", "w")
        }
        assert forced._rng.getstate() == arrays._rng.getstate()


def test_choose_uses_the_scalar_path_only_for_small_fleets_and_ledger_or_paper_signals() -> None:
    rng = random.Random(7)
    backends = _fleet(rng, 3)
    models = BackendModels(backends)
    snap = _snapshot(rng, backends, models)
    features = RequestFeatures("r", "m", "openai", 100, None, 50)
    candidates = np.arange(3, dtype=np.int64)
    engine = MinMaxPolicy("p", models, random.Random(1), kv_signal="engine")
    assert choose_scalar(engine, engine._rng, features, snap, candidates) is None  # the arrays decide
    assert engine.choose(features, snap, candidates).index in (0, 1, 2)
    ledger = MinMaxPolicy("p", models, random.Random(1))
    assert choose_scalar(ledger, ledger._rng, features, snap, candidates) is not None
