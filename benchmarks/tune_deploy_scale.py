"""Scale of ``tune-deploy``: a fleet of 1,000 machines of 6 GPU types (target: tuned in under 5 s).

The fleet: V100-SXM2-32GB, A100-80GB, A800-80GB-PCIe, H100-SXM, L4 and L40S machines, each type with 8-GPU and
4-GPU hosts (12 kinds of machine, 1,000 machines), serving Llama-3-8B; 1,000 ShareGPT requests. Estimates are
cached per (GPU type, GPU count, model, TP), so the cost is the distinct configurations, not the machines.
Times the whole in-process pipeline (cluster validation, request sample, roofline priors, both estimates,
the choice, the table and the JSON document), then the same with a joint constraint (min instances), which
runs the exact joint search. Run::

    python benchmarks/tune_deploy_scale.py

Writes benchmarks/results/tune_deploy_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog
from hetroute.commands.tune_deploy import sample_requests, tuning_prior
from hetroute.tuner.cluster import cluster_from_dict
from hetroute.tuner.report import render_table, result_to_json
from hetroute.tuner.tune import tune

REPO = Path(__file__).resolve().parents[1]
TYPES = ("V100-SXM2-32GB", "A100-80GB", "A800-80GB-PCIe", "H100-SXM", "L4", "L40S")


def fleet(machines: int, constraints: dict[str, Any] | None = None) -> dict[str, Any]:
    """A cluster document with ``machines`` hosts spread over TYPES × {8, 4} GPUs."""
    kinds = [(gpu, n) for gpu in TYPES for n in (8, 4)]
    per_kind = [machines // len(kinds) + (1 if k < machines % len(kinds) else 0) for k in range(len(kinds))]
    doc: dict[str, Any] = {
        "model": "Llama-3-8B",
        "machines": [
            {"name": f"{gpu.lower()}-x{n}", "gpu": gpu, "gpus": n, "count": c, "price_per_hour": 1.0 * n}
            for (gpu, n), c in zip(kinds, per_kind, strict=True)
        ],
        "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048},
        "workload": {"kind": "sharegpt", "requests": 1000},
    }
    if constraints:
        doc["constraints"] = constraints
    return doc


def timed_run(doc: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    gpus, models = load_gpu_catalog(), load_model_catalog()
    cluster = cluster_from_dict(doc, gpus, models, source="scale-fleet")
    label, requests = sample_requests(cluster, None, None, None, None)
    result = tune(cluster, requests, tuning_prior(cluster.engine), workload=label)
    table = render_table(result)
    document = result_to_json(result)
    total_s = time.perf_counter() - start
    return {
        "machines": len(cluster.machines),
        "gpu_types": len({m.gpu.name for m in cluster.machines}),
        "distinct_configs": result.distinct_configs,
        "requests": len(requests),
        "constraints": ", ".join(f"{k}={v}" for k, v in (doc.get("constraints") or {}).items()) or "none",
        "total_s": round(total_s, 3),
        "estimate_s": round(result.estimate_s, 3),
        "search_s": round(result.search.elapsed_s, 4),
        "search_mode": document["search"]["mode"],
        "total_tokens_per_s": document["total"]["tokens_per_s"],
        "instances": document["total"]["instances"],
        "table_lines": table.count("\n"),
    }


def cli_wall_s() -> float:
    """Wall time of the real command line on config/clusters/fleet-1000.yaml (Python start-up included)."""
    with tempfile.TemporaryDirectory() as tmp:
        fleet_file = str(REPO / "config" / "clusters" / "fleet-1000.yaml")
        out = str(Path(tmp) / "out.json")
        cmd = [
            sys.executable,
            "-m",
            "hetroute",
            "tune-deploy",
            "--quiet",
            "--cluster",
            fleet_file,
            "--json",
            out,
        ]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=120)
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    runs = [timed_run(fleet(args.machines))]
    runs.append(timed_run(fleet(args.machines, {"min_instances": 4 * args.machines})))
    runs.append(timed_run(fleet(args.machines, {"max_cost_per_hour": 3.0 * args.machines})))
    cli_s = cli_wall_s()
    load = os.getloadavg()[0]
    host = (
        f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), Python {platform.python_version()}"
    )
    lines = ["# tune-deploy scale", "", f"Host: {host}.", ""]
    lines.append(
        "| machines | GPU types | distinct configs | requests | constraints | choice | estimate s | search s "
        "| total s |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        lines.append(
            f"| {r['machines']} | {r['gpu_types']} | {r['distinct_configs']} | {r['requests']} "
            f"| {r['constraints']} | {r['search_mode']} | {r['estimate_s']} | {r['search_s']} "
            f"| {r['total_s']} |"
        )
    lines.append("")
    lines.append(
        f"`hetroute tune-deploy --cluster config/clusters/fleet-1000.yaml --json OUT` (the same fleet, a new "
        f"process): {cli_s:.2f} s wall, load average {load:.1f} on this {os.cpu_count()}-CPU host."
    )
    lines.append("")
    lines.append(
        "The joint runs add `min_instances` = 4 x machines (forces smaller TP on some machines) or a budget"
        " of $3/h per machine (prices are $1/h per GPU, so some machines stay unused);"
        " both are searched exactly."
    )
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_deploy_scale.json").write_text(
        json.dumps(
            {"host": host, "runs": runs, "cli_wall_s": round(cli_s, 3), "load_average": load}, indent=2
        )
        + "\n"
    )
    (args.out / "tune_deploy_scale.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
