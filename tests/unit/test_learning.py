"""The live latency learner: the fit (recovery, robustness, prior anchor, decay), drift, persistence."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from hetroute.latency import load_profile
from hetroute.learning.fit import (
    _TTFT_DECODE_STEPS,
    FitResult,
    FitSettings,
    RowCache,
    decode_point,
    fit_backend,
    predict_e2e_s,
    predict_tpot_s,
    running_point,
)
from hetroute.learning.live import DRIFT_WINDOW, PEER_MIN_SAMPLES, LiveModels, PriorModel
from hetroute.learning.observation import Observation
from hetroute.learning.settings import LearningConfig
from hetroute.learning.state import live_profile, load_saved, save_all, state_file
from hetroute.policies.backend_model import NEUTRAL_LEARNING_PRIOR, NEUTRAL_PARAMS
from hetroute.types import BackendSpec

# A "true" backend: prefill 0.1 ms per token in the batch + 20 ms; decode 25 ms + 0.5 ms per sequence
# + 2e-8 s per sequence·token of context.
TRUE = (1e-4, 0.0, 0.0, 0.02, 2e-8, 5e-4, 0.0, 0.025)
CAP = 200_000.0
SEQS = 256.0


def synthetic(
    params: tuple[float, ...],
    n: int,
    rng: random.Random,
    *,
    start_s: float = 0.0,
    noise: float = 0.03,
    outliers: float = 0.0,
    streamed: bool = True,
) -> list[Observation]:
    """Requests at varied load whose TTFT and decode follow ``params`` (fit.py's model) with noise."""
    out = []
    for k in range(n):
        i = rng.randint(20, 2000)
        o = rng.randint(2, 600)
        n1 = float(rng.randint(1, 60))
        n2 = float(max(1, n1 + rng.randint(-5, 5)))
        ctx1, ctx2 = n1 * rng.uniform(200, 900), n2 * rng.uniform(200, 900)
        ahead = float(rng.choice([0, 0, 0, rng.randint(0, 4000)]))
        obs = Observation(0, start_s + k * 0.1, i, o, 0.0, 0.0, ahead, n1, ctx1, n2, ctx2)
        e2e = predict_e2e_s(params, obs, CAP, SEQS)
        tpot = predict_tpot_s(params, obs, CAP, SEQS)
        decode = (o - 1) * tpot * (1 + noise * rng.gauss(0, 1))
        ttft = max(e2e - (o - 1) * tpot, 1e-3) * (1 + noise * rng.gauss(0, 1))
        if outliers and rng.random() < outliers:
            ttft *= 20.0  # a request stuck behind something the model does not know about
        out.append(
            Observation(
                0,
                obs.finished_at_s,
                i,
                o,
                ttft if streamed else None,
                ttft + decode,
                ahead,
                n1,
                ctx1,
                n2,
                ctx2,
            )
        )
    return out


def _fit(obs: list[Observation], prior: tuple[float, ...]) -> FitResult:
    """The fit at the time of the last observation, with the default settings."""
    return fit_backend(
        obs,
        prior,
        now_s=obs[-1].finished_at_s,
        capacity_tokens=CAP,
        max_num_seqs=SEQS,
        settings=FitSettings(),
    )


def _step(params: tuple[float, ...], b: float, length: float) -> float:
    return params[4] * b * length + params[5] * b + params[6] * length + params[7]


def test_fit_recovers_the_decode_curve_and_the_prefill_level_from_a_wrong_prior() -> None:
    prior = tuple(v * 2.0 for v in TRUE)  # twice too slow everywhere
    obs = synthetic(TRUE, 400, random.Random(1))
    fit = _fit(obs, prior)
    for b, length in ((1, 300), (16, 500), (48, 800)):
        assert _step(fit.params, b, length) == pytest.approx(_step(TRUE, b, length), rel=0.05)
    # Prefill is learned as a scale of the prior's curve: the scale comes back to the truth.
    assert fit.params[0] == pytest.approx(TRUE[0], rel=0.1)
    assert fit.params[3] == pytest.approx(TRUE[3], rel=0.1)
    assert fit.samples == 400 and fit.tpot_mape < 0.05


def test_refits_with_a_row_cache_equal_fits_from_scratch() -> None:
    """A window sliding over streamed and non-streamed requests, refitted with one cache, while the
    capacity changes once: every fit equals the one computed without the cache, exactly."""
    rng = random.Random(5)
    stream = synthetic(TRUE, 300, rng) + synthetic(TRUE, 300, rng, start_s=30.0, streamed=False)
    rng.shuffle(stream)
    cache = RowCache()
    prior = tuple(v * 1.5 for v in TRUE)
    for end, cap in ((100, CAP), (140, CAP), (400, CAP), (420, CAP / 4), (600, CAP / 4), (600, CAP)):
        window = stream[max(0, end - 128) : end]
        kwargs = {"now_s": 60.0, "capacity_tokens": cap, "max_num_seqs": SEQS, "settings": FitSettings()}
        assert fit_backend(window, prior, cache=cache, **kwargs) == fit_backend(window, prior, **kwargs)  # type: ignore[arg-type]


def test_the_drift_statistic_is_numpys_median_exactly() -> None:
    """The drift check takes the median of DRIFT_WINDOW residuals with ``statistics.median``: the same
    value as ``np.median`` (what it replaced), ties and odd or even windows included."""
    rng = random.Random(9)
    for n in (DRIFT_WINDOW, DRIFT_WINDOW - 1, 2, 1):
        for _ in range(2000):
            pool = [rng.gauss(0, 1) for _ in range(4)]
            window = [
                rng.choice(pool) if rng.random() < 0.3 else math.log(rng.uniform(0.01, 100)) for _ in range(n)
            ]
            assert statistics.median(window) == float(np.median(np.array(window)))


def test_fit_is_robust_to_outliers() -> None:
    obs = synthetic(TRUE, 400, random.Random(2), outliers=0.1)
    fit = _fit(obs, TRUE)
    assert fit.params[0] == pytest.approx(TRUE[0], rel=0.15)
    assert _step(fit.params, 16, 500) == pytest.approx(_step(TRUE, 16, 500), rel=0.05)


def test_a_few_surprisingly_fast_first_tokens_do_not_drag_the_prefill_scale_down() -> None:
    """A first token 30× sooner than the model can explain (a prefix-cache hit the router did not
    expect; a prompt that joined a step beside one it counted as ahead of it) is a point of high
    leverage in a relative fit: three in 300 took α to a fraction of the truth before the rows'
    leverage was bounded (fit.py, "bounded leverage")."""
    obs = synthetic(TRUE, 300, random.Random(4))
    for k in (100, 200, 290):
        o = obs[k]
        fast = o._replace(input_tokens=4000, pending_tokens_ahead=8000.0, ttft_s=0.02, e2e_s=0.02 + o.e2e_s)
        obs[k] = fast
    assert _fit(obs, TRUE).params[0] == pytest.approx(TRUE[0], rel=0.15)


def test_the_bound_on_leverage_does_not_hold_back_a_prior_wrong_everywhere() -> None:
    """Every row is 10× faster than a prior 10× too slow: no row is surprising next to the others, so
    the fit moves to the truth as freely as without the bound."""
    prior = tuple(v * 10.0 for v in TRUE)
    fit = _fit(synthetic(TRUE, 400, random.Random(6)), prior)
    assert fit.params[0] == pytest.approx(TRUE[0], rel=0.1)
    assert _step(fit.params, 16, 500) == pytest.approx(_step(TRUE, 16, 500), rel=0.05)


def test_few_observations_stay_near_the_prior_and_many_move_to_the_data() -> None:
    prior = tuple(v * 2.0 for v in TRUE)
    rng = random.Random(3)
    few = synthetic(TRUE, 2, rng)
    many = synthetic(TRUE, 300, rng)
    settings = FitSettings(prior_strength=8.0)
    with_few = fit_backend(
        few, prior, now_s=few[-1].finished_at_s, capacity_tokens=CAP, max_num_seqs=SEQS, settings=settings
    )
    with_many = fit_backend(
        many, prior, now_s=many[-1].finished_at_s, capacity_tokens=CAP, max_num_seqs=SEQS, settings=settings
    )
    truth, start = _step(TRUE, 16, 500), _step(prior, 16, 500)
    few_err = abs(_step(with_few.params, 16, 500) - truth)
    many_err = abs(_step(with_many.params, 16, 500) - truth)
    assert few_err > 0.1 * abs(start - truth)  # two requests do not overrule the prior entirely
    assert many_err < 0.05 * truth and many_err < few_err / 3


def test_no_observation_returns_the_prior() -> None:
    fit = fit_backend([], TRUE, now_s=0.0, capacity_tokens=CAP, max_num_seqs=SEQS, settings=FitSettings())
    assert fit.params == TRUE and fit.samples == 0


def test_non_streaming_answers_are_fitted_on_their_e2e() -> None:
    prior = tuple(v * 2.0 for v in TRUE)
    obs = synthetic(TRUE, 400, random.Random(4), streamed=False)
    fit = _fit(obs, prior)
    errors = [abs(predict_e2e_s(fit.params, o, CAP, SEQS) / o.e2e_s - 1) for o in obs]
    assert float(np.median(errors)) < 0.05
    assert math.isnan(fit.tpot_mape) and fit.e2e_mape < 0.1


def _full_batch(params: tuple[float, ...], n: int, rng: random.Random) -> list[Observation]:
    """Non-streamed answers that all ran at a full batch of 240-256 sequences of ~600 tokens (rate ∞
    behind the admission queue): they show the full batch's step and nothing else."""
    out = []
    for k in range(n):
        i, o = rng.randint(20, 1000), rng.randint(2, 600)
        n1, n2 = float(rng.randint(240, 256)), float(rng.randint(240, 256))
        obs = Observation(0, k * 0.05, i, o, None, 0.0, 0.0, n1, n1 * 600.0, n2, n2 * 600.0)
        e2e = predict_e2e_s(params, obs, CAP, SEQS) * (1 + 0.03 * rng.gauss(0, 1))
        out.append(obs._replace(e2e_s=e2e))
    return out


def test_the_neutral_prior_prices_a_small_batch_as_decode_steps_scale_not_as_the_full_one() -> None:
    """Traffic that only ever ran at a full batch identifies the full batch's step; the prior's shape
    decides what a small batch costs (the end of a backlog, where a backend that is not full takes
    spilled requests). For a backend shaped like the catalog's A100 (step 20 ms at 41 sequences,
    53 ms at 250), the neutral prior's curve prices 40 sequences within 1.5× of the truth; the flat
    20 ms step it replaced priced them near the full batch's cost (2.1× too slow here; 1.13× with it)."""
    a100_like = (1e-4, 0.0, 0.0, 0.02, 7.03e-8, 1.15e-4, 0.0, 0.0137)
    obs = _full_batch(a100_like, 400, random.Random(6))
    flat = (2e-4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.02)
    for prior, low, high in ((NEUTRAL_LEARNING_PRIOR.as_tuple(), 1 / 1.5, 1.5), (flat, 1.8, 4.0)):
        fit = _fit(obs, prior)
        # Both fits reproduce what they saw ...
        assert _step(fit.params, 248, 600) == pytest.approx(_step(a100_like, 248, 600), rel=0.1)
        # ... and only the batch-shaped prior extrapolates to a small batch.
        ratio = _step(fit.params, 40, 600) / _step(a100_like, 40, 600)
        assert low < ratio < high, (prior, ratio)


def test_the_decaying_window_follows_a_change() -> None:
    slow = tuple(v * 2.0 for v in TRUE)
    rng = random.Random(5)
    old = synthetic(TRUE, 300, rng, start_s=0.0)
    new = synthetic(slow, 300, rng, start_s=200.0)  # 60 s of the slower regime, 170 s later
    fit = fit_backend(
        old + new,
        TRUE,
        now_s=new[-1].finished_at_s,
        capacity_tokens=CAP,
        max_num_seqs=SEQS,
        settings=FitSettings(half_life_s=20.0),
    )
    assert _step(fit.params, 16, 500) == pytest.approx(_step(slow, 16, 500), rel=0.1)


def _live(config: LearningConfig | None = None, n: int = 1) -> LiveModels:
    priors = [PriorModel(TRUE, "test prior", "profile")] * n
    return LiveModels([f"b{i}" for i in range(n)], priors, [CAP] * n, [SEQS] * n, config or LearningConfig())


def test_live_models_publish_new_read_only_arrays_only_on_refit() -> None:
    live = _live(n=1)
    live.set_slot(1, "b1", PriorModel(tuple(v * 2 for v in TRUE), "other prior", "profile"), CAP, SEQS, TRUE)
    before = live.params
    assert not before.flags.writeable and not live.samples.flags.writeable
    slow = tuple(v * 1.3 for v in TRUE)
    for obs in synthetic(slow, 50, random.Random(6)):
        live.observe(obs)
    assert live.params is before  # observe only records
    assert live.refit(now_s=10.0) == 1
    assert live.params is not before and not live.params.flags.writeable
    assert live.params[1].tolist() == pytest.approx(list(TRUE))  # backend 1 saw nothing
    assert live.samples.tolist() == [50.0, 0.0]
    d = live.describe(0)
    assert d["samples"] == 50 and d["prior"] == {"source": "test prior", "kind": "profile"}
    params = d["params"]
    assert isinstance(params, dict) and params["p8"]["source"] == "live"
    assert 0.0 <= float(str(d["e2e_error"])) < 1.0


def test_peers_with_the_same_informed_prior_publish_the_best_learned_model_until_they_have_their_own() -> (
    None
):
    """Backends with equal profile or roofline priors are the same hardware as far as the router knows:
    one with fewer than PEER_MIN_SAMPLES fitted requests publishes the best-learned peer's model (its
    common prior while none has that many); equal neutral priors say nothing and, with no reported
    capacity, are not peers."""
    priors = [PriorModel(TRUE, "same profile", "profile")] * 2 + [PriorModel(TRUE, "nothing", "neutral")] * 2
    live = LiveModels(["a", "b", "c", "d"], priors, [CAP] * 4, [SEQS] * 4, LearningConfig())
    slow = tuple(v * 1.5 for v in TRUE)
    rows = synthetic(slow, 200, random.Random(8))
    for obs in rows[: PEER_MIN_SAMPLES - 1]:
        live.observe(obs)
    live.refit(now_s=10.0)
    assert live.params[0].tolist() == pytest.approx(list(TRUE))  # too few: the common prior
    assert live.describe(0)["published_from"] == "the peers' common prior"
    assert live.describe(1)["published_from"] is None  # b: nothing fitted, its own prior
    for obs in rows[PEER_MIN_SAMPLES - 1 : 60]:
        live.observe(obs)
        live.observe(obs._replace(backend_index=2))
    live.refit(now_s=20.0)
    assert live.params[0][0] == pytest.approx(slow[0], rel=0.1)
    assert live.params[1].tolist() == live.params[0].tolist()  # b saw nothing: a's model
    assert live.describe(1)["published_from"] == "peer a (60 fitted requests)"
    assert live.describe(0)["published_from"] is None and live.describe(3)["published_from"] is None
    assert live.params[2][0] == pytest.approx(slow[0], rel=0.1)
    assert live.params[3].tolist() == pytest.approx(list(TRUE))  # d: its own prior, not c's model
    assert live.samples.tolist() == [60.0, 0.0, 45.0, 0.0]  # exploration still counts b's own
    fast = tuple(v * 0.5 for v in TRUE)
    for obs in synthetic(fast, 40, random.Random(9), start_s=20.0):
        live.observe(obs._replace(backend_index=1))
    live.refit(now_s=30.0)
    assert live.params[1][0] == pytest.approx(fast[0], rel=0.15)  # enough of its own: its own fit


def test_nothing_known_backends_with_equal_reported_capacity_publish_one_pooled_fit() -> None:
    """Backends on the neutral default are peers only when the engines report equal KV capacities and
    the slot limits are equal: they publish one fit over the whole group's observations, so neither
    the first to finish a request nor the one whose own fit happens to rate it cheapest looks faster
    than the rest. A capacity not reported (the fallback) makes no group."""
    neutral = PriorModel(NEUTRAL_LEARNING_PRIOR.as_tuple(), "nothing known", "neutral")
    start = [NEUTRAL_PARAMS.as_tuple()] * 4
    live = LiveModels(["a", "b", "c", "d"], [neutral] * 4, [CAP] * 4, [SEQS] * 4, LearningConfig(), start)
    alone = LiveModels(["a"], [neutral], [CAP], [SEQS], LearningConfig(), start[:1])
    live.set_capacities(np.array([CAP, CAP, 2 * CAP, math.nan]))
    alone.set_capacities(np.array([CAP]))
    fast = tuple(v * 0.5 for v in TRUE)
    rows = synthetic(fast, 80, random.Random(12))
    for obs in rows[:5]:
        live.observe(obs)
        alone.observe(obs)
    live.refit(now_s=10.0)
    alone.refit(now_s=10.0)
    assert live.params[0].tolist() == alone.params[0].tolist()  # a: the pool holds only a's requests
    assert live.params[1].tolist() == live.params[0].tolist()  # b: a's requests, not the neutral default
    assert live.params[2].tolist() == live.params[3].tolist() == list(NEUTRAL_PARAMS.as_tuple())
    assert live.describe(1)["published_from"] == "pooled fit of a, b (5 requests)"
    assert live.describe(2)["published_from"] is None
    for obs in rows[5:10]:
        live.observe(obs._replace(backend_index=1))
    live.refit(now_s=20.0)
    assert live.params[1].tolist() == live.params[0].tolist()  # one fit over both
    assert live.params[1].tolist() != alone.params[0].tolist()
    assert live.samples.tolist() == [5.0, 5.0, 0.0, 0.0]  # exploration still counts each one's own
    for obs in rows[10:40]:
        live.observe(obs)
    live.refit(now_s=30.0)
    fit_a = live.fit_of(0)
    assert fit_a is not None and fit_a.samples >= PEER_MIN_SAMPLES
    assert live.params[0].tolist() == live.params[1].tolist() != list(fit_a.params)  # still the pool
    assert live.describe(0)["published_from"] == "pooled fit of a, b (40 requests)"
    assert live.params[1][0] == pytest.approx(fast[0], rel=0.2)


def test_a_nothing_known_peer_whose_own_fit_differs_leaves_the_pool() -> None:
    """Equal reported capacities do not prove equal hardware: a member whose own fit predicts its own
    requests more than POOL_LEAVE_RATIO apart from the others' pool publishes its own fit, and the
    others pool without its requests."""
    neutral = PriorModel(NEUTRAL_LEARNING_PRIOR.as_tuple(), "nothing known", "neutral")
    live = LiveModels(["a", "b", "c"], [neutral] * 3, [CAP] * 3, [SEQS] * 3, LearningConfig())
    live.set_capacities(np.full(3, CAP))
    slow = tuple(v * 2.0 for v in TRUE)
    for b, (params, seed) in enumerate(((TRUE, 21), (TRUE, 22), (slow, 23))):
        for obs in synthetic(params, 60, random.Random(seed)):
            live.observe(obs._replace(backend_index=b))
    live.refit(now_s=10.0)
    own_c = live.fit_of(2)
    assert own_c is not None and live.params[2].tolist() == list(own_c.params)
    assert live.describe(2)["published_from"] is None
    assert live.params[0].tolist() == live.params[1].tolist()
    assert live.describe(0)["published_from"] == "pooled fit of a, b (120 requests)"
    obs = synthetic(TRUE, 1, random.Random(24))[0]
    pooled_s = predict_e2e_s(live.params[0].tolist(), obs, CAP, SEQS)
    assert pooled_s == pytest.approx(predict_e2e_s(TRUE, obs, CAP, SEQS), rel=0.15)
    assert predict_e2e_s(live.params[2].tolist(), obs, CAP, SEQS) > 1.6 * pooled_s


def test_a_pool_fits_at_most_one_window_however_large_the_group() -> None:
    """A pool takes only each member's newest window // members observations (at least one), so its fit
    costs about one backend's however large the group (here 8 members, one that never finished a
    request, and windows of 64: 8 requests from each of the seven)."""
    neutral = PriorModel(NEUTRAL_LEARNING_PRIOR.as_tuple(), "nothing known", "neutral")
    n = 8
    live = LiveModels(
        [f"b{i}" for i in range(n)], [neutral] * n, [CAP] * n, [SEQS] * n, LearningConfig(window=64)
    )
    live.set_capacities(np.full(n, CAP))
    rows = synthetic(TRUE, 40 * (n - 1), random.Random(13))
    for k, obs in enumerate(rows):
        live.observe(obs._replace(backend_index=k % (n - 1)))  # b7 never finishes one
    live.refit(now_s=100.0)
    assert [live.observed_total(i) for i in range(n)] == [40] * (n - 1) + [0]
    pooled = f"pooled fit of {', '.join(live.names)} ({8 * (n - 1)} requests)"
    assert all(live.describe(i)["published_from"] == pooled for i in range(n))


def test_a_two_fold_slow_down_is_detected_as_drift_and_relearned() -> None:
    live = _live(LearningConfig(half_life_s=30.0))
    rng = random.Random(7)
    now = 0.0
    for obs in synthetic(TRUE, 200, rng, start_s=0.0):
        live.observe(obs)
        now = obs.finished_at_s
    live.refit(now)
    assert live.drifts(0) == 0
    slow = tuple(v * 2.0 for v in TRUE)
    for obs in synthetic(slow, 100, rng, start_s=now + 1):
        live.observe(obs)
        now = obs.finished_at_s
    assert live.drifts(0) >= 1
    assert live.drift_times_s(0)[0] <= now
    assert live.samples[0] < 200 + 100  # the count restarted at the drift
    live.refit(now)
    assert _step(tuple(live.params[0]), 16, 500) == pytest.approx(_step(slow, 16, 500), rel=0.2)


def test_queued_observations_are_taken_in_as_if_one_at_a_time() -> None:
    """observe() queues; whatever reads or changes the models takes the queue in first, so a learner
    read after every observation (each taken in at once) and one read only at its refits agree
    exactly: the same errors, drifts and fitted parameters."""
    one_at_a_time, queued = _live(LearningConfig(half_life_s=30.0)), _live(LearningConfig(half_life_s=30.0))
    rng = random.Random(11)
    stream = synthetic(TRUE, 150, rng) + synthetic(tuple(v * 2.0 for v in TRUE), 150, rng, start_s=20.0)
    for k, obs in enumerate(stream):
        one_at_a_time.observe(obs)
        assert one_at_a_time.observed_total(0) == k + 1  # a read takes the queue in
        queued.observe(obs)
        if k % 50 == 49:
            one_at_a_time.refit(obs.finished_at_s)
            queued.refit(obs.finished_at_s)
    assert queued.drifts(0) == one_at_a_time.drifts(0) >= 1
    assert queued.drift_times_s(0) == one_at_a_time.drift_times_s(0)
    assert queued.recent_e2e_errors(0) == one_at_a_time.recent_e2e_errors(0)
    assert queued.observations(0) == one_at_a_time.observations(0)
    assert np.array_equal(queued.params, one_at_a_time.params)
    assert queued.describe(0) == one_at_a_time.describe(0)


def test_stationary_traffic_raises_no_drift() -> None:
    live = _live()
    for k, obs in enumerate(synthetic(TRUE, 600, random.Random(8))):
        live.observe(obs)
        if k % 20 == 19:
            live.refit(obs.finished_at_s)
    assert live.drifts(0) == 0
    assert len(live.recent_e2e_errors(0)) == 256
    assert float(np.median(live.recent_e2e_errors(0))) < 0.1


def _spec(name: str, gpu: str = "V100-SXM2-32GB", tp: int = 4) -> BackendSpec:
    return BackendSpec(name, "http://127.0.0.1:1", "vllm", ("house-llm",), gpu=gpu, tp=tp)


def test_learned_models_are_saved_as_profiles_and_loaded_only_for_their_backend(tmp_path: Path) -> None:
    live = _live(n=2)
    for obs in synthetic(tuple(v * 1.5 for v in TRUE), 80, random.Random(9)):
        live.observe(obs)
    live.refit(10.0)
    specs = [_spec("a/b c"), _spec("other")]
    assert save_all(live, specs, [CAP, float("nan")], tmp_path) == 1  # backend 1 has no fit
    path = state_file(tmp_path, "a/b c")
    assert path.name == "a_b_c.yaml"
    profile = load_profile(path)  # the same artifact format `hetroute profile` writes
    assert profile.source == "live" and profile.labels["backend"] == "a/b c"
    assert profile.params.as_tuple() == pytest.approx(tuple(live.params[0]))
    assert profile.kv_capacity_tokens == int(CAP) and profile.sweep["live_samples"] == 80
    assert set(load_saved(tmp_path, specs)) == {0}
    # The same name on another GPU or TP is not this backend: ignored (with a warning).
    assert load_saved(tmp_path, [_spec("a/b c", tp=2)]) == {}
    path.write_text("params: [1, 2]\n")
    assert load_saved(tmp_path, specs) == {}  # unreadable: ignored, never fatal
    assert live_profile(live, 1, specs[1], float("nan")).kv_capacity_source == "unknown"


def test_the_drift_median_kept_sorted_is_statistics_median_of_the_residual_window() -> None:
    from collections import deque

    from hetroute.learning.live import _Backend

    prior = PriorModel(NEUTRAL_LEARNING_PRIOR.as_tuple(), "neutral", "neutral")
    b = _Backend(prior, deque(maxlen=8), deque(maxlen=DRIFT_WINDOW), deque(maxlen=8))
    rng = random.Random(5)
    for k in range(20 * DRIFT_WINDOW):
        residual = round(rng.gauss(0.0, 0.4), 1)  # rounded: many equal values, as ties must work
        b.add_residual(float(k), residual)
        assert len(b.ordered_residuals) == len(b.residuals) <= DRIFT_WINDOW
        assert b.median_residual() == statistics.median(r for _, r in b.residuals)
        if k % 97 == 96:
            b.clear_residuals()
            assert not b.ordered_residuals


def _composed_e2e_s(params: list[float], obs: Observation, cap: float, seqs: float) -> float:
    """predict_e2e_s as the composition of running_point and decode_point it writes out."""
    p = [float(v) for v in params]
    i = max(float(obs.input_tokens) - obs.cached_tokens, 0.0)
    ttft = p[0] * (obs.pending_tokens_ahead + i) + p[1] + p[2] * i + p[3]
    b0, length0 = running_point(obs, cap, seqs)
    if b0 > 0:
        ttft += _TTFT_DECODE_STEPS * max(p[4] * b0 * length0 + p[5] * b0 + p[6] * length0 + p[7], 0.0)
    b, length = decode_point(obs, cap, seqs)
    step = p[4] * b * length + p[5] * b + p[6] * length + p[7]
    return max(ttft, 0.0) + max(obs.output_tokens - 1, 0) * max(step, 0.0)


def test_the_written_out_e2e_prediction_equals_its_composition_bit_for_bit() -> None:
    rng = random.Random(11)

    def value(scale: float) -> float:
        choices = [0.0, 1.0, -10 * rng.random(), math.nan, scale * rng.random(), scale * rng.random()]
        return rng.choice(choices)

    for _ in range(20_000):
        obs = Observation(
            0,
            rng.random(),
            rng.choice([0, 1, rng.randint(0, 5000)]),
            rng.choice([0, 1, 2, rng.randint(0, 2000)]),
            None,
            rng.random(),
            value(5000),
            value(300),
            value(400_000),
            value(300),
            value(400_000),
            None if rng.random() < 0.4 else value(300),
            value(3000) if rng.random() < 0.3 else 0.0,
        )
        params = [rng.choice([0.0, -rng.random() * 1e-3, rng.random() * 1e-3]) for _ in range(8)]
        cap = rng.choice([math.inf, math.nan, 0.0, -5.0, 100.0, rng.random() * 1e6])
        seqs = rng.choice([0.5, 1.0, 256.0, rng.random() * 300])
        want = _composed_e2e_s(params, obs, cap, seqs)
        for given in (params, tuple(params)):  # a list is used as it is, anything else converted
            got = predict_e2e_s(given, obs, cap, seqs)
            assert got == want or (math.isnan(got) and math.isnan(want)), (params, obs, cap, seqs)


def test_a_limited_refit_takes_the_dirty_backends_in_turn_and_a_whole_pass_equals_one_refit() -> None:
    rng = random.Random(21)
    sliced, whole = _live(n=10), _live(n=10)
    for i in range(10):
        for obs in synthetic(TRUE, 40, rng):
            sliced.observe(obs._replace(backend_index=i))
            whole.observe(obs._replace(backend_index=i))
    assert sliced.dirty_backends() == 10
    fitted = []
    for _ in range(3):
        sliced.refit(10.0, limit=4)
        fitted.append([i for i in range(10) if sliced.fit_of(i) is not None])
    assert fitted == [[0, 1, 2, 3], list(range(8)), list(range(10))]
    assert sliced.dirty_backends() == 0
    whole.refit(10.0)
    assert sliced.params.tolist() == whole.params.tolist()  # the same fits, in slices
    # The next limited refit starts after the last backend fitted (9): 0 first, then 5, then 9.
    for i in (9, 5, 0):
        for obs in synthetic(TRUE, 3, rng, start_s=20.0):
            sliced.observe(obs._replace(backend_index=i))
    order = []
    for _ in range(3):
        before = {i: sliced.fit_of(i) for i in (0, 5, 9)}
        sliced.refit(30.0, limit=1)
        order += [i for i in (0, 5, 9) if sliced.fit_of(i) is not before[i]]
    assert order == [0, 5, 9] and sliced.dirty_backends() == 0


def test_the_hindsight_errors_are_the_noise_the_model_form_cannot_predict_away() -> None:
    """The same model form fitted to the judged observations themselves: near zero on noiseless
    requests however wrong the prior, about the noise on noisy ones, and over the last ``last`` only."""
    wrong = tuple(v * 3.0 for v in TRUE)
    exact = LiveModels(["b0"], [PriorModel(wrong, "wrong prior", "profile")], [CAP], [SEQS], LearningConfig())
    noisy = LiveModels(["b0"], [PriorModel(wrong, "wrong prior", "profile")], [CAP], [SEQS], LearningConfig())
    for obs in synthetic(TRUE, 300, random.Random(3), noise=0.0):
        exact.observe(obs)
    for obs in synthetic(TRUE, 300, random.Random(3), noise=0.2):
        noisy.observe(obs)
    assert len(exact.hindsight_e2e_errors(0, 200)) == 200
    assert statistics.median(exact.hindsight_e2e_errors(0, 200)) < 0.02  # the prior's pull: 0.7 %
    floor = statistics.median(noisy.hindsight_e2e_errors(0, 200))
    assert 0.02 < floor < 0.2
    # the learner's own errors were measured before each fit, starting from the ×3 prior
    assert statistics.median(noisy.recent_e2e_errors(0)) > floor


def test_each_request_is_judged_on_the_model_published_when_it_was_dispatched() -> None:
    """A request dispatched before a refit is judged on the model published before it (the prior
    here), one dispatched after on the refitted model: what routing priced each with."""
    live = _live()
    rows = synthetic(tuple(v * 2 for v in TRUE), 100, random.Random(4))  # finishing at 0-9.9 s
    for obs in rows[:99]:
        live.observe(obs)
    before = live.params[0].tolist()
    live.refit(now_s=20.0)
    after = live.params[0].tolist()
    last = rows[99]
    dispatched_before = last._replace(finished_at_s=20.0 + 0.5 * last.e2e_s)
    dispatched_after = last._replace(finished_at_s=20.0 + 2.0 * last.e2e_s)
    live.observe(dispatched_before)
    live.observe(dispatched_after)
    judged = live.recent_e2e_errors(0)[-2:]
    expected = [
        abs(predict_e2e_s(model, obs, CAP, SEQS) / obs.e2e_s - 1.0)
        for model, obs in ((before, dispatched_before), (after, dispatched_after))
    ]
    assert list(judged) == pytest.approx(expected)
    assert judged[0] > 0.4 > 0.1 > judged[1]  # the prior is 2× fast; the refit learned the speed


def test_the_hindsight_shift_is_how_much_slower_the_engine_ran_before_the_judged_requests() -> None:
    """The hindsight model of the last 200 requests applied to the 200 before them: log 1 when the
    engine kept its speed, log(1/1.5) when it ran 1.5× faster before."""
    rng = random.Random(9)
    steady, shifted = _live(), _live()
    for obs in synthetic(TRUE, 400, rng, noise=0.0):
        steady.observe(obs)
    slow = tuple(v * 1.5 for v in TRUE)
    for obs in synthetic(TRUE, 200, rng, noise=0.0) + synthetic(slow, 200, rng, start_s=20.0, noise=0.0):
        shifted.observe(obs)
    assert abs(steady.hindsight_shift(0, 200)) < 0.02
    assert shifted.hindsight_shift(0, 200) == pytest.approx(math.log(1 / 1.5), abs=0.03)
    assert math.isnan(_live().hindsight_shift(0, 200))  # nothing before the judged ones


def test_the_hindsight_shift_over_the_nearest_requests_before_sees_a_change_inside_a_window() -> None:
    """``before`` limits the comparison to the requests just before the last ``last``: an engine 1.5×
    slower for the 100 requests before the last 100 shows over those 100, and not in the median over
    all 300 before (200 of them at the judged speed)."""
    rng = random.Random(10)
    live = _live()
    slow = tuple(v * 1.5 for v in TRUE)
    rows = (
        synthetic(TRUE, 200, rng, noise=0.0)
        + synthetic(slow, 100, rng, start_s=20.0, noise=0.0)
        + synthetic(TRUE, 100, rng, start_s=30.0, noise=0.0)
    )
    for obs in rows:
        live.observe(obs)
    assert live.hindsight_shift(0, 100, before=100) == pytest.approx(math.log(1.5), abs=0.03)
    assert abs(live.hindsight_shift(0, 100)) < 0.03
    assert math.isnan(live.hindsight_shift(0, 100, before=0))
