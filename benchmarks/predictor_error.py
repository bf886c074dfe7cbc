"""Output-length predictor error on Azure-conversation and ShareGPT-like workloads (method.md §6).

Usage: ``python benchmarks/predictor_error.py [--requests N] [--seeds 1,2,3] [--trace PATH]``.
Writes ``benchmarks/results/predictors.json`` and ``predictors.md``. (The file is not called
``predictors.py``: run as a script, that name would shadow the ``predictors`` package.)

For each workload and predictor, requests are replayed in arrival order as a gateway sees them:
``predict`` (without ``max_tokens``, so the clamp cannot hide errors), compare with the true output
length, then ``observe`` the true length (the completion's ``usage.completion_tokens``). Reported:
MAE (tokens), mean signed error (bias), the under-prediction rate (Õ < O), the over-prediction rate
(Õ > O), and MAE over the second half only (after the online predictors have warmed up).

Workloads: ``azure-conv`` (synthetic, sampled through the Azure LLM inference 2023 conversation
trace's published quantiles, hetroute.sim.workload), ``sharegpt`` (synthetic ShareGPT-like), and,
with ``--trace``, a real trace file (e.g. the Azure conversation CSV). The paper's ``normal``
predictor gets μ and σ from the first 200 requests of the workload, as the paper sampled its dataset.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import predictors
from hetroute.sim.workload import SimRequest, generate_workload, load_trace

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "m"


def configurations(sample: Sequence[SimRequest]) -> list[tuple[str, str, dict[str, object]]]:
    """(label, registry name, params) for every predictor variant measured."""
    outs = [r.output_tokens for r in sample]
    mu, sigma = float(np.mean(outs)), float(np.std(outs))
    return [
        ("normal (paper)", "normal", {"mean_tokens": mu, "std_tokens": sigma}),
        ("mean (dataset, fixed)", "mean", {"mean_tokens": mu, "learn": False}),
        ("mean (learned)", "mean", {}),
        ("online q=0.5 (default)", "online", {}),
        ("online mean", "online", {"statistic": "mean"}),
        ("online q=0.6", "online", {"quantile": 0.6}),
        ("online q=0.75", "online", {"quantile": 0.75}),
        ("online q=0.9", "online", {"quantile": 0.9}),
    ]


def evaluate(
    requests: Sequence[SimRequest], name: str, params: Mapping[str, object], seed: int
) -> dict[str, float]:
    """Replay ``requests`` through one predictor; error statistics."""
    p = predictors.build_predictor(name, params, seed)
    pred = np.empty(len(requests), dtype=np.float64)
    true = np.array([r.output_tokens for r in requests], dtype=np.float64)
    for k, r in enumerate(requests):
        pred[k] = p.predict(MODEL, r.input_tokens, None)
        p.observe(MODEL, r.input_tokens, r.output_tokens)
    err = pred - true
    half = len(requests) // 2
    return {
        "mae_tokens": float(np.mean(np.abs(err))),
        "bias_tokens": float(np.mean(err)),
        "under_rate": float(np.mean(pred < true)),
        "over_rate": float(np.mean(pred > true)),
        "mae_second_half_tokens": float(np.mean(np.abs(err[half:]))),
        "sum_ratio": float(pred.sum() / true.sum()),
    }


def workloads(n: int, seed: int, trace: Path | None) -> dict[str, list[SimRequest]]:
    out = {
        "azure-conv (synthetic)": generate_workload("azure-conv", n, float("inf"), seed),
        "sharegpt (synthetic)": generate_workload("sharegpt", n, float("inf"), seed, 2048),
    }
    if trace is not None:
        out[f"trace {trace.name}"] = load_trace(trace, n=n, rate="trace")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--trace", type=Path, default=None, help="a CSV/JSONL trace (real lengths, first N)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for seed in seeds:
        for wname, reqs in workloads(args.requests, seed, args.trace).items():
            for label, name, params in configurations(reqs[:200]):
                stats = evaluate(reqs, name, params, seed)
                acc = rows.setdefault(wname, {}).setdefault(label, {})
                for key, value in stats.items():
                    acc[key] = acc.get(key, 0.0) + value / len(seeds)
    doc: dict[str, Any] = {
        "benchmark": "predictors",
        "requests": args.requests,
        "seeds": seeds,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": 2,
            "gpu": None,
        },
        "elapsed_s": time.perf_counter() - started,
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "predictors.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    lines = [
        f"# Output-length predictors: {args.requests} requests per workload, mean over seeds {seeds}",
        "",
        "Replayed in arrival order: predict (no max_tokens), then observe the true length.",
        "",
        "| workload | predictor | MAE | MAE 2nd half | bias | under | over | Σpred/Σtrue |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for wname, per in rows.items():
        for label, s in per.items():
            lines.append(
                f"| {wname} | {label} | {s['mae_tokens']:.1f} | {s['mae_second_half_tokens']:.1f} | "
                f"{s['bias_tokens']:+.1f} | {s['under_rate']:.1%} | {s['over_rate']:.1%} | "
                f"{s['sum_ratio']:.3f} |"
            )
    table = "\n".join(lines) + "\n"
    (args.out / "predictors.md").write_text(table, encoding="utf-8")
    print(table)
    print(f"elapsed {statistics.fmean([doc['elapsed_s']]):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
