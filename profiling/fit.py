"""Fitting the latency model p1..p8 to measured batches (method.md §3, paper Eq. 3 and 4).

Owns: the sample types, the design matrices of both phases, the bounded weighted least-squares
fit with standard errors, the batch-level held-out split and the held-out quality metrics.

    T_prefill(b, I)   = p1·b·I + p2·b + p3·I + p4
    T_decode(b, I, n) = p5·b·S + p6·b·n + p7·S + p8·n,   S = n·I + n(n+1)/2

``n`` is the number of decode steps a sample covers. A request that returns exactly O tokens gets its
first token from the prefill step, so a batch measured from its last first token to its last end covers
n = O − 1 decode steps (the collector records n, not O).

Invariants: every parameter is non-negative (each term is a cost: time per token, per sequence, per
KV token read, per step); the fit minimises *relative* squared error (rows weighted by 1/t) because the
router cares about percentage error and measured times span three orders of magnitude; gross outliers
among the training samples (> 50 % and > 5× the median off the fit, at most 10 %) are dropped and
counted; held-out batches never enter the fit whose quality they measure, and all of them are scored.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import least_squares, lsq_linear

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One batch's prefill: ``batch`` prompts of at most ``input_tokens`` tokens took ``time_s``."""

    batch: int
    input_tokens: int
    time_s: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One batch's decode phase: ``batch`` sequences ran ``steps`` decode steps after prefill."""

    batch: int
    input_tokens: int
    steps: int
    time_s: float


@dataclass(frozen=True, slots=True)
class BatchSample:
    """Both phases of one measured batch; ``config`` groups repeated batches of the same shape."""

    prefill: PrefillSample
    decode: DecodeSample | None
    shape: tuple[int, int, int] | None = None  # the requested (b, I, O); measured lengths may vary by a token

    @property
    def config(self) -> tuple[int, int, int]:
        if self.shape is not None:
            return self.shape
        steps = self.decode.steps if self.decode is not None else 0
        return (self.prefill.batch, self.prefill.input_tokens, steps)


@dataclass(frozen=True, slots=True)
class PhaseFit:
    """Four fitted coefficients of one phase, their standard errors and training residual stats."""

    coef: tuple[float, float, float, float]
    stderr: tuple[float, float, float, float]
    train_samples: int
    train_mape: float
    outliers_dropped: int = 0


@dataclass(frozen=True, slots=True)
class PhaseQuality:
    """Held-out quality of one phase: MAPE as a fraction and R² (NaN when undefined)."""

    mape: float
    r2: float
    samples: int


def prefill_design(samples: Sequence[PrefillSample]) -> FloatArray:
    """Rows [b·I, b, I, 1] of Eq. 3."""
    b = np.array([s.batch for s in samples], dtype=np.float64)
    i = np.array([s.input_tokens for s in samples], dtype=np.float64)
    return np.column_stack([b * i, b, i, np.ones_like(b)])


def decode_design(samples: Sequence[DecodeSample]) -> FloatArray:
    """Rows [b·S, b·n, S, n] of Eq. 4 with S = n·I + n(n+1)/2."""
    b = np.array([s.batch for s in samples], dtype=np.float64)
    i = np.array([s.input_tokens for s in samples], dtype=np.float64)
    n = np.array([s.steps for s in samples], dtype=np.float64)
    s = n * i + n * (n + 1.0) / 2.0
    return np.column_stack([b * s, b * n, s, n])


def _targets(samples: Sequence[PrefillSample] | Sequence[DecodeSample]) -> FloatArray:
    return np.array([s.time_s for s in samples], dtype=np.float64)


def fit_linear_nonneg(x: FloatArray, y: FloatArray) -> PhaseFit:
    """Minimise Σ((x·p − y)/y)² subject to p ≥ 0; standard errors from the weighted Jacobian.

    Columns are scaled to unit norm before solving (their magnitudes differ by up to 10⁶), which
    leaves the solution unchanged and keeps the solver well conditioned.
    """
    if x.shape[0] != y.shape[0] or x.shape[1] != 4:
        raise ValueError(f"design matrix {x.shape} does not match {y.shape[0]} targets")
    if x.shape[0] < 4:
        raise ValueError(f"need at least 4 samples to fit 4 parameters, got {x.shape[0]}")
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("every measured time must be finite and positive")
    w = 1.0 / y
    xw = x * w[:, None]
    yw = y * w
    scale = np.linalg.norm(xw, axis=0)
    scale[scale == 0] = 1.0
    res = lsq_linear(xw / scale, yw, bounds=(0.0, np.inf), method="bvls")
    coef = np.asarray(res.x, dtype=np.float64) / scale
    resid = yw - xw @ coef
    dof = max(1, x.shape[0] - 4)
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(xw.T @ xw)
    stderr = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    c = tuple(float(v) for v in coef)
    e = tuple(float(v) for v in stderr)
    return PhaseFit(
        coef=(c[0], c[1], c[2], c[3]),
        stderr=(e[0], e[1], e[2], e[3]),
        train_samples=int(x.shape[0]),
        train_mape=float(np.mean(np.abs(resid))),
    )


OUTLIER_MIN_REL = 0.5  # a training sample is an outlier only if more than 50 % off the fit ...
OUTLIER_MEDIAN_FACTOR = 5.0  # ... and more than 5× the median relative residual
OUTLIER_MAX_SHARE = 0.1  # and at most 10 % of the training samples are ever dropped


def _robust_coef(x: FloatArray, y: FloatArray) -> FloatArray:
    """Coefficients that ignore gross outliers: a Cauchy-loss fit of the relative residuals (p ≥ 0),
    started from the absolute-error fit, which a sample near zero time cannot drag."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    start = np.asarray(lsq_linear(xs, y, bounds=(0.0, np.inf), method="bvls").x, dtype=np.float64)
    xr = xs / y[:, None]
    res = least_squares(
        lambda p: xr @ p - 1.0, np.maximum(start, 1e-12), bounds=(0.0, np.inf), loss="cauchy", f_scale=0.05
    )
    coef: FloatArray = np.asarray(res.x, dtype=np.float64) / scale
    return coef


def fit_robust(x: FloatArray, y: FloatArray) -> PhaseFit:
    """:func:`fit_linear_nonneg` on the samples that are not gross measurement outliers.

    Relative residuals are taken from a robust fit (:func:`_robust_coef`); a sample off by more than both
    ``OUTLIER_MIN_REL`` and ``OUTLIER_MEDIAN_FACTOR`` × the median is dropped (the worst first, at most
    ``OUTLIER_MAX_SHARE`` of the samples). A client stalled by the host's scheduler reads a whole stream at
    once: its decode time collapses to ~0 and, weighted by 1/t, would otherwise pull every parameter to 0.
    """
    first = fit_linear_nonneg(x, y)  # validates the inputs
    rel = np.abs(x @ _robust_coef(x, y) - y) / y
    limit = max(OUTLIER_MIN_REL, OUTLIER_MEDIAN_FACTOR * float(np.median(rel)))
    bad = np.flatnonzero(rel > limit)
    budget = min(int(OUTLIER_MAX_SHARE * y.shape[0]), y.shape[0] - 4)
    if bad.size == 0 or budget <= 0:
        return first
    worst = bad[np.argsort(rel[bad])[::-1][:budget]]
    keep = np.ones(y.shape[0], dtype=bool)
    keep[worst] = False
    fit = fit_linear_nonneg(x[keep], y[keep])
    return PhaseFit(fit.coef, fit.stderr, fit.train_samples, fit.train_mape, outliers_dropped=int(worst.size))


def fit_prefill(samples: Sequence[PrefillSample]) -> PhaseFit:
    """p1..p4 from prefill samples."""
    return fit_robust(prefill_design(samples), _targets(samples))


def fit_decode(samples: Sequence[DecodeSample]) -> PhaseFit:
    """p5..p8 from decode samples."""
    return fit_robust(decode_design(samples), _targets(samples))


def predict(x: FloatArray, coef: Sequence[float]) -> FloatArray:
    return np.asarray(x @ np.asarray(coef, dtype=np.float64), dtype=np.float64)


def quality(measured: FloatArray, predicted: FloatArray) -> PhaseQuality:
    """MAPE (fraction) and R² of predictions; R² is NaN when the measurements have no variance."""
    n = int(measured.shape[0])
    if n == 0:
        return PhaseQuality(mape=float("nan"), r2=float("nan"), samples=0)
    mape = float(np.mean(np.abs(predicted - measured) / measured))
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    ss_res = float(np.sum((measured - predicted) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    return PhaseQuality(mape=mape, r2=r2, samples=n)


def split_heldout(
    batches: Sequence[BatchSample], heldout_frac: float, rng: random.Random
) -> tuple[list[BatchSample], list[BatchSample]]:
    """Split whole batches into (train, held-out).

    Within each group of repeated batches of one shape, round(frac·n) are held out but never the whole
    group, so every measured shape is in the training set. When that holds out fewer than
    round(frac·N) of all N batches (shapes measured only twice, e.g. the budget ran out in the last
    round of repeats: round(0.25·2) is 0), spare repeats are added, one per shape in random order and
    again while any shape has one, never a shape's last. When no shape was measured twice a random
    ``frac`` share of all batches is held out, keeping at least 4 for training.
    """
    if not 0.0 <= heldout_frac < 1.0:
        raise ValueError(f"heldout_frac must be in [0, 1), got {heldout_frac}")
    groups: dict[tuple[int, int, int], list[int]] = {}
    for idx, batch in enumerate(batches):
        groups.setdefault(batch.config, []).append(idx)
    held: set[int] = set()
    for key in sorted(groups):
        members = groups[key]
        k = min(len(members) - 1, round(heldout_frac * len(members)))
        held.update(rng.sample(members, k) if k > 0 else [])
    target = round(heldout_frac * len(batches))
    if len(held) < target:
        spares = [[i for i in members if i not in held][1:] for _, members in sorted(groups.items())]
        rng.shuffle(spares)
        while len(held) < target and any(spares):
            for spare in spares:
                if spare and len(held) < target:
                    held.add(spare.pop(rng.randrange(len(spare))))
    if not held and heldout_frac > 0 and len(batches) > 4:
        k = min(len(batches) - 4, max(1, round(heldout_frac * len(batches))))
        held.update(rng.sample(range(len(batches)), k))
    train = [b for i, b in enumerate(batches) if i not in held]
    test = [b for i, b in enumerate(batches) if i in held]
    return train, test


@dataclass(frozen=True, slots=True)
class FitResult:
    """Both phases fitted on the training batches and scored on the held-out ones."""

    prefill: PhaseFit
    decode: PhaseFit
    prefill_heldout: PhaseQuality
    decode_heldout: PhaseQuality
    train: tuple[BatchSample, ...]
    heldout: tuple[BatchSample, ...]

    @property
    def train_batches(self) -> int:
        return len(self.train)

    @property
    def heldout_batches(self) -> int:
        return len(self.heldout)

    @property
    def params(self) -> tuple[float, ...]:
        return self.prefill.coef + self.decode.coef

    @property
    def stderr(self) -> tuple[float, ...]:
        return self.prefill.stderr + self.decode.stderr

    @property
    def worst_mape(self) -> float:
        """The larger held-out MAPE of the two phases (NaN when nothing was held out)."""
        return max(self.prefill_heldout.mape, self.decode_heldout.mape)


def fit_batches(batches: Sequence[BatchSample], heldout_frac: float, rng: random.Random) -> FitResult:
    """Split, fit both phases on the training batches, score both on the held-out batches."""
    train, test = split_heldout(batches, heldout_frac, rng)
    pre_train = [b.prefill for b in train]
    dec_train = [b.decode for b in train if b.decode is not None]
    pre = fit_prefill(pre_train)
    dec = fit_decode(dec_train)
    pre_test = [b.prefill for b in test]
    dec_test = [b.decode for b in test if b.decode is not None]
    pre_q = quality(_targets(pre_test), predict(prefill_design(pre_test), pre.coef)) if pre_test else None
    dec_q = quality(_targets(dec_test), predict(decode_design(dec_test), dec.coef)) if dec_test else None
    empty = PhaseQuality(mape=float("nan"), r2=float("nan"), samples=0)
    return FitResult(
        prefill=pre,
        decode=dec,
        prefill_heldout=pre_q or empty,
        decode_heldout=dec_q or empty,
        train=tuple(train),
        heldout=tuple(test),
    )
