"""Does ``tune-deploy`` rank TP configurations as the simulator measures them? (issue: "How we know it works")

For every machine of a cluster file and every feasible TP degree, the ground truth is the simulator's engine
model (roofline step times, vLLM V1 scheduling, lazy KV with preemption) serving the whole request sample at
saturation (rate ∞), requests dealt round-robin over the machine's instances
(:func:`hetroute.tuner.groundtruth.measure_machine`). The two estimates are ``tune-deploy``'s: the paper's
Algorithm 1 (fixed) and the iteration-level continuous-batching estimate, both driven by the fitted p1..p8
(roofline prior profiles). Reports per machine Kendall's τ for both estimators and whether the chosen TP is
the measured best. Run::

    python benchmarks/tune_deploy_ranking.py            # paper C (+ sensitivity variants) and the mixed fleet
    python benchmarks/tune_deploy_ranking.py --quick    # paper C only

Writes benchmarks/results/tune_deploy_ranking.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog
from hetroute.commands.tune_deploy import sample_requests, tuning_prior
from hetroute.tuner.cluster import ClusterSpec, load_cluster
from hetroute.tuner.groundtruth import kendall_tau, measure_machine
from hetroute.tuner.tune import tune

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"


def evaluate(label: str, cluster: ClusterSpec, duplicates: int | None = None) -> dict[str, Any]:
    """Tune ``cluster``, measure every feasible (machine kind, TP) and compare the rankings."""
    workload, requests = sample_requests(cluster, None, None, duplicates, None)
    start = time.perf_counter()
    result = tune(cluster, requests, tuning_prior(cluster.engine), workload=workload)
    tune_s = time.perf_counter() - start
    seen: set[tuple[str, int, str]] = set()
    machines = []
    for plan in result.plans:
        m = plan.machine
        key = (m.gpu.name, m.gpus, m.model_key)
        if key in seen:
            continue
        seen.add(key)
        model = cluster.models[m.model_key]
        rows = []
        gt_start = time.perf_counter()
        for e in sorted((e for e in plan.options if e.feasible), key=lambda e: e.tp):
            truth = measure_machine(m.gpu, model, e.tp, e.instances, requests, cluster.engine)
            rows.append(
                {
                    "tp": e.tp,
                    "instances": e.instances,
                    "measured_tokens_per_s": round(truth.tokens_per_s, 1),
                    "measured_preemptions": truth.preemptions,
                    "algorithm1_tokens_per_s": round(e.algorithm1_tokens_per_s or 0.0, 1),
                    "iteration_tokens_per_s": round(e.iteration_tokens_per_s or 0.0, 1),
                    "iteration_error": round((e.iteration_tokens_per_s or 0.0) / truth.tokens_per_s - 1.0, 4),
                }
            )
        gt_s = time.perf_counter() - gt_start
        measured = [r["measured_tokens_per_s"] for r in rows]

        def order(key: str, rows: list[dict[str, Any]] = rows) -> list[int]:
            return [r["tp"] for r in sorted(rows, key=lambda r: -r[key])]

        entry: dict[str, Any] = {
            "machine": m.name,
            "gpu": m.gpu.name,
            "gpus": m.gpus,
            "model": model.name,
            "infeasible": {e.tp: e.reason for e in plan.options if not e.feasible},
            "rows": rows,
            "measured_order": order("measured_tokens_per_s"),
            "algorithm1_order": order("algorithm1_tokens_per_s"),
            "iteration_order": order("iteration_tokens_per_s"),
            "chosen_tp": plan.chosen.tp if plan.chosen else None,
            "ground_truth_s": round(gt_s, 2),
        }
        if len(rows) >= 2:
            entry["tau_algorithm1"] = kendall_tau([r["algorithm1_tokens_per_s"] for r in rows], measured)
            entry["tau_iteration"] = kendall_tau([r["iteration_tokens_per_s"] for r in rows], measured)
        entry["chosen_is_measured_best"] = entry["chosen_tp"] == entry["measured_order"][0]
        machines.append(entry)
    return {
        "label": label,
        "cluster": cluster.source,
        "workload": workload,
        "requests": len(requests),
        "engine": {
            "max_num_seqs": cluster.engine.max_num_seqs,
            "max_num_batched_tokens": cluster.engine.batched_tokens(),
            "overhead_gib_per_gpu": cluster.engine.overhead_gib_per_gpu,
            "gpu_memory_utilization": cluster.engine.gpu_memory_utilization,
        },
        "tune_s": round(tune_s, 3),
        "machines": machines,
    }


def _markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["# tune-deploy ranking vs the simulator's measurement", ""]
    lines.append(f"Host: {platform.node()} ({platform.machine()}), Python {platform.python_version()}.")
    lines.append("Throughputs in tokens/s per machine ((input + output) / makespan, rate ∞, round-robin).")
    lines.append("")
    for run in runs:
        eng = run["engine"]
        lines.append(f"## {run['label']}")
        lines.append("")
        lines.append(
            f"`{run['cluster']}`, {run['workload']} ({run['requests']} requests), "
            f"max_num_seqs {eng['max_num_seqs']}, max_num_batched_tokens {eng['max_num_batched_tokens']}, "
            f"δ_engine {eng['overhead_gib_per_gpu']} GiB/GPU; tune-deploy took {run['tune_s']} s."
        )
        lines.append("")
        lines.append(
            "| machine | TP | inst | measured | Alg. 1 | iteration | iter. error | preemptions (measured) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for m in run["machines"]:
            for r in m["rows"]:
                lines.append(
                    f"| {m['machine']} ({m['gpus']}x {m['gpu']}, {m['model']}) | {r['tp']} | "
                    f"{r['instances']} | "
                    f"{r['measured_tokens_per_s']:,.0f} | {r['algorithm1_tokens_per_s']:,.0f} | "
                    f"{r['iteration_tokens_per_s']:,.0f} | {100 * r['iteration_error']:+.1f} % | "
                    f"{r['measured_preemptions']} |"
                )
        lines.append("")
        lines.append(
            "| machine | measured order | Alg. 1 order | τ Alg. 1 | iteration order | τ iteration "
            "| chosen = best |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for m in run["machines"]:

            def fmt(order: list[int]) -> str:
                return " > ".join(f"TP{t}" for t in order)

            t1 = m.get("tau_algorithm1")
            t2 = m.get("tau_iteration")
            lines.append(
                f"| {m['machine']} | {fmt(m['measured_order'])} | {fmt(m['algorithm1_order'])} | "
                f"{'-' if t1 is None else f'{t1:.2f}'} | {fmt(m['iteration_order'])} | "
                f"{'-' if t2 is None else f'{t2:.2f}'} | {'yes' if m['chosen_is_measured_best'] else 'NO'} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="paper C only")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    gpus, models = load_gpu_catalog(), load_model_catalog()
    paper_c = load_cluster(REPO / "config" / "clusters" / "paper-c.yaml", gpus, models)
    runs = [evaluate("Paper C: Llama-3-8B on 8x V100, 1,000 ShareGPT requests x 8 (method.md §8 C)", paper_c)]
    if not args.quick:
        runs.append(evaluate("Paper C variant: the 1,000 requests without duplicates", paper_c, duplicates=1))
        # the measured TP1 profile was taken at δ = 2 GiB, so this variant uses the roofline priors only
        more_overhead = replace(
            paper_c,
            engine=replace(paper_c.engine, overhead_gib_per_gpu=4.0),
            profiles={},
            profile_paths={},
        )
        runs.append(
            evaluate(
                "Paper C variant: δ_engine = 4 GiB per GPU (less KV for TP1), priors only", more_overhead
            )
        )
        fleet = load_cluster(REPO / "config" / "clusters" / "mixed-fleet.yaml", gpus, models)
        runs.append(evaluate("Mixed fleet: V100, A800, L4, H100 machines, two models", fleet))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_deploy_ranking.json").write_text(json.dumps(runs, indent=2) + "\n", encoding="utf-8")
    text = _markdown(runs)
    (args.out / "tune_deploy_ranking.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
