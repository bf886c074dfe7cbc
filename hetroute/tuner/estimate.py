"""Per-configuration estimates for ``tune-deploy``: feasibility, both throughput estimates, SLO headroom.

Owns: :class:`ConfigEstimate`, :class:`EstimateInputs`, :func:`estimate_config`, :func:`slo_headroom`.

One configuration is (GPU type, GPUs per machine, model, TP). Identical machines share it, so callers cache
by that key (:mod:`hetroute.tuner.tune`). The latency curves are the cluster file's profile for (GPU, TP,
model) when there is one, else the catalog's roofline prior (marked ``roofline-prior``). KV capacity is the
engine-reported one from a measured profile, else the computed one of method.md §2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetroute.catalog.specs import GpuSpec, ModelSpec
from hetroute.latency import LatencyProfile
from hetroute.tuner.algorithm1 import algorithm1_estimate
from hetroute.tuner.cluster import EngineSettings, SloSpec
from hetroute.tuner.feasibility import check_instance
from hetroute.tuner.iteration import simulate_instance, simulate_machine

PriorFn = Callable[[GpuSpec, ModelSpec, int], LatencyProfile]
"""Builds a roofline prior profile for (GPU, model, TP) when no measured profile exists."""

RHO_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
SLO_SAMPLE = 400


@dataclass(frozen=True, slots=True)
class ConfigEstimate:
    """Everything the report shows for one TP degree on one kind of machine. Throughputs in tokens/s."""

    gpu: str
    gpus: int
    model_key: str
    tp: int
    instances: int
    feasible: bool
    reason: str | None
    kv_capacity_tokens: int | None
    kv_source: str | None
    profile_source: str | None
    profile_path: str | None
    algorithm1_tokens_per_s: float | None = None
    iteration_tokens_per_s: float | None = None
    iteration_instance_tokens_per_s: float | None = None
    preemptions: int = 0
    mean_batch: float = 0.0
    rho_max: float = math.inf
    slo_curve: tuple[tuple[float, float, float], ...] = ()
    warnings: tuple[str, ...] = ()

    def tokens_per_s(self, estimator: str) -> float:
        """The machine's throughput under ``estimator`` ('iteration' or 'algorithm1'); 0 if infeasible."""
        value = self.iteration_tokens_per_s if estimator == "iteration" else self.algorithm1_tokens_per_s
        return value if (self.feasible and value is not None) else 0.0


@dataclass(frozen=True, slots=True)
class EstimateInputs:
    """What every configuration of one model is estimated against."""

    engine: EngineSettings
    requests: Sequence[tuple[int, int]]
    slo: SloSpec | None = None
    seed: int = 0


def _sweep_warning(profile: LatencyProfile, largest_batch: float) -> str | None:
    sizes = profile.sweep.get("batch_sizes") if profile.sweep else None
    if isinstance(sizes, list) and sizes and all(isinstance(s, int | float) for s in sizes):
        top = max(float(s) for s in sizes)
        if largest_batch > top:
            return f"batch {largest_batch:.0f} extrapolates past the profiled batch sizes (max {top:.0f})"
    return None


def estimate_config(
    gpu: GpuSpec,
    gpus: int,
    model_key: str,
    model: ModelSpec,
    tp: int,
    inputs: EstimateInputs,
    profile: LatencyProfile | None,
    profile_path: str | None,
    prior: PriorFn,
) -> ConfigEstimate:
    """Feasibility, then Algorithm 1 and the iteration-level estimate for ``gpus // tp`` instances."""
    instances = gpus // tp
    engine = inputs.engine
    feas = check_instance(gpu, model, tp, engine)
    base = ConfigEstimate(
        gpu.name,
        gpus,
        model_key,
        tp,
        instances,
        feas.feasible,
        feas.reason,
        feas.kv_capacity_tokens,
        "computed" if feas.kv_capacity_tokens else None,
        None,
        None,
    )
    if not feas.feasible or feas.kv_capacity_tokens is None:
        return base
    profile, source, path = _profile_or_prior(gpu, model, tp, profile, profile_path, prior)
    cap, kv_source, warnings = _kv_capacity(profile, profile_path, feas.kv_capacity_tokens)

    def infeasible(reason: str) -> ConfigEstimate:
        return ConfigEstimate(
            gpu.name, gpus, model_key, tp, instances, False, reason, cap, kv_source, source, path
        )

    requests = inputs.requests
    longest = max(i + o for i, o in requests)
    if longest > cap:
        return infeasible(f"a request of {longest} tokens exceeds the KV capacity {cap}")
    seqs = engine.max_num_seqs
    alg1 = algorithm1_estimate(profile.params, requests, cap, seqs, instances)
    if len(requests) < instances:
        return infeasible(f"fewer requests ({len(requests)}) than instances")
    run = simulate_machine(profile.params, requests, instances, cap, seqs, engine.batched_tokens())
    warnings += _load_warnings(
        profile, max(alg1.largest_batch, run.mean_batch), len(requests), instances, seqs
    )
    curve: tuple[tuple[float, float, float], ...] = ()
    rho_max = math.inf
    if inputs.slo is not None:
        curve = slo_curve(profile, requests, cap, engine, run.instance_tokens_per_s, inputs.seed)
        rho_max = slo_headroom(curve, inputs.slo)
    return ConfigEstimate(
        gpu.name,
        gpus,
        model_key,
        tp,
        instances,
        True,
        None,
        cap,
        kv_source,
        source,
        path,
        algorithm1_tokens_per_s=alg1.machine_tokens_per_s if alg1.infeasible_reason is None else None,
        iteration_tokens_per_s=run.tokens_per_s,
        iteration_instance_tokens_per_s=run.instance_tokens_per_s,
        preemptions=run.preemptions,
        mean_batch=run.mean_batch,
        rho_max=rho_max,
        slo_curve=curve,
        warnings=tuple(warnings),
    )


def _profile_or_prior(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int,
    profile: LatencyProfile | None,
    profile_path: str | None,
    prior: PriorFn,
) -> tuple[LatencyProfile, str, str | None]:
    """The profile to use, its source label and path: ``profile`` as given, else the roofline prior."""
    if profile is None:
        return prior(gpu, model, tp), "roofline-prior", None
    return profile, profile.source, profile_path


def _kv_capacity(
    profile: LatencyProfile, profile_path: str | None, computed_tokens: int
) -> tuple[int, str, list[str]]:
    """KV capacity in tokens, its source and warnings: a measured profile's figure wins over ``computed``."""
    warnings: list[str] = []
    if profile.source in ("profiled", "emulated") and profile_path is not None:
        cap = profile.kv_capacity_tokens
        if abs(cap - computed_tokens) > 0.05 * computed_tokens:
            warnings.append(
                f"profiled KV capacity {cap} differs from the computed {computed_tokens}: "
                "re-profile if the engine's memory settings changed"
            )
        return cap, profile.kv_capacity_source, warnings
    return computed_tokens, "computed", warnings


def _load_warnings(
    profile: LatencyProfile, largest_batch: float, num_requests: int, instances: int, max_num_seqs: int
) -> list[str]:
    """Warnings about the estimate's load: batches past the profiled sweep, unsaturated instances."""
    warnings: list[str] = []
    note = _sweep_warning(profile, largest_batch)
    if note:
        warnings.append(note)
    share = num_requests // instances
    if share < max_num_seqs:
        warnings.append(
            f"each instance serves only {share} requests (< max_num_seqs {max_num_seqs}): raise --requests "
            "to estimate a saturated machine"
        )
    return warnings


def slo_curve(
    profile: LatencyProfile,
    requests: Sequence[tuple[int, int]],
    cap: int,
    engine: EngineSettings,
    instance_tokens_per_s: float,
    seed: int,
) -> tuple[tuple[float, float, float], ...]:
    """(ρ, p90 TTFT s, p90 TPOT s) of one instance under Poisson load ρ × its saturation throughput."""
    sample = list(requests[:SLO_SAMPLE])
    mean_tokens = sum(i + o for i, o in sample) / len(sample)
    capacity_rps = instance_tokens_per_s / mean_tokens
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, size=len(sample))
    unit_arrivals = np.cumsum(gaps) - gaps[0]
    out = []
    for rho in RHO_GRID:
        arrivals = (unit_arrivals / (rho * capacity_rps)).tolist()
        run = simulate_instance(
            profile.params, sample, cap, engine.max_num_seqs, engine.batched_tokens(), arrivals
        )
        out.append((rho, run.ttft_p90_s, run.tpot_p90_s))
    return tuple(out)


def slo_headroom(curve: Sequence[tuple[float, float, float]], slo: SloSpec) -> float:
    """The largest ρ of the grid up to which every point meets the SLO (0 when even the first fails)."""
    best = 0.0
    for rho, ttft, tpot in curve:
        ok = (slo.ttft_s is None or ttft <= slo.ttft_s) and (slo.tpot_s is None or tpot <= slo.tpot_s)
        if not ok:
            break
        best = rho
    return best
