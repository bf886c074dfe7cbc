"""The fitter recovers known latency parameters from noisy synthetic batches (method.md §3)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hetroute.latency import LatencyParams
from profiling.fit import (
    BatchSample,
    DecodeSample,
    PrefillSample,
    fit_batches,
    fit_decode,
    fit_prefill,
    quality,
    split_heldout,
)

TRUE = LatencyParams(p1=2.0e-6, p2=1.5e-3, p3=6.0e-5, p4=0.012, p5=1.0e-8, p6=2.0e-4, p7=3.0e-7, p8=0.018)


def synthetic(noise: float, seed: int, reps: int = 4) -> list[BatchSample]:
    rng = np.random.default_rng(seed)
    out: list[BatchSample] = []
    for b in (1, 2, 4, 8, 16, 32):
        for i in (64, 256, 1024):
            for o in (64, 128):
                for _ in range(reps):
                    n = o - 1
                    t_pre = TRUE.prefill_s(b, i) * (1.0 + noise * rng.standard_normal())
                    t_dec = TRUE.decode_s(b, i, n) * (1.0 + noise * rng.standard_normal())
                    out.append(
                        BatchSample(
                            prefill=PrefillSample(batch=b, input_tokens=i, time_s=t_pre),
                            decode=DecodeSample(batch=b, input_tokens=i, steps=n, time_s=t_dec),
                        )
                    )
    return out


def test_exact_data_recovers_every_parameter() -> None:
    batches = synthetic(noise=0.0, seed=0, reps=1)
    pre = fit_prefill([b.prefill for b in batches])
    dec = fit_decode([b.decode for b in batches if b.decode is not None])
    fitted = pre.coef + dec.coef
    assert fitted == pytest.approx(TRUE.as_tuple(), rel=1e-6)
    assert pre.train_mape < 1e-9 and dec.train_mape < 1e-9


def test_noisy_data_recovers_parameters_within_their_stderr_and_predicts_heldout() -> None:
    batches = synthetic(noise=0.02, seed=7)
    result = fit_batches(batches, heldout_frac=0.25, rng=random.Random(3))
    assert result.heldout_batches == 36  # 1 of each group of 4 reps
    assert result.train_batches == len(batches) - 36
    for fitted, err, true in zip(result.params, result.stderr, TRUE.as_tuple(), strict=True):
        assert err > 0
        assert abs(fitted - true) < 5 * err + 0.1 * true
    # The big terms are pinned tightly.
    for k in (0, 1, 3, 4, 5, 7):
        assert result.params[k] == pytest.approx(TRUE.as_tuple()[k], rel=0.1)
    # 2 % multiplicative noise gives ~1.6 % MAPE on held-out batches.
    assert 0.005 < result.prefill_heldout.mape < 0.03
    assert 0.005 < result.decode_heldout.mape < 0.03
    assert result.prefill_heldout.r2 > 0.99 and result.decode_heldout.r2 > 0.99


def test_parameters_stay_non_negative_when_a_term_is_absent() -> None:
    # Data generated with p3 = p7 = 0 and noise must not produce negative coefficients.
    rng = np.random.default_rng(1)
    zero = LatencyParams(2e-7, 1e-3, 0.0, 0.01, 1e-8, 2e-4, 0.0, 0.02)
    pre = [
        PrefillSample(b, i, zero.prefill_s(b, i) * (1 + 0.03 * rng.standard_normal()))
        for b in (1, 2, 4, 8)
        for i in (32, 128, 512)
        for _ in range(3)
    ]
    dec = [
        DecodeSample(b, i, 63, zero.decode_s(b, i, 63) * (1 + 0.03 * rng.standard_normal()))
        for b in (1, 2, 4, 8)
        for i in (32, 128, 512)
        for _ in range(3)
    ]
    assert min(fit_prefill(pre).coef) >= 0.0
    assert min(fit_decode(dec).coef) >= 0.0


def test_heldout_split_keeps_every_shape_in_training() -> None:
    batches = synthetic(noise=0.0, seed=0, reps=3)
    train, test = split_heldout(batches, 0.3, random.Random(0))
    assert len(test) == 36  # round(0.9) = 1 of each of 36 groups
    assert {b.config for b in train} == {b.config for b in batches}
    assert not {id(b) for b in train} & {id(b) for b in test}


def test_heldout_split_of_shapes_measured_twice_holds_out_the_fraction_one_per_shape() -> None:
    """round(0.25·2) is 0 per shape: the split tops up to round(0.25·72) = 18 spare repeats."""
    batches = synthetic(noise=0.0, seed=0, reps=2)
    train, test = split_heldout(batches, 0.25, random.Random(0))
    assert len(test) == 18 and len(train) == 54
    assert len({b.config for b in test}) == 18  # one per shape
    assert {b.config for b in train} == {b.config for b in batches}
    mixed = synthetic(noise=0.0, seed=0, reps=3)[:30] + synthetic(noise=0.0, seed=1, reps=2)[24:]
    train, test = split_heldout(mixed, 0.25, random.Random(1))
    assert len(test) == round(0.25 * len(mixed))
    assert {b.config for b in train} == {b.config for b in mixed}


def test_heldout_split_falls_back_to_random_when_each_shape_was_measured_once() -> None:
    batches = synthetic(noise=0.0, seed=0, reps=1)
    train, test = split_heldout(batches, 0.25, random.Random(0))
    assert len(test) == 9 and len(train) == 27


def test_quality_metrics() -> None:
    q = quality(np.array([1.0, 2.0, 4.0]), np.array([1.1, 2.0, 3.6]))
    assert q.mape == pytest.approx((0.1 + 0.0 + 0.1) / 3)
    assert q.r2 == pytest.approx(1 - (0.01 + 0.16) / (np.var([1.0, 2.0, 4.0]) * 3))
    assert q.samples == 3


def test_rejects_too_few_or_non_positive_samples() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        fit_prefill([PrefillSample(1, 10, 0.1)] * 3)
    with pytest.raises(ValueError, match="positive"):
        fit_prefill([PrefillSample(1, 10, 0.1)] * 4 + [PrefillSample(2, 10, 0.0)])


def test_a_stalled_client_sample_does_not_drag_the_fit_to_zero() -> None:
    # A stream read all at once after a scheduler stall: decode time ~1 ms instead of ~0.5 s.
    batches = synthetic(noise=0.01, seed=3, reps=1)
    dec = [b.decode for b in batches if b.decode is not None]
    dec[5] = DecodeSample(dec[5].batch, dec[5].input_tokens, dec[5].steps, 1e-3)
    robust = fit_decode(dec)
    assert robust.outliers_dropped == 1
    assert robust.coef[1] == pytest.approx(TRUE.p6, rel=0.1) and robust.coef[3] == pytest.approx(
        TRUE.p8, rel=0.1
    )
    clean = fit_decode([b.decode for b in synthetic(noise=0.01, seed=3, reps=1) if b.decode is not None])
    assert clean.outliers_dropped == 0


def test_outlier_trimming_never_drops_more_than_a_tenth() -> None:
    rng = np.random.default_rng(2)
    pre = [
        PrefillSample(b, i, TRUE.prefill_s(b, i) * (1 + 3.0 * rng.random()))
        for b in (1, 2, 4, 8)
        for i in (128, 512, 1024)
        for _ in range(3)
    ]
    assert fit_prefill(pre).outliers_dropped <= 3  # 10 % of 36
