"""Output of ``hetroute simulate``: a text table, a JSON document and a PNG plot of a run matrix.

Owns the JSON schema (``SCHEMA``, documented in docs/simulate.md). Invariants: the JSON holds plain
numbers only (NaN becomes null), keys are stable, and one run entry exists per (policy, rate).
Plotting uses matplotlib's object API (``Figure`` + Agg canvas), never ``pyplot``'s global state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetroute.sim.cluster_file import Fleet
from hetroute.sim.workload import SimRequest
from hetroute.simulation.simulator import SimResult

SCHEMA = "hetroute.simulate/1"


@dataclass(frozen=True, slots=True)
class MatrixRun:
    """One cell of the matrix: a policy (label, name, params) at one rate, and its result."""

    rate: str
    policy_name: str
    policy_params: Mapping[str, object]
    result: SimResult


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else round(float(x), 6)


def _dist(result: SimResult, which: str) -> dict[str, float | None]:
    values = result.ttft_s if which == "ttft" else result.e2e_s
    done = values[~np.isnan(values)]
    mean = float(done.mean()) if done.size else math.nan
    return {
        "mean": _num(mean),
        "p50": _num(result.percentile(which, 50)),
        "p90": _num(result.percentile(which, 90)),
        "p99": _num(result.percentile(which, 99)),
    }


def run_to_dict(run: MatrixRun) -> dict[str, Any]:
    """One run as plain data (the ``runs[]`` entry of the JSON schema)."""
    r = run.result
    return {
        "policy": r.policy,
        "policy_name": run.policy_name,
        "policy_params": {k: v for k, v in run.policy_params.items()},
        "predictor": r.predictor,
        "rate": run.rate,
        "requests": r.num_requests,
        "completed": r.completed,
        "rejected": r.rejected,
        "makespan_s": _num(r.makespan_s),
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "throughput_tokens_per_s": _num(r.throughput_tokens_per_s),
        "output_tokens_per_s": _num(r.output_tokens_per_s),
        "ttft_s": _dist(r, "ttft"),
        "e2e_s": _dist(r, "e2e"),
        "instances": [
            {
                "name": i.name,
                "gpu": i.gpu,
                "tp": i.tp,
                "requests": i.requests,
                "input_tokens": i.input_tokens,
                "output_tokens": i.output_tokens,
                "completion_time_s": _num(i.completion_time_s),
                "busy_s": _num(i.busy_s),
                "steps": i.steps,
                "preemptions": i.preemptions,
            }
            for i in r.instances
        ],
        "ledger_zero": r.ledger_zero,
        "events": r.events,
        "wall_s": round(r.wall_s, 4),
    }


def workload_summary(kind: str, requests: Sequence[SimRequest]) -> dict[str, Any]:
    """Token statistics of a workload (lengths are identical at every rate for one seed)."""
    inputs = np.array([r.input_tokens for r in requests], dtype=np.float64)
    outputs = np.array([r.output_tokens for r in requests], dtype=np.float64)
    if not requests:
        return {"kind": kind, "requests": 0}
    return {
        "kind": kind,
        "requests": len(requests),
        "input_tokens": {
            "mean": _num(inputs.mean()),
            "p50": _num(float(np.median(inputs))),
            "max": int(inputs.max()),
        },
        "output_tokens": {
            "mean": _num(outputs.mean()),
            "p50": _num(float(np.median(outputs))),
            "max": int(outputs.max()),
        },
    }


def build_document(
    fleet: Fleet,
    workload: Mapping[str, Any],
    runs: Sequence[MatrixRun],
    *,
    seed: int,
    scrape_interval_s: float,
    elapsed_s: float,
) -> dict[str, Any]:
    """The whole JSON document (see docs/simulate.md, "JSON output")."""
    return {
        "schema": SCHEMA,
        "cluster": {
            "name": fleet.cluster.name,
            "description": fleet.cluster.description,
            "instances": [
                {
                    "name": b.name,
                    "gpu": b.gpu,
                    "tp": b.tp,
                    "model": b.models[0],
                    "engine": b.engine,
                    "weight": b.weight,
                    "kv_capacity_tokens": b.kv_capacity_tokens,
                    "max_num_seqs": b.max_num_seqs,
                    "profile": b.profile_path,
                }
                for b in fleet.backends
            ],
        },
        "workload": dict(workload),
        "seed": seed,
        "scrape_interval_s": scrape_interval_s,
        "elapsed_s": round(elapsed_s, 3),
        "runs": [run_to_dict(r) for r in runs],
    }


def write_json(document: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def format_table(runs: Sequence[MatrixRun]) -> str:
    """A fixed-width table: one row per (rate, policy), per-instance ``requests@completion_s``."""
    header = (
        "rate",
        "policy",
        "tok/s",
        "out tok/s",
        "makespan s",
        "TTFT p50",
        "TTFT p99",
        "E2E p50",
        "E2E p99",
    )
    rows: list[tuple[str, ...]] = []
    for run in runs:
        r = run.result
        rows.append(
            (
                run.rate,
                r.policy,
                f"{r.throughput_tokens_per_s:.0f}",
                f"{r.output_tokens_per_s:.0f}",
                _fmt(r.makespan_s, 1),
                _fmt(r.percentile("ttft", 50), 3),
                _fmt(r.percentile("ttft", 99), 3),
                _fmt(r.percentile("e2e", 50), 2),
                _fmt(r.percentile("e2e", 99), 2),
                "  ".join(f"{i.name}={i.requests}@{i.completion_time_s:.0f}s" for i in r.instances),
            )
        )
    widths = [max(len(h), *(len(row[c]) for row in rows)) if rows else len(h) for c, h in enumerate(header)]
    lines = [
        "  ".join(
            h.rjust(w) if c >= 2 else h.ljust(w) for c, (h, w) in enumerate(zip(header, widths, strict=True))
        )
        + "  instances (requests@completion)"
    ]
    for row in rows:
        cells = [
            v.rjust(w) if c >= 2 else v.ljust(w)
            for c, (v, w) in enumerate(zip(row[:-1], widths, strict=True))
        ]
        lines.append("  ".join(cells) + "  " + row[-1])
    flagged = [run for run in runs if run.result.completed < run.result.num_requests]
    for run in flagged:
        r = run.result
        lines.append(
            f"note: {r.policy} at rate {run.rate}: {r.completed}/{r.num_requests} completed, "
            f"{r.rejected} rejected"
        )
    return "\n".join(lines)


def write_plot(runs: Sequence[MatrixRun], path: str | Path, title: str = "") -> None:
    """PNG: throughput and TTFT p99 against rate, one line per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = list(dict.fromkeys(r.rate for r in runs))
    policies = list(dict.fromkeys(r.result.policy for r in runs))
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_tp, ax_ttft = fig.subplots(1, 2)
    x = np.arange(len(rates))
    for policy in policies:
        by_rate = {r.rate: r.result for r in runs if r.result.policy == policy}
        tput = [by_rate[k].throughput_tokens_per_s if k in by_rate else math.nan for k in rates]
        ttft = [by_rate[k].percentile("ttft", 99) if k in by_rate else math.nan for k in rates]
        ax_tp.plot(x, tput, marker="o", label=policy)
        ax_ttft.plot(x, ttft, marker="o", label=policy)
    for ax, ylabel in ((ax_tp, "throughput (input+output tok/s)"), (ax_ttft, "TTFT p99 (s)")):
        ax.set_xticks(x, [f"{r} req/s" if r not in ("inf", "trace") else r for r in rates])
        ax.set_xlabel("arrival rate")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_ttft.set_yscale("log")
    ax_tp.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
