"""The ``tune-deploy`` pipeline: estimate every (machine, TP) option, then choose a deployment.

Owns: :class:`MachinePlan`, :class:`TuneResult`, :func:`candidate_tps`, :func:`tune`.

Invariants:
- Candidates for a machine of ``u`` GPUs are the TP degrees that divide ``u``; those that do not divide the
  model's heads (or are excluded by ``engine.tp_degrees``) are listed as infeasible with the reason.
- Estimates are cached by (GPU type, GPU count, model, TP): identical machines cost one estimate, so a fleet
  of thousands of machines of a few types is tuned in well under a second plus the per-type estimates.
- Without constraints each machine takes its best option; with constraints the exact joint search of
  :mod:`hetroute.tuner.search` runs and its wall time is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetroute.errors import ConfigError
from hetroute.tuner.cluster import ClusterSpec, MachineSpec
from hetroute.tuner.estimate import ConfigEstimate, EstimateInputs, PriorFn, estimate_config
from hetroute.tuner.search import JointConstraints, Option, SearchResult, choose_separable, joint_search

ESTIMATORS = ("iteration", "algorithm1")
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True, slots=True)
class MachinePlan:
    """One machine's options (best first under the chosen estimator) and the chosen one (None = unused)."""

    machine: MachineSpec
    options: tuple[ConfigEstimate, ...]
    chosen: ConfigEstimate | None


@dataclass(frozen=True, slots=True)
class TuneResult:
    cluster: ClusterSpec
    estimator: str
    workload: str
    requests: int
    plans: tuple[MachinePlan, ...]
    search: SearchResult
    distinct_configs: int
    estimate_s: float
    elapsed_s: float

    @property
    def total_tokens_per_s(self) -> float:
        return self.search.total_tokens_per_s


class ModelFitsNowhere(ConfigError):
    """No machine of the cluster can run a model in any TP degree; the message lists why, per machine type."""


def _check_each_model_fits(
    cluster: ClusterSpec, cache: dict[tuple[str, int, str], tuple[ConfigEstimate, ...]]
) -> None:
    for model_key in cluster.models:
        mine = {k: v for k, v in cache.items() if k[2] == model_key}
        if mine and not any(e.feasible for ests in mine.values() for e in ests):
            why = "; ".join(
                f"{gpus}x {gpu}: "
                + ", ".join(f"TP{e.tp}: {e.reason}" for e in sorted(ests, key=lambda e: e.tp))
                for (gpu, gpus, _), ests in sorted(mine.items())
            )
            raise ModelFitsNowhere(f"models.{model_key}", f"fits on no machine of the cluster ({why})")


def candidate_tps(gpus: int) -> tuple[int, ...]:
    """Every TP degree that divides the machine's GPU count."""
    return tuple(t for t in range(1, gpus + 1) if gpus % t == 0)


def _clip(requests: Sequence[tuple[int, int]], max_len: int) -> list[tuple[int, int]]:
    out = []
    for inp, o in requests:
        i = min(inp, max_len - 1)
        out.append((max(1, i), max(1, min(o, max_len - i))))
    return out


def tune(
    cluster: ClusterSpec,
    requests: Sequence[tuple[int, int]],
    prior: PriorFn,
    *,
    workload: str = "sharegpt",
    estimator: str = "iteration",
    progress: Progress | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TuneResult:
    """Estimate every option of every machine of ``cluster`` on ``requests`` [(I, O)] and choose."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if not requests:
        raise ValueError("tune needs at least one request")
    start = clock()
    cache, total = _estimate_all(cluster, requests, prior, estimator, progress)
    estimate_s = clock() - start
    _check_each_model_fits(cluster, cache)
    per_machine = [cache[(m.gpu.name, m.gpus, m.model_key)] for m in cluster.machines]
    options = [
        [Option(e.tp, e.instances, e.tokens_per_s(estimator), e.rho_max) for e in ests if e.feasible]
        for ests in per_machine
    ]
    search = _choose(cluster, options, requests, clock)
    plans = []
    for machine, ests, opt in zip(cluster.machines, per_machine, search.choice, strict=True):
        chosen = (
            next((e for e in ests if e.tp == opt.tp and e.feasible), None) if opt.tp is not None else None
        )
        plans.append(MachinePlan(machine, ests, chosen))
    return TuneResult(
        cluster,
        estimator,
        workload,
        len(requests),
        tuple(plans),
        search,
        total,
        estimate_s,
        clock() - start,
    )


def _estimate_all(
    cluster: ClusterSpec,
    requests: Sequence[tuple[int, int]],
    prior: PriorFn,
    estimator: str,
    progress: Progress | None,
) -> tuple[dict[tuple[str, int, str], tuple[ConfigEstimate, ...]], int]:
    """Estimate each distinct (GPU type, GPU count, model) once, over every candidate TP.

    Returns the estimates by that key (best first under ``estimator``) and the number of (machine, TP)
    estimates made.
    """
    slo = cluster.constraints.slo
    inputs = {
        key: EstimateInputs(
            cluster.engine, _clip(requests, cluster.engine.model_len(m)), slo, cluster.workload.seed
        )
        for key, m in cluster.models.items()
    }
    keys = sorted({(m.gpu.name, m.gpus, m.model_key) for m in cluster.machines})
    gpu_of = {m.gpu.name: m.gpu for m in cluster.machines}
    total = sum(len(candidate_tps(g)) for _, g, _ in keys)
    cache: dict[tuple[str, int, str], tuple[ConfigEstimate, ...]] = {}
    done = 0
    for gpu_name, gpus, model_key in keys:
        found: list[ConfigEstimate] = []
        for tp in candidate_tps(gpus):
            key = (gpu_name, tp, model_key)
            found.append(
                estimate_config(
                    gpu_of[gpu_name],
                    gpus,
                    model_key,
                    cluster.models[model_key],
                    tp,
                    inputs[model_key],
                    cluster.profiles.get(key),
                    cluster.profile_paths.get(key),
                    prior,
                )
            )
            done += 1
            if progress is not None:
                progress(done, total, f"{gpu_name}x{gpus} {model_key} TP{tp}")
        found.sort(key=lambda e: (-e.tokens_per_s(estimator), not e.feasible, e.tp))
        cache[(gpu_name, gpus, model_key)] = tuple(found)
    return cache, total


def _choose(
    cluster: ClusterSpec,
    options: list[list[Option]],
    requests: Sequence[tuple[int, int]],
    clock: Callable[[], float],
) -> SearchResult:
    """Each machine's best option, or the exact joint search when the cluster has active constraints."""
    prices = [m.price_per_hour for m in cluster.machines]
    cons = cluster.constraints
    if cons.active:
        demand = None
        if cons.slo is not None:
            demand = cons.slo.rate_rps * sum(i + o for i, o in requests) / len(requests)
        return joint_search(
            options, prices, JointConstraints(cons.min_instances, cons.max_cost_per_hour, demand), clock=clock
        )
    return choose_separable(options, prices, clock=clock)
