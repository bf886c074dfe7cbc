"""The regularised, robust fit of one backend's latency model to live observations.

Reduced form. From what the router sees of a finished request (see ``observation.py``) the data
identifies seven numbers, ``θ = (p1, p3, c, p5, p6, p7, p8)`` with ``c = p2 + p4``:

    TTFT_r ≈ p1·(P_r + I_r) + p3·I_r + c              T_prefill (method.md §3, Eq. 3) of r batched with
                                                       the P_r prompt tokens queued ahead of it
    TPOT_r ≈ p5·b̄_r·L̄_r + p6·b̄_r + p7·L̄_r + p8       τ_decode at the mean batch b̄ and mean context L̄
                                                       of r's decode
    e2e_r  ≈ TTFT_r + (O_r − 1)·TPOT_r                 a non-streaming answer shows only the sum

``p2`` (the per-prompt cost inside one prefill batch) is not identifiable apart from ``p4``: the router
never sees how many prompts the engine put in one prefill step, only the tokens queued ahead. It keeps
its prior value and ``c`` absorbs the rest (``p4 = c − p2_prior``). ``b̄`` is the mean of the router's
in-flight count on the backend at r's first token and at its end, capped by what fits in the KV cache
(``cap / L̄``) and by ``max_num_seqs``; ``L̄`` is the mean context per in-flight request at those two
instants.

The fit minimises relative error (each row is divided by its target, so a 50 ms TTFT counts as much
as a 5 s one) with

- a decaying window: row weight ``max(0.5^(age/half_life), floor)``, and rows older than the last
  detected drift multiplied by ``stale_weight``;
- robustness: three rounds of Huber re-weighting at 1.5 σ, σ = 1.4826·MAD of the relative residuals
  (at least 5 %);
- an anchor on the prior: ``λ · Σ_k (s_k·(θ_k − θ0_k))²``, ``s_k`` the weighted RMS of column k of the
  relative design, so the penalty is in the rows' own units (λ = ``prior_strength`` pseudo-rows). With
  little evidence θ stays at the prior; as weighted rows accumulate the data takes over. A direction
  the data does not excite (say p1 against p3 while nothing ever queues) stays at the prior;
- bounds ``θ_k ≥ min(0, θ0_k)``, so a fitted step never turns negative where the prior was positive.

Uncertainty is the diagonal of ``σ²·(AᵀA)⁻¹`` of the final weighted, augmented design, in the
parameters' own units. Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import lsq_linear

from hetroute.learning.observation import Observation
from hetroute.types import FloatArray

THETA_NAMES = ("p1", "p3", "c", "p5", "p6", "p7", "p8")
"""The identifiable parameters, in column order (``c = p2 + p4``)."""

_MIN_TARGET_S = 1e-4
_HUBER_K = 1.5
_MIN_SIGMA = 0.05
_IRLS_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class FitSettings:
    """How observations are weighted and how hard the prior pulls (see the module docstring)."""

    half_life_s: float = 30.0
    weight_floor: float = 0.02
    prior_strength: float = 8.0
    stale_weight: float = 0.05


@dataclass(frozen=True, slots=True)
class FitResult:
    """p1..p8 (prior ``p2`` kept), their standard errors (p2's is 0) and the fit's evidence."""

    params: tuple[float, ...]
    stderr: tuple[float, ...]
    samples: int
    effective_samples: float
    ttft_mape: float
    tpot_mape: float
    e2e_mape: float


def theta_of(params: Sequence[float]) -> FloatArray:
    """θ from p1..p8: (p1, p3, p2 + p4, p5, p6, p7, p8)."""
    p = [float(v) for v in params]
    return np.array([p[0], p[2], p[1] + p[3], p[4], p[5], p[6], p[7]], dtype=np.float64)


def params_of(theta: FloatArray, p2: float) -> tuple[float, ...]:
    """p1..p8 from θ with ``p2`` given: p4 = c − p2."""
    t = [float(v) for v in theta]
    return (t[0], p2, t[1], t[2] - p2, t[3], t[4], t[5], t[6])


def decode_point(obs: Observation, capacity_tokens: float, max_num_seqs: float) -> tuple[float, float]:
    """(b̄, L̄) of r's decode: mean batch (KV- and seq-capped) and mean context per sequence."""
    n1 = max(obs.in_flight_at_first, 1.0)
    n2 = max(obs.in_flight_at_end, 1.0)
    context = 0.5 * (obs.context_at_first / n1 + obs.context_at_end / n2)
    context = max(context, float(obs.input_tokens))
    batch = 0.5 * (n1 + n2)
    if math.isfinite(capacity_tokens) and capacity_tokens > 0:
        batch = min(batch, max(1.0, capacity_tokens / max(context, 1.0)))
    return max(1.0, min(batch, max_num_seqs)), context


def _rows(
    observations: Sequence[Observation], capacity_tokens: float, max_num_seqs: float
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """(design X, target y, kind (0 TTFT, 1 TPOT, 2 e2e), time) — one or two rows per observation."""
    xs: list[list[float]] = []
    ys: list[float] = []
    kinds: list[int] = []
    times: list[float] = []
    for obs in observations:
        i = float(obs.input_tokens)
        pre = [obs.pending_tokens_ahead + i, i, 1.0]
        b, length = decode_point(obs, capacity_tokens, max_num_seqs)
        dec = [b * length, b, length, 1.0]
        steps = max(obs.output_tokens - 1, 0)
        decode_s = obs.decode_s
        if obs.ttft_s is not None and decode_s is not None:
            xs.append([*pre, 0.0, 0.0, 0.0, 0.0])
            ys.append(obs.ttft_s)
            kinds.append(0)
            times.append(obs.finished_at_s)
            if steps >= 1 and decode_s > 0:
                xs.append([0.0, 0.0, 0.0, *dec])
                ys.append(decode_s / steps)
                kinds.append(1)
                times.append(obs.finished_at_s)
        else:
            xs.append([*pre, *(steps * v for v in dec)])
            ys.append(obs.e2e_s)
            kinds.append(2)
            times.append(obs.finished_at_s)
    x = np.array(xs, dtype=np.float64).reshape(len(xs), len(THETA_NAMES))
    y = np.maximum(np.array(ys, dtype=np.float64), _MIN_TARGET_S)
    return x, y, np.array(kinds, dtype=np.float64), np.array(times, dtype=np.float64)


def _mape(rel: FloatArray, kinds: FloatArray, kind: int) -> float:
    chosen = np.abs(rel[kinds == kind])
    return float(chosen.mean()) if chosen.size else math.nan


def fit_backend(
    observations: Sequence[Observation],
    prior_params: Sequence[float],
    *,
    now_s: float,
    capacity_tokens: float,
    max_num_seqs: float,
    settings: FitSettings,
    regime_start_s: float = -math.inf,
) -> FitResult:
    """Fit p1..p8 to ``observations``, anchored on ``prior_params`` (the module docstring's method).

    With no usable row the prior comes back unchanged with zero samples.
    """
    prior = [float(v) for v in prior_params]
    theta0 = theta_of(prior)
    x, y, kinds, times = _rows(observations, capacity_tokens, max_num_seqs)
    if y.size == 0:
        return FitResult(tuple(prior), (0.0,) * 8, 0, 0.0, math.nan, math.nan, math.nan)
    age = np.maximum(now_s - times, 0.0)
    decay = np.maximum(0.5 ** (age / settings.half_life_s), settings.weight_floor)
    decay = np.where(times < regime_start_s, decay * settings.stale_weight, decay)
    xr = x / y[:, None]
    scale = np.sqrt(np.average(xr**2, axis=0, weights=decay))
    scale = np.maximum(scale, 1e-3 * max(float(scale.max()), 1e-12))
    lam = math.sqrt(settings.prior_strength)
    lower = np.minimum(theta0, 0.0)
    upper = np.full_like(theta0, np.inf)
    huber = np.ones_like(y)
    theta = theta0
    sigma = _MIN_SIGMA
    a = np.zeros((0, len(THETA_NAMES)))
    for _ in range(_IRLS_ROUNDS):
        w = np.sqrt(decay * huber)
        a = np.vstack([xr * w[:, None], lam * np.diag(scale)])
        rhs = np.concatenate([w, lam * scale * theta0])
        theta = np.asarray(lsq_linear(a, rhs, bounds=(lower, upper), method="bvls").x, dtype=np.float64)
        rel = xr @ theta - 1.0
        mad = float(np.median(np.abs(rel - np.median(rel))))
        sigma = max(1.4826 * mad, _MIN_SIGMA)
        huber = np.minimum(1.0, _HUBER_K * sigma / np.maximum(np.abs(rel), 1e-12))
    try:
        cov = np.linalg.inv(a.T @ a) * sigma**2
        err = np.sqrt(np.maximum(np.diag(cov), 0.0))
    except np.linalg.LinAlgError:
        err = np.full(len(THETA_NAMES), np.inf)
    rel = xr @ theta - 1.0
    stderr = (float(err[0]), 0.0, float(err[1]), float(err[2]), *(float(v) for v in err[3:]))
    return FitResult(
        params=params_of(theta, prior[1]),
        stderr=stderr,
        samples=len(observations),
        effective_samples=float(decay.sum()),
        ttft_mape=_mape(rel, kinds, 0),
        tpot_mape=_mape(rel, kinds, 1),
        e2e_mape=_mape(rel, kinds, 2),
    )


def predict_e2e_s(
    params: Sequence[float], obs: Observation, capacity_tokens: float, max_num_seqs: float
) -> float:
    """The model's e2e for ``obs`` under the load it met: TTFT_r + (O − 1)·TPOT_r (module docstring)."""
    p = [float(v) for v in params]
    i = float(obs.input_tokens)
    ttft = p[0] * (obs.pending_tokens_ahead + i) + p[1] + p[2] * i + p[3]
    b, length = decode_point(obs, capacity_tokens, max_num_seqs)
    step = p[4] * b * length + p[5] * b + p[6] * length + p[7]
    return max(ttft, 0.0) + max(obs.output_tokens - 1, 0) * max(step, 0.0)
