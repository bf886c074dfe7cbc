"""Per-backend latency and KV-capacity models for the profile-driven policies.

Owns the resolution of *which* latency parameters (p1..p8 of method.md §3) and *which* KV capacity
each backend is scored with, the vectorised evaluation of the paper's amortised request time

    b_r^s = clip(floor(cap_s / (I_r + Õ_r)), 1, max_num_seqs_s)                 (method.md §5, Eq. 5)
    T_r^s = (T_prefill(b, I_r) + T_decode(b, I_r, Õ_r)) / b                      (Eq. 6)

over a candidate index array, and the one-line description of the sources that the gateway shows in
``/admin/backends`` and the log (:func:`describe_backend_models`).

Resolution order (documented fallbacks, never a failure):

- latency: ``BackendSpec.profile`` → the roofline prior ``hetroute.prior.roofline_prior_profile(gpu,
  model, tp)`` from the backend's ``gpu``/``tp`` labels and its model → a neutral default
  (``NEUTRAL_PARAMS``: 0.2 ms per prompt token and 20 ms per decode step at any batch, i.e. every
  unprofiled backend is equally fast and throughput grows with KV capacity). With live learning
  (``hetroute.learning``) this is only the starting point: the snapshot's learned parameters win;
- KV capacity: the snapshot's ``kv_capacity_tokens`` (the router's best known value: profile, engine
  metrics ``vllm:cache_config_info``, configured ``kv_capacity_tokens``) → the prior's computed
  capacity → the median of the other backends' static capacities → ``NEUTRAL_KV_CAPACITY_TOKENS``.

Invariant: everything here is computed once at construction from immutable specs; evaluation reads
only the snapshot and returns new arrays.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hetroute.catalog.specs import GpuSpec, ModelSpec
from hetroute.errors import ConfigError
from hetroute.latency import LatencyParams, LatencyProfile
from hetroute.types import BackendSpec, ClusterSnapshot, EngineMetrics, FloatArray, IntArray

log = logging.getLogger(__name__)

NEUTRAL_PARAMS = LatencyParams(p1=0.0, p2=0.0, p3=2e-4, p4=0.0, p5=0.0, p6=0.0, p7=0.0, p8=0.02)
"""Used when a backend has neither a profile nor a usable prior: 0.2 ms per prompt token, 20 ms per step.

Amortised over the KV-saturating batch (p3, p8 scale as 1/b), so with nothing else known the min-max
splits saturating load in proportion to KV capacity, which is what routes best at rate ∞ (measured:
putting the prompt cost in p1 instead cost 37 % of throughput on paper-a at rate ∞). Live learning
starts its fit from ``NEUTRAL_LEARNING_PRIOR`` instead (``hetroute.learning.build``)."""

NEUTRAL_LEARNING_PRIOR = LatencyParams(
    p1=2e-4, p2=0.0, p3=0.0, p4=0.0, p5=1e-2 / (256 * 512), p6=1e-2 / 256, p7=0.0, p8=1e-2
)
"""The neutral curve the live learner scales: the same 0.2 ms per prompt token, in p1 (prefill is
compute-bound: a batch of prompts costs per token, and the prefill-queue term ``p1 · P`` is live once
learned), and a decode step of 10 ms plus 10 ms per 256 running sequences plus 10 ms per 131,072
context tokens they hold (30 ms at 256 sequences of 512 tokens, 10 ms for one short one).

The learner mostly fixes a prior's speed (β scales the whole decode curve) and corrects its shape
only on much evidence (docs/learning.md), so the shape of this curve decides how a backend whose
traffic always ran at one batch size is priced at another. Decode steps grow with the batch on every
GPU of the catalog: the roofline priors give 2.0× (H100), 2.6× (A100), 2.2× (L4) and 2.5× (T4) from
41 to 250 sequences of 600 tokens; this curve 2.3×. A flat 20 ms step, used before, made a backend
learned at a full batch of 256 look 2-3× slower than it is at a small one: at the end of a backlog the
router then kept requests queued for the busy fast backend while others stood nearly idle (mixed fleet,
nothing known, rate ∞ through the gateway: A100s at 40 of 256 sequences with 469 requests queued)."""

NEUTRAL_KV_CAPACITY_TOKENS = 65536.0
"""KV capacity assumed when nothing (profile, metrics, config, prior, other backends) gives one."""

PriorFn = Callable[[str, str, int], LatencyProfile]
"""``(gpu, model, tp) -> LatencyProfile``: the roofline prior (``hetroute.prior.roofline_prior_profile``)."""


def default_prior() -> PriorFn:
    """The catalog's roofline prior by names: GPU and model looked up in the packaged catalogs.

    Catalogs are loaded on the first call and kept by the returned closure (one per policy build).
    """
    from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
    from hetroute.prior import roofline_prior_profile

    catalogs: list[tuple[Mapping[str, GpuSpec], Mapping[str, ModelSpec]]] = []

    def prior(gpu: str, model: str, tp: int) -> LatencyProfile:
        if not catalogs:
            catalogs.append((load_gpu_catalog(), load_model_catalog()))
        gpus, models = catalogs[0]
        return roofline_prior_profile(lookup_gpu(gpus, gpu), lookup_model(models, model), tp)

    return prior


def _cached(prior: PriorFn) -> PriorFn:
    """``prior`` memoised per (gpu, model, tp): identical instances share one fit."""
    memo: dict[tuple[str, str, int], LatencyProfile | Exception] = {}

    def wrapped(gpu: str, model: str, tp: int) -> LatencyProfile:
        key = (gpu, model, tp)
        if key not in memo:
            try:
                memo[key] = prior(gpu, model, tp)
            except (LookupError, ValueError, ArithmeticError, ConfigError) as exc:
                memo[key] = exc
        found = memo[key]
        if isinstance(found, Exception):
            raise found
        return found

    return wrapped


@dataclass(frozen=True, slots=True)
class BackendModel:
    """Resolved latency and capacity sources for one backend."""

    params: LatencyParams
    latency_source: str
    static_capacity_tokens: float
    capacity_source: str
    max_num_seqs: float


def _prior_profile(spec: BackendSpec, prior: PriorFn | None) -> tuple[LatencyProfile | None, str]:
    """The prior profile for ``spec`` and a note on why it is missing when it is."""
    if prior is None:
        return None, "no prior available"
    if spec.gpu is None:
        return None, "no gpu label"
    tp = spec.tp if spec.tp is not None else 1
    names = [spec.labels["model"]] if "model" in spec.labels else []
    names += [m for m in spec.models if m not in names]
    last = "no model"
    for model in names:
        try:
            return prior(spec.gpu, model, tp), f"roofline prior ({spec.gpu}, tp={tp}, {model})"
        except (
            LookupError,
            ValueError,
            ArithmeticError,
            ConfigError,
        ) as exc:  # unknown name, no fit, bad catalog
            last = f"no prior for {spec.gpu}/tp={tp}/{model}: {exc}"
    return None, last


def resolve_backend(spec: BackendSpec, prior: PriorFn | None) -> BackendModel:
    """Latency parameters, static capacity and engine limit of one backend, with their sources."""
    prior_profile: LatencyProfile | None = None
    prior_note = ""
    if spec.profile is None or spec.profile.limits.max_num_seqs is None:
        prior_profile, prior_note = _prior_profile(spec, prior)
    if spec.profile is not None:
        params = spec.profile.params
        latency_source = f"profile ({spec.profile.source})"
    elif prior_profile is not None:
        params = prior_profile.params
        latency_source = prior_note
    else:
        params = NEUTRAL_PARAMS
        latency_source = f"neutral default ({prior_note})"
    if spec.profile is not None:
        cap, cap_source = (
            float(spec.profile.kv_capacity_tokens),
            f"profile ({spec.profile.kv_capacity_source})",
        )
    elif spec.kv_capacity_tokens is not None:
        cap, cap_source = float(spec.kv_capacity_tokens), "config kv_capacity_tokens"
    elif prior_profile is not None:
        cap, cap_source = (
            float(prior_profile.kv_capacity_tokens),
            f"computed ({prior_profile.kv_capacity_source})",
        )
    else:
        cap, cap_source = math.nan, "unknown"
    seqs: float = math.inf
    for limit in (
        spec.max_num_seqs,
        spec.profile.limits.max_num_seqs if spec.profile is not None else None,
        prior_profile.limits.max_num_seqs if prior_profile is not None else None,
    ):
        if limit is not None:
            seqs = float(limit)
            break
    return BackendModel(params, latency_source, cap, cap_source, seqs)


class BackendModels:
    """Per-backend constants as arrays (index = backend index), evaluated vectorised."""

    def __init__(
        self, backends: Sequence[BackendSpec], prior: PriorFn | None = None, *, log_fallbacks: bool = True
    ) -> None:
        self.backends = tuple(backends)
        self._prior = _cached(prior) if prior is not None else None
        self._log_fallbacks = log_fallbacks
        self.models = tuple(resolve_backend(b, self._prior) for b in self.backends)
        self._arrays()
        for spec, model in zip(self.backends, self.models, strict=True):
            self._log(spec, model)

    def _log(self, spec: BackendSpec, model: BackendModel) -> None:
        if self._log_fallbacks and not model.latency_source.startswith("profile"):
            log.info("backend %s has no latency profile: using %s", spec.name, model.latency_source)

    def _arrays(self) -> None:
        """The evaluation arrays from ``models``, each replaced whole."""
        self.params: FloatArray = np.array(
            [m.params.as_tuple() for m in self.models], dtype=np.float64
        ).reshape(len(self.models), 8)
        self.max_num_seqs: FloatArray = np.maximum(
            np.array([m.max_num_seqs for m in self.models], dtype=np.float64), 1.0
        )
        static: FloatArray = np.array([m.static_capacity_tokens for m in self.models], dtype=np.float64)
        self.static_capacity_tokens = static  # NaN where unknown (no profile, config or catalog value)
        known = static[np.isfinite(static)]
        neutral = float(np.median(known)) if known.size else NEUTRAL_KV_CAPACITY_TOKENS
        self.neutral_capacity_tokens = neutral
        self.fallback_capacity_tokens: FloatArray = np.where(np.isfinite(static), static, neutral)
        for array in (self.params, self.max_num_seqs, self.fallback_capacity_tokens, static):
            array.flags.writeable = False  # replaced whole (with_slot, adopt), never changed in place

    def with_slot(self, i: int, spec: BackendSpec) -> BackendModels:
        """A copy with ``spec`` resolved into slot ``i`` (one past the last: one more slot), sharing this
        instance's memoised prior: a replica of a backend already known costs no fit, a new
        (gpu, model, tp) pair fits its roofline prior here, once."""
        backends, models = list(self.backends), list(self.models)
        model = resolve_backend(spec, self._prior)
        if i == len(models):
            backends.append(spec)
            models.append(model)
        else:
            backends[i], models[i] = spec, model
        out = object.__new__(BackendModels)
        out._prior, out._log_fallbacks = self._prior, self._log_fallbacks
        out.backends, out.models = tuple(backends), tuple(models)
        out._arrays()
        return out

    def adopt(self, other: BackendModels, i: int) -> None:
        """Take over ``other``'s backends and arrays (a :meth:`with_slot` copy whose slot ``i`` changed),
        in place for every holder of this instance (live backend changes). Each array is replaced
        whole, so a decision holding the old ones never sees half an update."""
        self.backends, self.models = other.backends, other.models
        self.params, self.max_num_seqs = other.params, other.max_num_seqs
        self.neutral_capacity_tokens = other.neutral_capacity_tokens
        self.fallback_capacity_tokens = other.fallback_capacity_tokens
        self.static_capacity_tokens = other.static_capacity_tokens
        self._log(self.backends[i], self.models[i])

    @classmethod
    def from_specs(cls, backends: Sequence[BackendSpec]) -> BackendModels:
        """Resolve with the catalog's roofline prior (when importable)."""
        return cls(backends, default_prior())

    def capacity_tokens(self, snapshot: ClusterSnapshot, idx: IntArray) -> FloatArray:
        """KV capacity of backends ``idx``: the snapshot's value, else the static fallback (≥ 1 token)."""
        snap = snapshot.kv_capacity_tokens[idx]
        out: FloatArray = np.maximum(
            np.where(np.isfinite(snap), snap, self.fallback_capacity_tokens[idx]), 1.0
        )
        return out

    def rows(self, idx: IntArray, params: FloatArray | None) -> FloatArray:
        """p1..p8 of backends ``idx``: from ``params`` (the snapshot's learned n×8 model) when given,
        else the static model resolved at construction."""
        out: FloatArray = (self.params if params is None else params)[idx]
        return out

    def amortised_request_s(
        self,
        idx: IntArray,
        input_tokens: float,
        output_tokens: float,
        capacity_tokens: FloatArray,
        params: FloatArray | None = None,
        cached_tokens: FloatArray | None = None,
        max_num_seqs: FloatArray | None = None,
    ) -> FloatArray:
        """T_r^s (Eq. 5-6) for each backend in ``idx``; ``capacity_tokens`` aligned with ``idx``.

        ``params`` (n×8) replaces the static p1..p8 when given: the snapshot's ``latency_params``.
        ``cached_tokens`` (aligned with ``idx``) are prompt tokens expected in each backend's prefix
        cache: the prefill terms (p1·b·I, p3·I) count only I − cached, the KV terms the whole prompt.
        ``max_num_seqs`` (aligned with ``idx``) replaces the static sequence limits (a limit the
        admission queue saw the engine keep, where none is configured).
        """
        args = (idx, input_tokens, output_tokens, capacity_tokens, params, cached_tokens, max_num_seqs)
        out, _ = self.amortised_and_saved_s(*args, saved=False)
        return out

    def amortised_and_saved_s(
        self,
        idx: IntArray,
        input_tokens: float,
        output_tokens: float,
        capacity_tokens: FloatArray,
        params: FloatArray | None = None,
        cached_tokens: FloatArray | None = None,
        max_num_seqs: FloatArray | None = None,
        *,
        saved: bool = True,
        uncached_tokens: FloatArray | None = None,
    ) -> tuple[FloatArray, FloatArray | None]:
        """(T_r^s, the prefill time the cached tokens save in it) as :meth:`amortised_request_s`; the
        saving is ``(p1·b + p3) · (I − U) / b`` (the prefill terms' share, before T's clamp at 0), None
        without ``saved``. ``uncached_tokens``: :func:`uncached_tokens` of these inputs, when the caller
        already has it (one decision computes it once for every term)."""
        i = float(max(input_tokens, 0))
        iu = _uncached(i, cached_tokens) if uncached_tokens is None else uncached_tokens
        o = float(max(output_tokens, 0))
        per_request = max(1.0, i + o)
        seqs = self.max_num_seqs[idx] if max_num_seqs is None else max_num_seqs
        b = np.minimum(np.maximum(np.floor(capacity_tokens / per_request), 1.0), seqs)
        p = self.rows(idx, params)
        s = o * i + o * (o + 1.0) / 2.0
        per_b = p[:, 0] * b
        total = (
            per_b * iu
            + p[:, 1] * b
            + p[:, 2] * iu
            + p[:, 3]
            + p[:, 4] * b * s
            + p[:, 5] * b * o
            + p[:, 6] * s
            + p[:, 7] * o
        )
        out: FloatArray = np.maximum(total, 0.0) / b
        if not saved:
            return out, None
        saving: FloatArray = (per_b + p[:, 2]) * (i - iu) / b
        return out, saving

    def request_latency_s(
        self,
        idx: IntArray,
        input_tokens: float,
        output_tokens: float,
        batch: FloatArray,
        context_tokens: FloatArray,
        params: FloatArray | None = None,
        cached_tokens: FloatArray | None = None,
        *,
        uncached_tokens: FloatArray | None = None,
    ) -> FloatArray:
        """Latency of one request joining a running batch: its prefill alone, then Õ decode steps.

        ``batch`` is the number of sequences decoding together (r included) and ``context_tokens``
        their mean KV length, both aligned with ``idx``:
        ``T_prefill(1, I − cached) + Õ · τ_decode(context + Õ/2, batch)`` (Eq. 3 and the per-step
        model; ``cached_tokens`` and ``uncached_tokens`` as in :meth:`amortised_and_saved_s`).
        """
        p = self.rows(idx, params)
        o = float(max(output_tokens, 0))
        iu = (
            _uncached(float(max(input_tokens, 0)), cached_tokens)
            if uncached_tokens is None
            else uncached_tokens
        )
        b = np.minimum(np.maximum(batch, 1.0), self.max_num_seqs[idx])
        kv_len = context_tokens + o / 2.0
        prefill = p[:, 0] * iu + p[:, 1] + p[:, 2] * iu + p[:, 3]
        step = p[:, 4] * b * kv_len + p[:, 5] * b + p[:, 6] * kv_len + p[:, 7]
        out: FloatArray = np.maximum(prefill + o * step, 0.0)
        return out

    def prefill_s(
        self,
        idx: IntArray,
        input_tokens: float,
        params: FloatArray | None = None,
        cached_tokens: FloatArray | None = None,
        *,
        uncached_tokens: FloatArray | None = None,
    ) -> FloatArray:
        """T_prefill(1, I − cached) per backend in ``idx``: one prompt prefilled alone (Eq. 3, b = 1), ≥ 0
        (``uncached_tokens`` as in :meth:`amortised_and_saved_s`)."""
        p = self.rows(idx, params)
        i = (
            _uncached(float(max(input_tokens, 0)), cached_tokens)
            if uncached_tokens is None
            else uncached_tokens
        )
        out: FloatArray = np.maximum(p[:, 0] * i + p[:, 1] + p[:, 2] * i + p[:, 3], 0.0)
        return out

    def prefill_queue_s(
        self, idx: IntArray, pending_tokens: FloatArray, params: FloatArray | None = None
    ) -> FloatArray:
        """Time to prefill the prompts already waiting on each backend: ``p1 · P_s`` (≥ 0).

        ``P_s`` (aligned with ``idx``) is Σ I of in-flight requests without a first token; ``p1`` is
        the per-token cost of a batched prefill (method.md §3, T_prefill(b, I) = p1·b·I + ...), since
        queued prompts are prefilled together (chunked prefill fills each step's token budget).
        """
        out: FloatArray = np.maximum(self.rows(idx, params)[:, 0], 0.0) * np.maximum(pending_tokens, 0.0)
        return out

    def saturated_throughput_tokens_s(
        self,
        idx: IntArray,
        input_tokens: float,
        output_tokens: float,
        capacity_tokens: FloatArray,
        params: FloatArray | None = None,
    ) -> FloatArray:
        """Token throughput (I + O per second) at the KV-saturating batch: (I + O) / T_r^s."""
        t = self.amortised_request_s(idx, input_tokens, output_tokens, capacity_tokens, params)
        tokens = max(1.0, float(input_tokens) + float(output_tokens))
        out: FloatArray = tokens / np.maximum(t, 1e-12)
        return out


def uncached_tokens(input_tokens: float, cached_tokens: FloatArray) -> FloatArray:
    """Prompt tokens left to prefill on each backend, ``max(I − cached, 0)``: what the model methods'
    ``uncached_tokens`` takes (the same value they compute from ``cached_tokens`` themselves)."""
    out: FloatArray = np.maximum(float(max(input_tokens, 0)) - cached_tokens, 0.0)
    return out


def _uncached(input_tokens: float, cached_tokens: FloatArray | None) -> FloatArray | float:
    """Prompt tokens left to prefill: ``I − cached`` (≥ 0), or ``I`` when nothing is cached."""
    return input_tokens if cached_tokens is None else uncached_tokens(input_tokens, cached_tokens)


def describe_backend_models(
    backends: Sequence[BackendSpec],
    metrics: Sequence[EngineMetrics | None] | None = None,
    prior: PriorFn | None = None,
) -> tuple[str, ...]:
    """One line per backend saying which latency and KV-capacity source the policies use.

    ``metrics`` (the latest scrape per backend) lets the line say when the engine reports the
    capacity. With ``prior=None`` the catalog's roofline prior is used when importable.
    """
    chosen_prior = prior if prior is not None else default_prior()
    return describe_models(BackendModels(backends, chosen_prior, log_fallbacks=False), metrics)


def describe_models(
    models: BackendModels, metrics: Sequence[EngineMetrics | None] | None = None
) -> tuple[str, ...]:
    """:func:`describe_backend_models` for models already resolved (no catalog or prior work)."""
    backends = models.backends
    lines = []
    for i, (spec, model) in enumerate(zip(backends, models.models, strict=True)):
        m = metrics[i] if metrics is not None and i < len(metrics) else None
        if spec.profile is not None:
            cap = f"{model.static_capacity_tokens:.0f} tokens from {model.capacity_source}"
        elif m is not None and m.kv_capacity_tokens is not None:
            cap = f"{m.kv_capacity_tokens} tokens from engine metrics"
        elif math.isfinite(model.static_capacity_tokens):
            cap = f"{model.static_capacity_tokens:.0f} tokens from {model.capacity_source}"
        else:
            cap = f"unknown: neutral default {models.neutral_capacity_tokens:.0f} tokens"
        seqs = "" if math.isinf(model.max_num_seqs) else f"; max_num_seqs {model.max_num_seqs:.0f}"
        lines.append(f"latency: {model.latency_source}; kv capacity: {cap}{seqs}")
    return tuple(lines)
