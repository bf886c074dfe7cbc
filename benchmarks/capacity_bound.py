"""Is 95 % of the capacity bound reachable at rate ∞? Oracle and offline-assignment experiments.

Usage: ``python benchmarks/capacity_bound.py [--requests 4000] [--seeds 1,2,3]
[--scenarios paper-b,mixed] [--iterations 8] [--workers 2] [--out benchmarks/results]``.

For each scenario and seed one ShareGPT-like workload at rate ∞ (all requests at t = 0) is drawn, as
in ``benchmarks/policies.py``, and every run goes through :func:`run_simulation`:

- ``default (online)``: ``balanced_minmax`` with the default predictor (what policies.py measures);
- ``default (oracle)``: the same with perfect output lengths. ``run_simulation`` takes a predictor by
  name, so the workload sends ``max_tokens`` = the true length (``send_max_tokens``; in the vLLM engine
  model this changes nothing but the predictor's clamp) and the ``mean`` predictor answers a huge
  constant, which every prediction is clamped to the truth from; :func:`check_oracle` verifies that
  the predictions equal the true lengths for every request;
- ``standalone``: each instance alone on all requests; the capacity bound is the sum;
- ``share-sized``: each instance alone on the first ``n·thr_s/Σthr`` requests (policies.md's bound);
- ``offline``: a static assignment computed with the true lengths and replayed by request id through
  :class:`ReplayPolicy`. Cost of r on s: ``c_rs = f_s · T_r^s`` (the policies' amortised request time,
  method.md Eq. 5-6) with ``f_s`` calibrated so that Σ_r c_rs equals s's measured standalone makespan;
  requests are list-scheduled longest first (LPT on unrelated machines: each to argmin_s load_s +
  c_rs). Then ``--iterations`` rounds of refinement: run it, multiply each ``f_s`` by √(s's finish
  time / the mean finish time), reassign. The best round is kept. Requests keep their workload (FCFS)
  order on each instance, which is all a router controls;
- ``offline, longest first``: the best assignment again with the workload re-ordered by descending
  output length (every arrival is still t = 0), i.e. a scheduler that may also reorder: an upper
  reference for what the drain tail costs, not something a router can do.

Writes ``capacity_bound.json`` and ``capacity_bound.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetroute.policies.backend_model import BackendModels, default_prior
from hetroute.sim.cluster_file import Fleet, build_fleet
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import SimRequest, generate_workload
from hetroute.simulation.simulator import run_simulation
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision
from predictors import build_predictor

RESULTS = Path(__file__).resolve().parent / "results"
ORACLE_PARAMS: dict[str, object] = {"mean_tokens": 1.0e9, "learn": False}
"""``mean`` predictor params that, clamped to ``max_tokens`` = the true length, predict the truth."""


class ReplayPolicy:
    """Replays a precomputed assignment ``{request_id: backend index}`` (an offline schedule)."""

    name = "offline_replay"

    def __init__(self, assignment: Mapping[str, int]) -> None:
        self.assignment = dict(assignment)

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        index = self.assignment[features.request_id]
        if index not in set(int(c) for c in candidates):
            raise ValueError(f"request {features.request_id}: backend {index} is not a candidate")
        return RoutingDecision(index=index, reason="offline assignment")


@dataclass(frozen=True)
class Task:
    """One simulation. ``kind``: default, oracle, standalone, share, offline, offline_lf."""

    scenario: str
    seed: int
    requests: int
    kind: str
    label: str
    backend: str = ""
    prefix: int | None = None
    factors: tuple[float, ...] = ()
    iteration: int = 0
    extra: Mapping[str, object] = field(default_factory=dict)


_FLEETS: dict[str, Fleet] = {}


def fleet_of(scenario: str) -> Fleet:
    if scenario not in _FLEETS:
        _FLEETS[scenario] = build_fleet(get_scenario(scenario).cluster())
    return _FLEETS[scenario]


def workload_of(scenario: str, requests: int, seed: int, *, oracle: bool) -> list[SimRequest]:
    fleet = fleet_of(scenario)
    return generate_workload(
        "sharegpt", requests, math.inf, seed, fleet.max_model_len(), send_max_tokens=oracle
    )


def check_oracle(workload: Sequence[SimRequest], plain: Sequence[SimRequest], model: str) -> int:
    """Number of requests whose oracle prediction differs from the truth (must be 0)."""
    pred = build_predictor("mean", ORACLE_PARAMS, 0)
    bad = 0
    for req, ref in zip(workload, plain, strict=True):
        same = (req.input_tokens, req.output_tokens) == (ref.input_tokens, ref.output_tokens)
        if not same or pred.predict(model, req.input_tokens, req.max_tokens) != req.output_tokens:
            bad += 1
    return bad


def cost_matrix(fleet: Fleet, workload: Sequence[SimRequest], capacity: Sequence[int]) -> np.ndarray:
    """T_r^s (seconds, true output lengths) for every request r (rows) and instance s (columns)."""
    models = BackendModels(fleet.backends, default_prior(), log_fallbacks=False)
    idx = np.arange(len(fleet.backends))
    cap = np.array(capacity, dtype=np.float64)
    return np.array([models.amortised_request_s(idx, r.input_tokens, r.output_tokens, cap) for r in workload])


def lpt_assignment(costs: np.ndarray, factors: Sequence[float]) -> np.ndarray:
    """Longest-first list scheduling on unrelated machines with costs ``costs[r, s] · factors[s]``."""
    c = costs * np.asarray(factors)[None, :]
    order = np.argsort(-c.min(axis=1), kind="stable")
    load = np.zeros(c.shape[1])
    out = np.zeros(c.shape[0], dtype=np.int64)
    for r in order:
        s = int(np.argmin(load + c[r]))
        out[r] = s
        load[s] += c[r, s]
    return out


def execute(task: Task) -> dict[str, Any]:
    """Run one task (in a worker process) and summarise it."""
    logging.disable(logging.WARNING)
    fleet = fleet_of(task.scenario)
    names = [b.name for b in fleet.backends]
    oracle = task.kind in ("oracle", "offline", "offline_lf")
    workload = workload_of(task.scenario, task.requests, task.seed, oracle=oracle)
    row: dict[str, Any] = {"scenario": task.scenario, "seed": task.seed, "kind": task.kind}
    row.update({"label": task.label, "backend": task.backend, "iteration": task.iteration})
    if task.kind == "default":
        r = run_simulation(fleet, workload, "default", {}, seed=task.seed)
    elif task.kind == "oracle":
        plain = workload_of(task.scenario, task.requests, task.seed, oracle=False)
        row["oracle_mismatches"] = check_oracle(workload, plain, fleet.default_model)
        r = run_simulation(
            fleet, workload, "default", {}, predictor="mean", predictor_params=ORACLE_PARAMS, seed=task.seed
        )
    elif task.kind in ("standalone", "share"):
        if task.prefix is not None:
            workload = workload[: task.prefix]
        r = run_simulation(fleet, workload, "single", {"backend": task.backend}, seed=task.seed)
    else:
        capacity = [int(v) for v in task.extra["capacity"]]  # type: ignore[attr-defined]
        costs = cost_matrix(fleet, workload, capacity)
        assign = lpt_assignment(costs, task.factors)
        policy = ReplayPolicy({q.request_id: int(assign[k]) for k, q in enumerate(workload)})
        if task.kind == "offline_lf":
            workload = sorted(workload, key=lambda q: -q.output_tokens)
        r = run_simulation(
            fleet, workload, policy, predictor="mean", predictor_params=ORACLE_PARAMS, seed=task.seed
        )
        row["factors"] = list(task.factors)
    row["throughput_tokens_s"] = r.throughput_tokens_per_s
    row["makespan_s"] = r.makespan_s
    row["completed"] = r.completed
    row["instances"] = [
        {
            "name": i.name,
            "requests": i.requests,
            "completion_time_s": i.completion_time_s,
            "kv_capacity_tokens": i.kv_capacity_tokens,
            "tokens": i.input_tokens + i.output_tokens,
        }
        for i in r.instances
    ]
    if task.kind in ("standalone", "share"):
        row["instances"] = [x for x in row["instances"] if x["name"] == task.backend]
    if task.kind not in ("standalone", "share") and names != [x["name"] for x in row["instances"]]:
        raise RuntimeError("instance order differs from the fleet")
    return row


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _run(pool: ProcessPoolExecutor, tasks: Sequence[Task]) -> list[dict[str, Any]]:
    started = time.perf_counter()
    rows = list(pool.map(execute, tasks))
    print(f"  {len(tasks)} runs in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return rows


def _finish_factors(row: Mapping[str, Any], factors: Sequence[float]) -> tuple[float, ...]:
    """Refinement: scale each instance's cost by √(its finish time / the mean finish time) (damped)."""
    finish = [max(i["completion_time_s"], 1e-9) for i in row["instances"]]
    mean = statistics.fmean(finish)
    return tuple(f * math.sqrt(t / mean) for f, t in zip(factors, finish, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--scenarios", default="paper-b,mixed")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    scenarios = [x for x in args.scenarios.split(",") if x]
    n = args.requests
    started = time.perf_counter()
    keys = [(sc, sd) for sc in scenarios for sd in seeds]
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        phase1 = [Task(sc, sd, n, "default", "default (online)") for sc, sd in keys]
        phase1 += [Task(sc, sd, n, "oracle", "default (oracle)") for sc, sd in keys]
        for sc, sd in keys:
            for b in fleet_of(sc).backends:
                phase1.append(Task(sc, sd, n, "standalone", f"standalone {b.name}", backend=b.name))
        rows += _run(pool, phase1)
        alone: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for row in rows:
            if row["kind"] == "standalone":
                alone.setdefault((row["scenario"], row["seed"]), {})[row["backend"]] = row
        phase2: list[Task] = []
        extras: dict[tuple[str, int], dict[str, object]] = {}
        factors: dict[tuple[str, int], tuple[float, ...]] = {}
        for sc, sd in keys:
            per = alone[(sc, sd)]
            total = sum(r["throughput_tokens_s"] for r in per.values())
            for name, r in per.items():
                m = max(1, round(n * r["throughput_tokens_s"] / total))
                phase2.append(Task(sc, sd, n, "share", f"share-sized {name}", backend=name, prefix=m))
            fleet = fleet_of(sc)
            names = [b.name for b in fleet.backends]
            capacity = [per[b]["instances"][0]["kv_capacity_tokens"] for b in names]
            extras[(sc, sd)] = {"capacity": capacity}
            workload = workload_of(sc, n, sd, oracle=True)
            sums = cost_matrix(fleet, workload, capacity).sum(axis=0)
            factors[(sc, sd)] = tuple(
                per[b]["makespan_s"] / float(s) for b, s in zip(names, sums, strict=True)
            )
        offline = [
            Task(sc, sd, n, "offline", "offline LPT", factors=factors[(sc, sd)], extra=extras[(sc, sd)])
            for sc, sd in keys
        ]
        rows += _run(pool, phase2 + offline)
        for it in range(1, args.iterations + 1):
            last = {
                (r["scenario"], r["seed"]): r
                for r in rows
                if r["kind"] == "offline" and r["iteration"] == it - 1
            }
            tasks = []
            for key in keys:
                factors[key] = _finish_factors(last[key], factors[key])
                tasks.append(
                    Task(
                        *key,
                        n,
                        "offline",
                        "offline LPT",
                        factors=factors[key],
                        iteration=it,
                        extra=extras[key],
                    )
                )
            rows += _run(pool, tasks)
        best: dict[tuple[str, int], dict[str, Any]] = {}
        for r in rows:
            if r["kind"] == "offline":
                key = (r["scenario"], r["seed"])
                if key not in best or r["throughput_tokens_s"] > best[key]["throughput_tokens_s"]:
                    best[key] = r
        lf = [
            Task(
                *key,
                n,
                "offline_lf",
                "offline LPT, longest first",
                factors=tuple(best[key]["factors"]),
                extra=extras[key],
            )
            for key in keys
        ]
        rows += _run(pool, lf)
    meta = {
        "requests": n,
        "seeds": seeds,
        "scenarios": scenarios,
        "iterations": args.iterations,
        "runs": len(rows),
        "wall_s": time.perf_counter() - started,
        "machine": f"{platform.platform()}, {args.workers} worker processes",
    }
    summary = summarise(rows, keys)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity_bound.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1, default=float) + "\n"
    )
    (args.out / "capacity_bound.md").write_text(markdown(summary, meta))
    print(markdown(summary, meta))
    return 0


def _spread(row: Mapping[str, Any]) -> float:
    finish = [i["completion_time_s"] for i in row["instances"] if i["requests"] > 0]
    return max(finish) - min(finish) if finish else 0.0


def summarise(rows: Sequence[Mapping[str, Any]], keys: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """Per scenario: the bounds and, per configuration, throughput and its fraction of each bound."""
    out: dict[str, Any] = {}
    for scenario in dict.fromkeys(sc for sc, _ in keys):
        seeds = [sd for sc, sd in keys if sc == scenario]
        bound: dict[int, float] = {}
        share: dict[int, float] = {}
        alone: dict[str, list[float]] = {}
        shares: dict[str, list[float]] = {}
        confs: dict[str, dict[int, Mapping[str, Any]]] = {}
        for r in rows:
            if r["scenario"] != scenario:
                continue
            sd = r["seed"]
            if r["kind"] == "standalone":
                bound[sd] = bound.get(sd, 0.0) + r["throughput_tokens_s"]
                alone.setdefault(r["backend"], []).append(r["throughput_tokens_s"])
            elif r["kind"] == "share":
                share[sd] = share.get(sd, 0.0) + r["throughput_tokens_s"]
                shares.setdefault(r["backend"], []).append(r["throughput_tokens_s"])
            else:
                label = "offline LPT (best round)" if r["kind"] == "offline" else r["label"]
                cur = confs.setdefault(label, {}).get(sd)
                if cur is None or r["throughput_tokens_s"] > cur["throughput_tokens_s"]:
                    confs[label][sd] = r
                if r["kind"] == "offline":
                    confs.setdefault(f"offline LPT round {r['iteration']}", {})[sd] = r
        table = {}
        for label, per in confs.items():
            thr = [per[sd]["throughput_tokens_s"] for sd in seeds]
            entry: dict[str, Any] = {
                "throughput_tokens_s": _mean_sd(thr),
                "fraction_of_bound": _mean_sd([per[sd]["throughput_tokens_s"] / bound[sd] for sd in seeds]),
                "fraction_of_share_bound": _mean_sd(
                    [per[sd]["throughput_tokens_s"] / share[sd] for sd in seeds]
                ),
                "finish_spread_s": _mean_sd([_spread(per[sd]) for sd in seeds]),
                "makespan_s": _mean_sd([per[sd]["makespan_s"] for sd in seeds]),
                "requests_per_instance": {
                    i["name"]: statistics.fmean(
                        [
                            next(x["requests"] for x in per[sd]["instances"] if x["name"] == i["name"])
                            for sd in seeds
                        ]
                    )
                    for i in per[seeds[0]]["instances"]
                },
            }
            if "oracle_mismatches" in per[seeds[0]]:
                entry["oracle_mismatches"] = sum(int(per[sd]["oracle_mismatches"]) for sd in seeds)
            table[label] = entry
        out[scenario] = {
            "capacity_bound_tokens_s": _mean_sd([bound[sd] for sd in seeds]),
            "share_bound_tokens_s": _mean_sd([share[sd] for sd in seeds]),
            "standalone_tokens_s": {b: _mean_sd(v) for b, v in alone.items()},
            "share_sized_tokens_s": {b: _mean_sd(v) for b, v in shares.items()},
            "share_sized_requests": {
                b: statistics.fmean(
                    [
                        r["instances"][0]["requests"]
                        for r in rows
                        if r["scenario"] == scenario and r["kind"] == "share" and r["backend"] == b
                    ]
                )
                for b in shares
            },
            "configurations": table,
        }
    return out


def markdown(summary: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    lines = [
        "# Is 95 % of the capacity bound reachable? (simulator, rate ∞)",
        "",
        f"{meta['requests']} ShareGPT-like requests, all at t = 0, seeds {meta['seeds']}, "
        "mean ± sd over seeds; "
        f"{meta['runs']} simulations in {meta['wall_s']:.0f} s ({meta['machine']}). "
        "Capacity bound = Σ each instance's standalone throughput on all requests; share-sized bound = Σ "
        "each instance alone on the first n·thr_s/Σthr requests. `benchmarks/capacity_bound.py` "
        "explains each configuration.",
        "",
    ]
    for scenario, s in summary.items():
        b, sb = s["capacity_bound_tokens_s"], s["share_bound_tokens_s"]
        lines += [
            f"## {scenario}",
            "",
            f"Capacity bound {b[0]:.0f} ± {b[1]:.0f} tok/s; "
            f"share-sized bound {sb[0]:.0f} ± {sb[1]:.0f} tok/s.",
            "",
            "| instance | standalone, all requests tok/s | share-sized requests "
            "| standalone, share tok/s | share / all |",
            "|---|---|---|---|---|",
        ]
        for name, (m, _) in s["standalone_tokens_s"].items():
            sm = s["share_sized_tokens_s"][name][0]
            lines.append(
                f"| {name} | {m:.0f} | {s['share_sized_requests'][name]:.0f} | {sm:.0f} | {sm / m:.1%} |"
            )
        lines += [
            "",
            "| configuration | tok/s | % bound | % share bound | finish spread s | makespan s |",
            "|---|---|---|---|---|---|",
        ]
        for label, e in s["configurations"].items():
            t, f, fs, sp, mk = (
                e["throughput_tokens_s"],
                e["fraction_of_bound"],
                e["fraction_of_share_bound"],
                e["finish_spread_s"],
                e["makespan_s"],
            )
            note = f" (oracle mismatches: {e['oracle_mismatches']})" if "oracle_mismatches" in e else ""
            lines.append(
                f"| {label}{note} | {t[0]:.0f} ± {t[1]:.0f} | {f[0]:.1%} ± {f[1]:.1%} | {fs[0]:.1%} | "
                f"{sp[0]:.1f} | {mk[0]:.1f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
