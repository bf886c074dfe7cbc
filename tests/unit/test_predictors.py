"""Output-length predictors: clamping, seeding, learning, fallbacks and config errors."""

from __future__ import annotations

import numpy as np
import pytest

from hetroute.errors import ConfigError
from hetroute.output_limits import output_cut, output_limit
from predictors import (
    DEFAULT_PREDICTOR,
    PREDICTORS,
    MeanPredictor,
    NormalPredictor,
    OnlineQuantilePredictor,
    build_predictor,
)


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_every_prediction_is_clamped_to_max_tokens_and_at_least_one(name: str) -> None:
    predictor = build_predictor(name, {}, seed=3)
    for output in (5, 900, 1500, 2000):
        predictor.observe("m", 100, output)
    for max_tokens in (1, 7, 64, None):
        for input_tokens in (1, 100, 5000):
            values = [predictor.predict("m", input_tokens, max_tokens) for _ in range(50)]
            assert min(values) >= 1
            if max_tokens is not None:
                assert max(values) <= max_tokens


def test_normal_is_reproducible_per_seed_and_matches_its_distribution() -> None:
    a = NormalPredictor(200.0, 50.0, seed=7)
    b = NormalPredictor(200.0, 50.0, seed=7)
    c = NormalPredictor(200.0, 50.0, seed=8)
    seq_a = [a.predict("m", 10, None) for _ in range(2000)]
    seq_b = [b.predict("m", 10, None) for _ in range(2000)]
    seq_c = [c.predict("m", 10, None) for _ in range(2000)]
    assert seq_a == seq_b
    assert seq_a != seq_c
    assert abs(float(np.mean(seq_a)) - 200.0) < 5.0
    assert abs(float(np.std(seq_a)) - 50.0) < 5.0


def test_normal_with_zero_std_is_the_mean_and_ignores_observations() -> None:
    p = NormalPredictor(123.4, 0.0, seed=1)
    p.observe("m", 10, 5)
    assert {p.predict("m", 10, None) for _ in range(10)} == {123}


def test_normal_draws_below_one_are_clamped_to_one() -> None:
    p = NormalPredictor(1.0, 100.0, seed=2)
    values = [p.predict("m", 10, None) for _ in range(500)]
    assert min(values) == 1
    assert sum(v == 1 for v in values) > 200  # about half the draws are <= 1


def test_mean_uses_prior_until_min_samples_then_running_mean_per_model() -> None:
    p = MeanPredictor(200.0, min_samples=3)
    p.observe("a", 10, 10)
    p.observe("a", 10, 20)
    assert p.predict("a", 10, None) == 200
    p.observe("a", 10, 60)
    assert p.predict("a", 10, None) == 30
    assert p.predict("b", 10, None) == 200  # another model keeps the prior
    assert p.predict("a", 10, 25) == 25


def test_mean_without_learning_is_fixed() -> None:
    p = build_predictor("mean", {"mean_tokens": 77, "learn": False}, seed=0)
    for _ in range(50):
        p.observe("a", 10, 1000)
    assert p.predict("a", 10, None) == 77


def test_online_learns_a_quantile_per_input_bucket() -> None:
    p = OnlineQuantilePredictor(quantile=0.5, window=100, min_samples=5, bucket_edges=(100, 1000))
    for out in (10, 20, 30, 40, 50):
        p.observe("m", 50, out)  # bucket 0
    for out in (500, 600, 700, 800, 900):
        p.observe("m", 2000, out)  # bucket 2
    assert p.predict("m", 10, None) == 30
    assert p.predict("m", 5000, None) == 700
    # bucket 1 (100..999) has no data: falls back to the model-wide median of all ten outputs
    value, source = p.estimate("m", 500)
    assert source == "model"
    assert value == pytest.approx(float(np.median([10, 20, 30, 40, 50, 500, 600, 700, 800, 900])))
    # unknown model: the prior
    assert p.estimate("other", 500) == (200.0, "prior")


def test_online_higher_quantile_predicts_more() -> None:
    low = OnlineQuantilePredictor(quantile=0.5, min_samples=1)
    high = OnlineQuantilePredictor(quantile=0.9, min_samples=1)
    for out in range(1, 101):
        low.observe("m", 10, out)
        high.observe("m", 10, out)
    assert low.predict("m", 10, None) == 50  # np.quantile(1..100, 0.5) = 50.5 → 50 (banker's rounding)
    assert high.predict("m", 10, None) == 90  # 90.1 → 90


def test_online_mean_statistic_is_unbiased_in_sum_on_skewed_outputs() -> None:
    p = build_predictor("online", {"statistic": "mean", "min_samples": 1}, seed=0)
    q = build_predictor("online", {"min_samples": 1}, seed=0)
    for out in (10, 10, 10, 10, 460):  # mean 100, median 10
        p.observe("m", 10, out)
        q.observe("m", 10, out)
    assert p.predict("m", 10, None) == 100
    assert q.predict("m", 10, None) == 10


def test_online_window_forgets_old_outputs() -> None:
    p = OnlineQuantilePredictor(window=10, min_samples=10)
    for _ in range(10):
        p.observe("m", 10, 1000)
    assert p.predict("m", 10, None) == 1000
    for _ in range(10):
        p.observe("m", 10, 3)
    assert p.predict("m", 10, None) == 3


def test_online_ignores_negative_observations() -> None:
    p = OnlineQuantilePredictor(min_samples=1)
    p.observe("m", 10, -5)
    assert p.estimate("m", 10) == (200.0, "prior")


def test_the_output_limit_is_max_tokens_and_what_the_context_window_leaves() -> None:
    assert output_limit(None, None, 500) is None  # nothing known: no limit
    assert output_limit(64, None, 500) == 64
    assert output_limit(None, 8192, 8000) == 192
    assert output_limit(100, 8192, 8000) == 100
    assert output_limit(500, 8192, 8000) == 192
    assert output_limit(None, 8192, 8191) == 1
    assert output_limit(None, 8192, 9000) == 1  # an over-long estimate still leaves one token


def test_an_output_is_cut_only_when_it_fills_the_context_window() -> None:
    assert output_cut(8192, 8191, 1)
    assert output_cut(8192, 8000, 192)
    assert not output_cut(8192, 8000, 191)
    assert not output_cut(None, 8191, 100_000)  # window unknown: never cut


def test_online_does_not_learn_cut_outputs_below_its_estimate() -> None:
    """The Mooncake case (docs/prefix.md, "Cut outputs"): prompts that fill the window end after one
    token. Learned as is, they pull the bucket's median to 1 for every prompt of that length."""
    cut_aware = OnlineQuantilePredictor(min_samples=5, bucket_edges=(4096, 8192))
    naive = OnlineQuantilePredictor(min_samples=5, bucket_edges=(4096, 8192))
    for k in range(40):
        for p in (cut_aware, naive):
            p.observe("m", 5000 + k, 300 + k)  # not cut
    for _ in range(60):
        cut_aware.observe("m", 8191, 1, cut=True)
        naive.observe("m", 8191, 1)
    assert naive.predict("m", 5000, None) == 1
    assert cut_aware.predict("m", 5000, None) == 320  # the median of 300..339 (319.5, rounded to even)
    assert cut_aware.predict("m", 8191, output_limit(None, 8192, 8191)) == 1  # the caller's clamp


def test_online_learns_cut_outputs_at_or_above_its_estimate() -> None:
    """A cut output above the estimate lies on the same side of the quantile as the true length: learned."""
    p = OnlineQuantilePredictor(min_samples=5)
    for _ in range(5):
        p.observe("m", 50, 100)
    for _ in range(20):
        p.observe("m", 50, 256, cut=True)  # the window was full after 256: at least 256 wanted
    assert p.predict("m", 50, None) == 256
    q = OnlineQuantilePredictor(min_samples=5)
    for _ in range(20):
        q.observe("m", 50, 16, cut=True)  # below the prior (200): dropped, the prior stays
    assert q.estimate("m", 50) == (200.0, "prior")


def test_mean_does_not_learn_cut_outputs_below_its_mean() -> None:
    p = MeanPredictor(200.0, min_samples=2)
    p.observe("a", 10, 100)
    p.observe("a", 10, 300)
    p.observe("a", 10, 5, cut=True)  # below the mean of 200: dropped
    assert p.predict("a", 10, None) == 200
    p.observe("a", 10, 500, cut=True)  # above it: learned
    assert p.predict("a", 10, None) == 300


def test_default_is_registered_and_the_alias_builds_it() -> None:
    assert DEFAULT_PREDICTOR in PREDICTORS
    assert build_predictor("default", {}, seed=0).name == DEFAULT_PREDICTOR


@pytest.mark.parametrize(
    ("name", "params", "path"),
    [
        ("nope", {}, "predictor.type"),
        ("normal", {"mean": 3}, "predictor.params.mean"),
        ("normal", {"std_tokens": -1}, "predictor.params.std_tokens"),
        ("normal", {"mean_tokens": "x"}, "predictor.params.mean_tokens"),
        ("mean", {"learn": 1}, "predictor.params.learn"),
        ("mean", {"min_samples": 0}, "predictor.params.min_samples"),
        ("online", {"quantile": 1.0}, "predictor.params.quantile"),
        ("online", {"quantile": 0}, "predictor.params.quantile"),
        ("online", {"window": 5, "min_samples": 6}, "predictor.params.min_samples"),
        ("online", {"bucket_edges": [10, 5]}, "predictor.params.bucket_edges[1]"),
        ("online", {"bucket_edges": []}, "predictor.params.bucket_edges"),
        ("online", {"prior_tokens": float("nan")}, "predictor.params.prior_tokens"),
        ("online", {"statistic": "median"}, "predictor.params.statistic"),
    ],
)
def test_config_errors_name_the_field(name: str, params: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_predictor(name, params, seed=0)
    assert info.value.path == path
