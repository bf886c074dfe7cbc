"""The policy benchmark: method.md §8 A and B plus the ``mixed`` fleet, in the simulator.

Usage: ``python benchmarks/policies.py [--requests 4000] [--seeds 1,2,3] [--rates 8,16,24,inf]
[--scenarios paper-a,paper-b,mixed] [--workers 2] [--quick] [--out benchmarks/results]``.

Every run goes through :func:`hetroute.simulation.simulator.run_simulation`, i.e. what ``hetroute simulate``
runs: the real Router, policy, Ledger and predictor in virtual time against the engine model.
For each scenario and seed one ShareGPT-like workload is drawn (same lengths at every rate) and:

- the policy matrix: RR, SI, MB, OS (θ = 2), hand-tuned WRR, least outstanding, capacity_weighted,
  the paper's exact formula next to our variants (no latency floor; the floor without its prefill
  terms, i.e. the previous default), and ``default``; at 8, 16, 24 req/s and ∞;
- the capacity bound: each instance alone (``single``) on the same workload at rate ∞; the bound is
  the sum of those standalone saturated throughputs;
- on paper-a, a θ sweep of ``workload_minmax`` and a predictor sweep (normal / mean / online).

Hand-tuned WRR weights follow the paper's rule ("4× the GPU resources" → 4:1) generalised to any
fleet: weight = TP degree × the GPU's dense FP16 TFLOP/s (paper-a 4:1; paper-b 250:312; mixed by
compute). Reported per (scenario, policy, rate), mean ± sd over seeds: throughput ((input+output
tokens)/makespan), ratio to RR, p99 TTFT, per-instance completion-time imbalance (latest − earliest
instance finish, over instances that served requests), and at ∞ the fraction of the capacity bound.
``policies.md`` opens with the goal's comparison: the default against the best of WRR, OS and
least_outstanding (throughput) and the lowest p99 TTFT of any matrix policy. Writes ``policies.json``,
``policies.md`` and ``policies_<scenario>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MIN_SHARE = 0.02
"""Instances that served fewer than this share of the requests are left out of the imbalance."""
Params = Mapping[str, object]


@dataclass(frozen=True)
class Task:
    """One simulation: scenario, seed, rate, a policy (label, name, params) and a predictor."""

    group: str
    scenario: str
    seed: int
    rate: float
    requests: int
    label: str
    policy: str
    params: Params = field(default_factory=dict)
    predictor: str = "online"
    predictor_params: Params = field(default_factory=dict)
    prefix: int | None = None


_FLEETS: dict[str, Any] = {}


def _fleet(scenario: str) -> Any:
    from hetroute.sim.cluster_file import build_fleet
    from hetroute.sim.scenarios import get_scenario

    if scenario not in _FLEETS:
        _FLEETS[scenario] = build_fleet(get_scenario(scenario).cluster())
    return _FLEETS[scenario]


def hand_weights(scenario: str) -> list[float]:
    """TP × dense FP16 TFLOP/s per instance: the paper's "GPU resources" rule (paper-a: 4:1)."""
    from hetroute.catalog.specs import load_gpu_catalog

    gpus = load_gpu_catalog()
    fleet = _fleet(scenario)
    return [float((b.tp or 1) * gpus[b.gpu].fp16_tflops) for b in fleet.backends]


def execute(task: Task) -> dict[str, Any]:
    """Run one task (in a worker process) and summarise it as plain numbers."""
    logging.disable(logging.WARNING)
    from hetroute.sim.workload import generate_workload
    from hetroute.simulation.simulator import run_simulation

    fleet = _fleet(task.scenario)
    workload = generate_workload("sharegpt", task.requests, task.rate, task.seed, fleet.max_model_len())
    if task.prefix is not None:
        workload = workload[: task.prefix]
    r = run_simulation(
        fleet,
        workload,
        task.policy,
        dict(task.params),
        predictor=task.predictor,
        predictor_params=dict(task.predictor_params),
        seed=task.seed,
        label=task.label,
    )
    finishes = [i.completion_time_s for i in r.instances if i.requests >= MIN_SHARE * task.requests]
    imbalance = max(finishes) - min(finishes) if finishes else 0.0
    return {
        "group": task.group,
        "scenario": task.scenario,
        "seed": task.seed,
        "rate": "inf" if math.isinf(task.rate) else f"{task.rate:g}",
        "label": task.label,
        "policy": task.policy,
        "params": {k: v for k, v in task.params.items()},
        "predictor": task.predictor,
        "predictor_params": dict(task.predictor_params),
        "throughput_tokens_s": r.throughput_tokens_per_s,
        "makespan_s": r.makespan_s,
        "ttft_p50_s": r.percentile("ttft", 50),
        "ttft_p99_s": r.percentile("ttft", 99),
        "e2e_p99_s": r.percentile("e2e", 99),
        "imbalance_s": imbalance,
        "imbalance_frac": imbalance / r.makespan_s if r.makespan_s > 0 else 0.0,
        "completed": r.completed,
        "ledger_zero": r.ledger_zero,
        "instances": [
            {"name": i.name, "requests": i.requests, "completion_time_s": i.completion_time_s}
            for i in r.instances
        ],
    }


def matrix_policies(scenario: str) -> list[tuple[str, str, dict[str, object]]]:
    return [
        ("RR", "round_robin", {}),
        ("SI", "single", {}),
        ("MB", "memory_minmax", {}),
        ("OS θ=2 (workload_minmax)", "workload_minmax", {}),
        ("WRR by GPU FLOPs (paper-a: 4:1)", "weighted_round_robin", {"weights": hand_weights(scenario)}),
        ("least_outstanding", "least_outstanding", {}),
        ("capacity_weighted", "capacity_weighted", {}),
        ("balanced_minmax, no latency floor", "balanced_minmax", {"latency_floor": False}),
        (
            "balanced_minmax, floor without prefill terms",
            "balanced_minmax",
            {"prefill_queue": False, "ttft_weight": 0.0},
        ),
        ("default", "default", {}),
    ]


def build_tasks(args: argparse.Namespace) -> list[Task]:
    tasks: list[Task] = []
    for scenario in args.scenarios:
        names = [b.name for b in _fleet(scenario).backends]
        for seed in args.seeds:
            for rate in args.rates:
                for label, name, params in matrix_policies(scenario):
                    tasks.append(Task("matrix", scenario, seed, rate, args.requests, label, name, params))
            for backend in names:
                tasks.append(
                    Task(
                        "bound",
                        scenario,
                        seed,
                        math.inf,
                        args.requests,
                        backend,
                        "single",
                        {"backend": backend},
                    )
                )
            if scenario != "paper-a" or args.quick:
                continue
            for rate in args.rates:
                for theta in (0.5, 1.0, 4.0, 8.0):
                    label = f"OS θ={theta:g}"
                    params = {"theta": theta}
                    tasks.append(
                        Task("theta", scenario, seed, rate, args.requests, label, "workload_minmax", params)
                    )
                for pred, pparams, plabel in (
                    ("normal", {"mean_tokens": 200.0, "std_tokens": 125.0}, "normal (paper)"),
                    ("mean", {}, "mean"),
                    ("online", {"statistic": "mean"}, "online mean"),
                    ("online", {"quantile": 0.75}, "online q=0.75"),
                ):
                    for label, name in (("OS θ=2", "workload_minmax"), ("default", "default")):
                        tasks.append(
                            Task(
                                "predictor",
                                scenario,
                                seed,
                                rate,
                                args.requests,
                                f"{label} · {plabel}",
                                name,
                                {},
                                pred,
                                pparams,
                            )
                        )
    return tasks


def _progress(results: Iterator[dict[str, Any]], total: int) -> list[dict[str, Any]]:
    out = []
    for row in results:
        out.append(row)
        if len(out) % 50 == 0:
            print(f"  {len(out)}/{total} runs", file=sys.stderr, flush=True)
    return out


def share_tasks(rows: Sequence[dict[str, Any]], requests: int) -> list[Task]:
    """Each instance alone on the share of the workload it would get in a throughput-balanced split.

    That share ends with the same drain tail (the last, lone long requests at a small batch) that every
    instance of a fleet has; the 4000-request standalone run amortises its tail over 5-20× more work.
    """
    tasks = []
    keyed: dict[tuple[str, int], dict[str, float]] = {}
    for row in rows:
        if row["group"] == "bound":
            keyed.setdefault((row["scenario"], row["seed"]), {})[row["label"]] = row["throughput_tokens_s"]
    for (scenario, seed), per in sorted(keyed.items()):
        total = sum(per.values())
        for backend, thr in per.items():
            n = max(1, round(requests * thr / total))
            tasks.append(
                Task(
                    "share_bound",
                    scenario,
                    seed,
                    math.inf,
                    requests,
                    backend,
                    "single",
                    {"backend": backend},
                    prefix=n,
                )
            )
    return tasks


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean/sd over seeds per (group, scenario, label, rate), ratios to RR and to the bound."""
    keyed: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        keyed.setdefault((row["group"], row["scenario"], row["label"], row["rate"]), []).append(row)
    bounds: dict[str, tuple[float, float]] = {}
    share_bounds: dict[str, tuple[float, float]] = {}
    per_seed: dict[tuple[str, str, int], float] = {}
    for row in rows:
        if row["group"] in ("bound", "share_bound"):
            key = (row["group"], row["scenario"], row["seed"])
            per_seed[key] = per_seed.get(key, 0.0) + row["throughput_tokens_s"]
    for group, target in (("bound", bounds), ("share_bound", share_bounds)):
        for scenario in {s for g, s, _ in per_seed if g == group}:
            target[scenario] = _mean_sd(
                [v for (g, s, _), v in per_seed.items() if g == group and s == scenario]
            )
    standalone: dict[str, dict[str, float]] = {}
    for (group, scenario, label, _), items in keyed.items():
        if group == "bound":
            standalone.setdefault(scenario, {})[label] = _mean_sd([r["throughput_tokens_s"] for r in items])[
                0
            ]
    out: list[dict[str, Any]] = []
    for (group, scenario, label, rate), items in sorted(keyed.items()):
        if group in ("bound", "share_bound"):
            continue
        thr = _mean_sd([r["throughput_tokens_s"] for r in items])
        rr = keyed.get(("matrix", scenario, "RR", rate))
        rr_thr = _mean_sd([r["throughput_tokens_s"] for r in rr])[0] if rr else math.nan
        entry = {
            "group": group,
            "scenario": scenario,
            "label": label,
            "policy": items[0]["policy"],
            "params": items[0]["params"],
            "predictor": items[0]["predictor"],
            "rate": rate,
            "seeds": len(items),
            "throughput_tokens_s": thr[0],
            "throughput_sd": thr[1],
            "ratio_to_rr": thr[0] / rr_thr if rr_thr > 0 else math.nan,
            "ttft_p99_s": _mean_sd([r["ttft_p99_s"] for r in items])[0],
            "ttft_p50_s": _mean_sd([r["ttft_p50_s"] for r in items])[0],
            "imbalance_s": _mean_sd([r["imbalance_s"] for r in items])[0],
            "imbalance_frac": _mean_sd([r["imbalance_frac"] for r in items])[0],
            "ledger_zero": all(r["ledger_zero"] for r in items),
            "instances_last_seed": items[-1]["instances"],
        }
        if rate == "inf" and scenario in bounds:
            entry["fraction_of_bound"] = thr[0] / bounds[scenario][0]
        if rate == "inf" and scenario in share_bounds:
            entry["fraction_of_share_bound"] = thr[0] / share_bounds[scenario][0]
        out.append(entry)
    return {
        "capacity_bound_tokens_s": {s: {"mean": m, "sd": sd} for s, (m, sd) in bounds.items()},
        "share_bound_tokens_s": {s: {"mean": m, "sd": sd} for s, (m, sd) in share_bounds.items()},
        "standalone_tokens_s": standalone,
        "summary": out,
    }


GOAL_BASELINES = ("WRR by GPU FLOPs (paper-a: 4:1)", "OS θ=2 (workload_minmax)", "least_outstanding")
"""The baselines the goal names: the default must match the best of them at every rate."""


def goal_table(agg: Mapping[str, Any]) -> list[str]:
    """Default vs the best goal baseline (throughput) and vs the lowest p99 TTFT of any matrix policy."""
    rows = [e for e in agg["summary"] if e["group"] == "matrix"]
    lines = [
        "",
        "## Default against the goal",
        "",
        "| scenario | rate | default tok/s | best baseline tok/s | default / best | default p99 TTFT s "
        "| lowest p99 TTFT s (policy) |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {"8": 0, "16": 1, "24": 2, "inf": 3}
    cells = sorted({(e["scenario"], e["rate"]) for e in rows}, key=lambda k: (k[0], order.get(k[1], 9)))
    for scenario, rate in cells:
        here = [e for e in rows if e["scenario"] == scenario and e["rate"] == rate]
        default = next((e for e in here if e["label"] == "default"), None)
        base = [e for e in here if e["label"] in GOAL_BASELINES]
        if default is None or not base:
            continue
        best = max(base, key=lambda e: e["throughput_tokens_s"])
        low = min(e["ttft_p99_s"] for e in here)
        who = ", ".join(e["label"] for e in here if e["ttft_p99_s"] <= low + 5e-4)
        lines.append(
            f"| {scenario} | {rate} | {default['throughput_tokens_s']:.0f} ± {default['throughput_sd']:.0f} "
            f"| {best['throughput_tokens_s']:.0f} ± {best['throughput_sd']:.0f} ({best['label']}) "
            f"| {default['throughput_tokens_s'] / best['throughput_tokens_s']:.3f} "
            f"| {default['ttft_p99_s']:.3f} | {low:.3f} ({who}) |"
        )
    return lines


def markdown(agg: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    lines = [
        "# Policy benchmark (simulator)",
        "",
        f"{meta['requests']} ShareGPT-like requests per run, seeds {meta['seeds']}, mean ± sd over seeds. "
        f"Machine: {meta['machine']['cpus']} CPU cores, no GPU ({meta['machine']['platform']}); "
        f"{meta['runs']} simulations in {meta['elapsed_s']:.0f} s.",
        "Throughput = (input + output tokens) / makespan. Imbalance = latest − earliest finish among the "
        f"instances that served ≥ {MIN_SHARE:.0%} of the requests. Capacity bound = Σ each instance's "
        "standalone throughput on the whole workload at rate ∞; share-sized bound = Σ each instance's "
        "standalone throughput on the share of the workload a throughput-proportional split gives it.",
        "",
    ]
    for scenario, bound in sorted(agg["capacity_bound_tokens_s"].items()):
        parts = ", ".join(f"{k} {v:.0f}" for k, v in agg["standalone_tokens_s"].get(scenario, {}).items())
        share = agg["share_bound_tokens_s"].get(scenario, {}).get("mean", math.nan)
        lines.append(
            f"- **{scenario}** capacity bound {bound['mean']:.0f} tok/s (standalone at ∞ on all "
            f"{meta['requests']} requests: {parts}); share-sized bound {share:.0f} tok/s"
        )
    lines += goal_table(agg)
    for group, title in (
        ("matrix", "Policies"),
        ("theta", "θ sweep (paper-a)"),
        ("predictor", "Predictors (paper-a)"),
    ):
        rows = [e for e in agg["summary"] if e["group"] == group]
        if not rows:
            continue
        lines += [
            "",
            f"## {title}",
            "",
            "| scenario | policy | rate | throughput tok/s | ×RR | p99 TTFT s | imbalance s (% makespan) "
            "| % bound | % share bound |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        order = {"8": 0, "16": 1, "24": 2, "inf": 3}
        for e in sorted(rows, key=lambda e: (e["scenario"], order.get(e["rate"], 9), e["label"])):
            bound = f"{e['fraction_of_bound']:.1%}" if "fraction_of_bound" in e else ""
            share = f"{e['fraction_of_share_bound']:.1%}" if "fraction_of_share_bound" in e else ""
            lines.append(
                f"| {e['scenario']} | {e['label']} | {e['rate']} | {e['throughput_tokens_s']:.0f} ± "
                f"{e['throughput_sd']:.0f} | {e['ratio_to_rr']:.3f} | {e['ttft_p99_s']:.3f} | "
                f"{e['imbalance_s']:.1f} ({e['imbalance_frac']:.1%}) | {bound} | {share} |"
            )
    return "\n".join(lines) + "\n"


def plot(agg: Mapping[str, Any], out: Path) -> list[str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    rows = [e for e in agg["summary"] if e["group"] == "matrix"]
    order = ["8", "16", "24", "inf"]
    for scenario in sorted({e["scenario"] for e in rows}):
        fig = Figure(figsize=(14, 4.2))
        FigureCanvasAgg(fig)
        ax_t, ax_l, ax_i = fig.subplots(1, 3)
        labels = sorted({e["label"] for e in rows if e["scenario"] == scenario})
        for label in labels:
            pts = {e["rate"]: e for e in rows if e["scenario"] == scenario and e["label"] == label}
            rates = [r for r in order if r in pts]
            xs = list(range(len(rates)))
            style = {"linewidth": 2.5} if label == "default" else {"linewidth": 1.0}
            ax_t.errorbar(
                xs,
                [pts[r]["throughput_tokens_s"] for r in rates],
                [pts[r]["throughput_sd"] for r in rates],
                label=label,
                marker="o",
                **style,
            )
            ax_l.plot(xs, [pts[r]["ttft_p99_s"] for r in rates], marker="o", **style)
            ax_i.plot(xs, [pts[r]["imbalance_s"] for r in rates], marker="o", **style)
        bound = agg["capacity_bound_tokens_s"].get(scenario)
        if bound:
            ax_t.axhline(bound["mean"], color="grey", linestyle="--", label="capacity bound")
        for ax, title in (
            (ax_t, "throughput (tok/s)"),
            (ax_l, "p99 TTFT (s, log)"),
            (ax_i, "completion-time imbalance (s)"),
        ):
            ax.set_xticks(range(len(order)), order)
            ax.set_xlabel("request rate (req/s)")
            ax.set_title(f"{scenario}: {title}")
        ax_l.set_yscale("log")
        ax_t.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"policies_{scenario}.png"
        fig.savefig(path, dpi=110)
        written.append(str(path))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--rates", default="8,16,24,inf")
    ap.add_argument("--scenarios", default="paper-a,paper-b,mixed")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true", help="no θ/predictor sweeps")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    tasks = build_tasks(args)
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        rows = _progress(pool.map(execute, tasks, chunksize=4), len(tasks))
        shares = share_tasks(rows, args.requests)
        rows += _progress(pool.map(execute, shares), len(shares))
    elapsed = time.perf_counter() - started
    agg = aggregate(rows)
    meta = {
        "benchmark": "policies",
        "requests": args.requests,
        "seeds": args.seeds,
        "rates": ["inf" if math.isinf(r) else f"{r:g}" for r in args.rates],
        "scenarios": args.scenarios,
        "runs": len(rows),
        "elapsed_s": elapsed,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "gpu": None,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {**meta, **agg, "runs_detail": rows}
    text = json.dumps(_clean(doc), indent=1)
    (args.out / "policies.json").write_text(text + "\n", encoding="utf-8")
    table = markdown(agg, meta)
    (args.out / "policies.md").write_text(table, encoding="utf-8")
    plots = plot(agg, args.out)
    print(table)
    print("wrote", ", ".join([str(args.out / "policies.json"), str(args.out / "policies.md"), *plots]))
    return 0


def _clean(x: Any) -> Any:
    """JSON-safe copy: NaN/inf become null."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


if __name__ == "__main__":
    raise SystemExit(main())
