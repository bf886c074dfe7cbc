"""The regularised, robust fit of one backend's latency model to live observations.

Reduced form. From what the router sees of a finished request (see ``observation.py``) the data
identifies ``θ = (α, β, d5, d6, d7, d8)``, with the decode curve ``p_k = β·p_k⁰ + d_k`` (k = 5..8):

    TTFT_r ≈ α·T⁰_prefill(P_r + I_r, I_r)             the prior's prefill curve (method.md §3, Eq. 3) for
             + τ_decode(L̄₀, b₀)                       r batched with the P_r prompt tokens queued ahead of
                                                       it, scaled by α; plus one decode step of the b₀
                                                       requests already running: the step that prefills r
                                                       also decodes them (continuous batching). Half a step
                                                       more for the step r arrives during would be the
                                                       additive count; prefill and decode overlap inside
                                                       a step, and 1 fitted the emulator better than 1.5
    TPOT_r ≈ τ_decode(L̄_r, b̄_r)                       τ_decode = p5·b·L + p6·b + p7·L + p8 at the mean
                                                       batch b̄ and mean context L̄ of r's decode
    e2e_r  ≈ TTFT_r + (O_r − 1)·TPOT_r                 a non-streaming answer shows only the sum

with ``T⁰_prefill(B, I) = p1⁰·B + p3⁰·I + p2⁰ + p4⁰`` (B prompt tokens in the batch). Why this form:

- Prefill only as a scale of the prior's curve: a TTFT seen at the router mixes the prefill itself,
  the queue ahead of it and the decode steps it shares, and the router never sees how the engine
  grouped prompts into prefill steps, so the split of prefill cost between p1 (per batched token),
  p2 (per prompt), p3 and p4 is not identifiable from live traffic; its level is. Learning the four
  freely let queueing leak into them and halved p1 (measured: p99 TTFT doubled on paper-b).
- Decode as the prior's curve scaled by β plus a shape correction d: TPOT is measured per request at
  a batch and context the router knows, so the curve is identifiable where traffic goes. The usual
  error of a prior is its speed (another GPU, clock or engine version than the catalog's), which β
  fixes in all of the curve at once, also at batches the traffic has not reached; d moves the shape
  only where the data shows it.

``b̄`` is the mean of the router's in-flight count on the backend at r's first token and at its end,
capped by what fits in the KV cache (``cap / L̄``) and by ``max_num_seqs``, and scaled by the share
of them the engine reports running (``num_requests_running``, when scraped); ``L̄`` is the mean
context per in-flight request at those two instants. ``b₀`` is the number of other requests in
flight at r's first token (capped the same way) and ``L̄₀`` their mean context. Sharing τ_decode
between the TTFT and TPOT rows keeps the decode work of a busy backend out of α.

The fit minimises relative error (each row is divided by its target, so a 50 ms TTFT counts as much
as a 5 s one) with

- a decaying window: row weight ``max(0.5^(age/half_life), floor)``, the age counted from the
  backend's newest observation (an idle backend keeps what it last showed), and rows older than the
  last detected drift multiplied by ``stale_weight``;
- robustness: three rounds of Huber re-weighting at 1.5 σ, σ = 1.4826·median |relative residual|
  (at least 5 %);
- bounded leverage: a row whose target is far below what the prior predicts for it (a prefix-cache
  hit the router did not expect, a short prompt that joined a step beside a long one the router counted
  as ahead of it) would, divided by its tiny target, outweigh hundreds of ordinary rows and drag the
  prefill scale towards 0, and Huber weights do not stop a point of high leverage. So each row is
  divided by ``max(y, ŷ⁰ / (K·q̃))`` instead of y, where ŷ⁰ is the prior's prediction for the row,
  q = ŷ⁰ / y and q̃ the median of q over the rows of the same kind (TTFT, TPOT, e2e), K =
  ``LEVERAGE_CAP`` (4): a row counts as at most K times more surprising than the typical one, and an
  overall error of the prior (q̃ ≠ 1) moves every row alike. Measured: on 4 equal A100s with the
  Mooncake trace one such row took α from 1 to 0.05; the backend, predicted 20× faster than it was,
  received every long prompt for 20 s (p99 TTFT 18.8 s, 1.5 s with the cap);
- an anchor on the prior: ``λ_s·((α − 1)² + (β − 1)²) + λ_d·Σ_k (s_k·d_k)²``, ``s_k`` the weighted RMS
  of column k of the relative design, so the shape penalty is in the rows' own units; λ_s =
  ``scale_strength`` (2), λ_d = ``prior_strength`` (32 pseudo-rows): a shape correction needs more
  evidence than a change of speed, which is the usual error of a prior.
  With little evidence θ stays at the prior; as weighted rows accumulate the data takes over. A
  direction the data does not excite (p5 against p7 while the batch never changes) keeps the prior's
  shape at the learned speed;
- bounds ``α, β ≥ 0.01``, and each learned ``p_k ≥ min(0, β·p_k⁰)``, so a fitted step never turns
  negative where the prior was positive.

Uncertainty is the diagonal of ``σ²·(AᵀA)⁻¹`` of the final weighted, augmented design, in the
parameters' own units (propagated to p1..p4 through α). Everything here is a pure function of its
arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import lsq_linear

from hetroute.learning.observation import Observation
from hetroute.types import FloatArray

THETA_NAMES = ("alpha", "beta", "d5", "d6", "d7", "d8")
"""The identifiable parameters, in column order (``alpha`` scales the prior's prefill curve, ``beta``
its decode curve, ``d5..d8`` correct the decode curve's shape)."""

_MIN_TARGET_S = 1e-4
_HUBER_K = 1.5
_MIN_SIGMA = 0.05
_IRLS_ROUNDS = 3
_MIN_ALPHA = 0.01
LEVERAGE_CAP = 4.0
"""K of the bounded leverage (module docstring): a row counts as at most K times more surprising than
the median row of its kind."""


@dataclass(frozen=True, slots=True)
class FitSettings:
    """How observations are weighted and how hard the prior pulls (see the module docstring)."""

    half_life_s: float = 30.0
    weight_floor: float = 0.02
    prior_strength: float = 32.0
    scale_strength: float = 2.0
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


def params_of(theta: FloatArray, prior: Sequence[float]) -> tuple[float, ...]:
    """p1..p8 from θ: the prior's p1..p4 scaled by α; p_k = max(β·p_k⁰ + d_k, min(0, β·p_k⁰)) for 5..8."""
    a, b = float(theta[0]), float(theta[1])
    decode = (
        max(b * float(p0) + float(d), min(0.0, b * float(p0)))
        for p0, d in zip(prior[4:], theta[2:], strict=True)
    )
    return (*(a * float(v) for v in prior[:4]), *decode)


def prior_prefill_s(prior: Sequence[float], batch_tokens: float, input_tokens: float) -> float:
    """T⁰_prefill: the prior's prefill curve for ``batch_tokens`` in the batch, r's ``input_tokens``."""
    return float(prior[0]) * batch_tokens + float(prior[2]) * input_tokens + float(prior[1]) + float(prior[3])


def running_share(obs: Observation) -> float:
    """The share of the router's in-flight requests the engine was running at r's end (≤ 1)."""
    if obs.engine_running is None or obs.in_flight_at_end <= 0:
        return 1.0
    return min(1.0, max(obs.engine_running, 1.0) / obs.in_flight_at_end)


def decode_point(obs: Observation, capacity_tokens: float, max_num_seqs: float) -> tuple[float, float]:
    """(b̄, L̄) of r's decode: mean batch (KV- and seq-capped) and mean context per sequence."""
    n1 = max(obs.in_flight_at_first, 1.0)
    n2 = max(obs.in_flight_at_end, 1.0)
    context = 0.5 * (obs.context_at_first / n1 + obs.context_at_end / n2)
    context = max(context, float(obs.input_tokens))
    batch = max(0.5 * (n1 + n2) * running_share(obs), 1.0)
    if math.isfinite(capacity_tokens) and capacity_tokens > 0:
        batch = min(batch, max(1.0, capacity_tokens / max(context, 1.0)))
    return max(1.0, min(batch, max_num_seqs)), context


_TTFT_DECODE_STEPS = 1.0


def running_point(obs: Observation, capacity_tokens: float, max_num_seqs: float) -> tuple[float, float]:
    """(b₀, L̄₀): the other requests decoding while r waits for its first token, and their context."""
    others = max(obs.in_flight_at_first - 1.0, 0.0)
    if others <= 0.0:
        return 0.0, 0.0
    context = max(obs.context_at_first - obs.input_tokens, 0.0) / others
    batch = others * running_share(obs)
    if math.isfinite(capacity_tokens) and capacity_tokens > 0:
        batch = min(batch, max(1.0, capacity_tokens / max(context, 1.0)))
    return min(batch, max_num_seqs), context


def _decode_columns(prior: Sequence[float], batch: float, length: float, weight: float) -> list[float]:
    """The β column (the prior's step) and the d5..d8 columns of ``weight`` decode steps at (b, L)."""
    features = (batch * length, batch, length, 1.0)
    base = sum(float(p0) * f for p0, f in zip(prior[4:], features, strict=True))
    return [weight * base, *(weight * f for f in features)]


Rows = tuple[tuple[tuple[float, ...], float, int], ...]
"""One observation's rows of the fit: (design x, target y, kind: 0 TTFT, 1 TPOT, 2 e2e) each."""


def observation_rows(
    obs: Observation, prior: Sequence[float], capacity_tokens: float, max_num_seqs: float
) -> Rows:
    """The one or two rows ``obs`` contributes to a fit anchored on ``prior``."""
    i = max(float(obs.input_tokens) - obs.cached_tokens, 0.0)  # only uncached tokens are prefilled
    pre = [max(prior_prefill_s(prior, obs.pending_tokens_ahead + i, i), _MIN_TARGET_S)]
    b0, length0 = running_point(obs, capacity_tokens, max_num_seqs)
    busy = _decode_columns(prior, b0, length0, _TTFT_DECODE_STEPS) if b0 > 0 else [0.0] * 5
    b, length = decode_point(obs, capacity_tokens, max_num_seqs)
    dec = _decode_columns(prior, b, length, 1.0)
    steps = max(obs.output_tokens - 1, 0)
    decode_s = obs.decode_s
    if obs.ttft_s is not None and decode_s is not None:
        ttft = ((*pre, *busy), obs.ttft_s, 0)
        if steps >= 1 and decode_s > 0:
            return ttft, ((0.0, *dec), decode_s / steps, 1)
        return (ttft,)
    return (((*pre, *(b_ + steps * v for b_, v in zip(busy, dec, strict=True))), obs.e2e_s, 2),)


class RowCache:
    """The rows of one backend's recent observations, kept between refits (computing them is most of a
    refit's cost) while the prior, capacity and ``max_num_seqs`` they were computed for stay the same.

    Entries are keyed by the observation's identity and hold the observation itself (so an identity is
    never reused while cached); each call keeps only the observations it was given."""

    __slots__ = ("_key", "_rows")

    def __init__(self) -> None:
        self._key: tuple[object, ...] = ()
        self._rows: dict[int, tuple[Observation, Rows]] = {}

    def rows(
        self,
        observations: Sequence[Observation],
        prior: Sequence[float],
        capacity_tokens: float,
        max_num_seqs: float,
    ) -> list[Rows]:
        """:func:`observation_rows` of each of ``observations``, in order."""
        key = (*prior, capacity_tokens, max_num_seqs)
        old = self._rows if key == self._key else {}
        new: dict[int, tuple[Observation, Rows]] = {}
        out: list[Rows] = []
        for obs in observations:
            hit = old.get(id(obs))
            rows = (
                hit[1]
                if hit is not None and hit[0] is obs
                else observation_rows(obs, prior, capacity_tokens, max_num_seqs)
            )
            new[id(obs)] = (obs, rows)
            out.append(rows)
        self._key, self._rows = key, new
        return out


def _rows(
    observations: Sequence[Observation],
    prior: Sequence[float],
    capacity_tokens: float,
    max_num_seqs: float,
    cache: RowCache | None = None,
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """(design X, target y, kind (0 TTFT, 1 TPOT, 2 e2e), time) — one or two rows per observation."""
    per_obs = (
        cache.rows(observations, prior, capacity_tokens, max_num_seqs)
        if cache is not None
        else [observation_rows(obs, prior, capacity_tokens, max_num_seqs) for obs in observations]
    )
    xs: list[tuple[float, ...]] = []
    ys: list[float] = []
    kinds: list[int] = []
    times: list[float] = []
    for obs, rows in zip(observations, per_obs, strict=True):
        for x_row, y_row, kind in rows:
            xs.append(x_row)
            ys.append(y_row)
            kinds.append(kind)
            times.append(obs.finished_at_s)
    x = np.array(xs, dtype=np.float64).reshape(len(xs), len(THETA_NAMES))
    y = np.maximum(np.array(ys, dtype=np.float64), _MIN_TARGET_S)
    return x, y, np.array(kinds, dtype=np.float64), np.array(times, dtype=np.float64)


def _bounded_norm(x: FloatArray, y: FloatArray, kinds: FloatArray, theta0: FloatArray) -> FloatArray:
    """Each row's divisor: ``max(y, ŷ⁰ / (K·q̃))`` (bounded leverage, module docstring)."""
    predicted = x @ theta0
    ratio = predicted / y
    norm = y.copy()
    for kind in np.unique(kinds):
        rows = kinds == kind
        bound = LEVERAGE_CAP * float(np.median(ratio[rows]))
        if bound > 0.0:
            norm[rows] = np.maximum(y[rows], predicted[rows] / bound)
    return norm


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
    cache: RowCache | None = None,
) -> FitResult:
    """Fit p1..p8 to ``observations``, anchored on ``prior_params`` (the module docstring's method).

    With no usable row the prior comes back unchanged with zero samples. ``cache`` (one per backend)
    reuses the rows of observations an earlier fit already saw; the result is the same without it.
    """
    prior = [float(v) for v in prior_params]
    theta0 = np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float64)
    x, y, kinds, times = _rows(observations, prior, capacity_tokens, max_num_seqs, cache)
    if y.size == 0:
        return FitResult(tuple(prior), (0.0,) * 8, 0, 0.0, math.nan, math.nan, math.nan)
    # Age counts from the backend's newest observation, not from now: a backend that has been idle
    # keeps what it showed last; only newer evidence makes older evidence fade.
    age = np.maximum(float(times.max()) - times, 0.0)
    decay = np.maximum(0.5 ** (age / settings.half_life_s), settings.weight_floor)
    decay = np.where(times < regime_start_s, decay * settings.stale_weight, decay)
    norm = _bounded_norm(x, y, kinds, theta0)
    target = y / norm
    xr = x / norm[:, None]
    scale = np.sqrt(np.average(xr**2, axis=0, weights=decay))
    scale = np.where(scale > 0.0, scale, 1.0)  # a column no row uses stays at the prior
    lam = np.sqrt(np.array([settings.scale_strength] * 2 + [settings.prior_strength] * 4))
    lower = np.array([_MIN_ALPHA, _MIN_ALPHA, -np.inf, -np.inf, -np.inf, -np.inf])
    upper = np.full_like(theta0, np.inf)
    huber = np.ones_like(y)
    theta = theta0
    sigma = _MIN_SIGMA
    a = np.zeros((0, len(THETA_NAMES)))
    # Solve in unit-RMS columns (z = θ·s): the raw columns span ten orders of magnitude, which
    # stalls the bounded solver far from the optimum. The scales α and β are dimensionless and are
    # penalised as such (moving β from 1 to 0.5 costs the same whatever the prior predicted); the
    # shape corrections d are penalised in the rows' units.
    xs = xr / scale
    z0 = theta0 * scale
    penalty = lam * np.where(np.arange(len(THETA_NAMES)) < 2, 1.0 / scale, 1.0)
    for _ in range(_IRLS_ROUNDS):
        w = np.sqrt(decay * huber)
        a = np.vstack([xs * w[:, None], np.diag(penalty)])
        rhs = np.concatenate([w * target, penalty * z0])
        z = lsq_linear(a, rhs, bounds=(lower * scale, upper), method="bvls", tol=1e-12).x
        theta = np.asarray(z, dtype=np.float64) / scale
        rel = xr @ theta - target
        # The residuals' scale about zero (not about their median): when every row disagrees with
        # the prior, none of them is an outlier.
        sigma = max(1.4826 * float(np.median(np.abs(rel))), _MIN_SIGMA)
        huber = np.minimum(1.0, _HUBER_K * sigma / np.maximum(np.abs(rel), 1e-12))
    try:
        cov = np.linalg.inv(a.T @ a) * sigma**2 / np.outer(scale, scale)
        err = np.sqrt(np.maximum(np.diag(cov), 0.0))
    except np.linalg.LinAlgError:
        err = np.full(len(THETA_NAMES), np.inf)
    rel = (x @ theta) / y - 1.0  # the true relative errors, for the reported MAPEs
    stderr = (
        *(float(err[0]) * abs(v) for v in prior[:4]),
        *(math.hypot(float(err[1]) * p0, float(e)) for p0, e in zip(prior[4:], err[2:], strict=True)),
    )
    return FitResult(
        params=params_of(theta, prior),
        stderr=stderr,
        samples=len(observations),
        effective_samples=float(decay.sum()),
        ttft_mape=_mape(rel, kinds, 0),
        tpot_mape=_mape(rel, kinds, 1),
        e2e_mape=_mape(rel, kinds, 2),
    )


def predict_tpot_s(
    params: Sequence[float], obs: Observation, capacity_tokens: float, max_num_seqs: float
) -> float:
    """The model's time per output token for ``obs``: τ_decode at its (b̄, L̄) (module docstring)."""
    p = [float(v) for v in params]
    b, length = decode_point(obs, capacity_tokens, max_num_seqs)
    return max(p[4] * b * length + p[5] * b + p[6] * length + p[7], 0.0)


def predict_e2e_s(
    params: Sequence[float], obs: Observation, capacity_tokens: float, max_num_seqs: float
) -> float:
    """The model's e2e for ``obs`` under the load it met: TTFT_r + (O − 1)·TPOT_r (module docstring).

    The learner computes it for every observation, so :func:`running_point` and :func:`decode_point`
    are written out here, their shared running share computed once, and each ``max(a, b)`` /
    ``min(a, b)`` of theirs as the same comparison (``b if b > a else a`` / ``b if b < a else a``, what
    the builtins return, NaN included): the same operations in the same order, the same value
    (``tests/unit/test_learning.py`` checks it against the two functions)."""
    p1, p2, p3, p4, p5, p6, p7, p8 = params if type(params) is list else [float(v) for v in params]
    ii = obs.input_tokens
    running, at_end, at_first = obs.engine_running, obs.in_flight_at_end, obs.in_flight_at_first
    if running is None or at_end <= 0:
        share = 1.0
    else:
        share = (1.0 if running < 1.0 else running) / at_end
        share = share if share < 1.0 else 1.0
    capped = math.isfinite(capacity_tokens) and capacity_tokens > 0
    i = float(ii) - obs.cached_tokens
    i = 0.0 if i < 0.0 else i
    ttft = p1 * (obs.pending_tokens_ahead + i) + p2 + p3 * i + p4
    # running_point: the other requests decoding while r waits for its first token
    others = at_first - 1.0
    others = 0.0 if others < 0.0 else others
    if others > 0.0:
        context0 = obs.context_at_first - ii
        context0 = (0.0 if context0 < 0.0 else context0) / others
        b0 = others * share
        if capped:
            per = capacity_tokens / (1.0 if context0 < 1.0 else context0)
            per = per if per > 1.0 else 1.0
            b0 = per if per < b0 else b0
        b0 = max_num_seqs if max_num_seqs < b0 else b0
        if b0 > 0:
            step0 = p5 * b0 * context0 + p6 * b0 + p7 * context0 + p8
            ttft += _TTFT_DECODE_STEPS * (0.0 if step0 < 0.0 else step0)
    # decode_point: mean batch and mean context of r's decode
    n1 = 1.0 if at_first < 1.0 else at_first
    n2 = 1.0 if at_end < 1.0 else at_end
    context = 0.5 * (obs.context_at_first / n1 + obs.context_at_end / n2)
    fi = float(ii)
    context = fi if fi > context else context
    batch = 0.5 * (n1 + n2) * share
    batch = 1.0 if batch < 1.0 else batch
    if capped:
        per = capacity_tokens / (1.0 if context < 1.0 else context)
        per = per if per > 1.0 else 1.0
        batch = per if per < batch else batch
    batch = max_num_seqs if max_num_seqs < batch else batch
    batch = batch if batch > 1.0 else 1.0
    step = p5 * batch * context + p6 * batch + p7 * context + p8
    decode_steps = obs.output_tokens - 1
    return (0.0 if ttft < 0.0 else ttft) + (decode_steps if decode_steps > 0 else 0) * (
        0.0 if step < 0.0 else step
    )
