"""Several router replicas in the simulator: 1, 2 and 4 routers taking arrivals in turn.

Usage: ``python benchmarks/replicas.py [--scenarios paper-a,paper-b,mixed] [--rates 8,16,24,inf]
[--seeds 1,2,3] [--requests 4000] [--replicas 2,4] [--modes off,raw,scaled,scaled_excess]
[--known prior,nothing] [--workers 2] [--out benchmarks/results] [--tag T]``.

Each replica is the real Router with its own ledger, policy (``default``), latency learner and
prefix index; request k goes to replica k mod R, as behind a round-robin Service; all share the
engines and their scrapes (every ``scrape.interval_s``, the gateway default). ``--modes`` are the
ways a replica counts the requests the others sent (``hetroute.routing.foreign``): ``off`` (its own
ledger only), ``raw`` (the engine's running + waiting minus its own at the scrape, held until the next
scrape), ``scaled`` (its own ledger scaled by the fleet-wide ratio of foreign to own requests at the
last scrapes) and ``scaled_excess`` (scaled plus each backend's departure from that ratio).

``--known``: ``prior`` is the scenario's roofline prior, fitted to the same engine model that serves
as ground truth (flattering); ``nothing`` strips GPU, TP, ``max_num_seqs`` and profile and turns live
learning on (a new user's setup): each replica then learns from its own completions only.

Reported per (known, scenario, rate, R, mode), mean over seeds: throughput and p99 TTFT, and their
ratios to the single router of the same seed (R = 1; all modes are identical there). Issue 14's bar:
throughput ≥ 0.97× and p99 TTFT ≤ 1.2× at every rate. Writes ``replicas.json`` and ``replicas.md``;
with ``--peer-hint`` every replica is given ``server.replicas`` = R (until a scrape has seen its own
requests, the scaled modes count each other replica as having sent as many as it did) and the files
are ``replicas_peer_hint.*``. With ``--peer-interval S`` the replicas also exchange summaries every S
seconds of modelled time (their ledgers and completions, ``hetroute.routing.peers``; no transit time)
and the files are ``replicas_peers.*``.
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
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
THROUGHPUT_BAR = 0.97
P99_BAR = 1.2


@dataclass(frozen=True)
class Task:
    known: str
    scenario: str
    rate: float
    seed: int
    requests: int
    replicas: int
    mode: str
    peer_hint: bool = False
    peer_interval_s: float = 0.0
    peer_mirror: bool = True


_FLEETS: dict[tuple[str, str], Any] = {}


def _fleet(scenario: str, known: str) -> Any:
    from hetroute.sim.cluster_file import build_fleet
    from hetroute.sim.scenarios import get_scenario

    key = (scenario, known)
    if key not in _FLEETS:
        fleet = build_fleet(get_scenario(scenario).cluster())
        if known == "nothing":
            stripped = tuple(
                replace(b, gpu=None, tp=None, labels={}, max_num_seqs=None, profile=None)
                for b in fleet.backends
            )
            fleet = replace(fleet, backends=stripped)
        _FLEETS[key] = fleet
    return _FLEETS[key]


def execute(task: Task) -> dict[str, Any]:
    """One simulation, summarised as plain numbers."""
    logging.disable(logging.WARNING)
    from hetroute.learning.settings import LearningConfig
    from hetroute.sim.workload import generate_workload
    from hetroute.simulation.simulator import run_simulation

    fleet = _fleet(task.scenario, task.known)
    workload = generate_workload("sharegpt", task.requests, task.rate, task.seed, fleet.max_model_len())
    r = run_simulation(
        fleet,
        workload,
        "default",
        {},
        predictor="online",
        seed=task.seed,
        learning=LearningConfig() if task.known == "nothing" else None,
        replicas=task.replicas,
        foreign=task.mode,  # type: ignore[arg-type]
        peer_hint=task.peer_hint,
        peer_interval_s=task.peer_interval_s,
        peer_mirror=task.peer_mirror,
    )
    return {
        "known": task.known,
        "scenario": task.scenario,
        "rate": "inf" if math.isinf(task.rate) else f"{task.rate:g}",
        "seed": task.seed,
        "replicas": task.replicas,
        "mode": task.mode,
        "throughput_tokens_s": r.throughput_tokens_per_s,
        "ttft_p99_s": r.percentile("ttft", 99),
        "e2e_p99_s": r.percentile("e2e", 99),
        "completed": r.completed,
        "ledger_zero": r.ledger_zero,
    }


def build_tasks(args: argparse.Namespace) -> list[Task]:
    tasks = []
    for known in args.known:
        for scenario in args.scenarios:
            for rate in args.rates:
                for seed in args.seeds:
                    tasks.append(Task(known, scenario, rate, seed, args.requests, 1, "off"))
                    for r in args.replicas:
                        for mode in args.modes:
                            tasks.append(
                                Task(
                                    known,
                                    scenario,
                                    rate,
                                    seed,
                                    args.requests,
                                    r,
                                    mode,
                                    args.peer_hint,
                                    args.peer_interval,
                                    not args.no_peer_mirror,
                                )
                            )
    return tasks


def aggregate(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (known, scenario, rate, replicas, mode): means and ratios to R = 1 (per seed, then mean)."""
    single = {(r["known"], r["scenario"], r["rate"], r["seed"]): r for r in rows if r["replicas"] == 1}
    groups: dict[tuple[str, str, str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["replicas"] > 1:
            groups[(r["known"], r["scenario"], r["rate"], r["replicas"], r["mode"])].append(r)
    out = []
    for (known, scenario, rate, replicas, mode), runs in groups.items():
        base = [single[(known, scenario, rate, r["seed"])] for r in runs]
        thr = [r["throughput_tokens_s"] / b["throughput_tokens_s"] for r, b in zip(runs, base, strict=True)]
        p99 = [r["ttft_p99_s"] / b["ttft_p99_s"] for r, b in zip(runs, base, strict=True)]
        single_thr = [b["throughput_tokens_s"] for b in base]
        out.append(
            {
                "known": known,
                "scenario": scenario,
                "rate": rate,
                "replicas": replicas,
                "mode": mode,
                "seeds": len(runs),
                "throughput_ratio": statistics.mean(thr),
                "throughput_ratio_min": min(thr),
                "throughput_ratio_max": max(thr),
                "throughput_ratio_sem": statistics.stdev(thr) / math.sqrt(len(thr)) if len(thr) > 1 else 0.0,
                "single_throughput_min": min(single_thr),
                "single_throughput_max": max(single_thr),
                "ttft_p99_ratio": statistics.mean(p99),
                "ttft_p99_s": statistics.mean(r["ttft_p99_s"] for r in runs),
                "single_ttft_p99_s": statistics.mean(b["ttft_p99_s"] for b in base),
                "meets": statistics.mean(thr) >= THROUGHPUT_BAR and statistics.mean(p99) <= P99_BAR,
                "ledger_zero": all(r["ledger_zero"] for r in runs),
            }
        )
    return out


def markdown(agg: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Router replicas (simulator)",
        "",
        f"`{meta['command']}` on {meta['machine']}; {meta['wall_s']:.0f} s.",
        "",
        "Ratios to one router on the same workload and seed (mean over seeds): throughput (bar ≥ 0.97) "
        "and p99 TTFT (bar ≤ 1.2). `prior`: the scenario's roofline prior (fitted to the simulator's own "
        "engine model: flattering); `nothing`: no GPU, TP, profile or max_num_seqs, live learning on.",
        "",
    ]
    modes = sorted({a["mode"] for a in agg}, key=["off", "raw", "scaled", "scaled_excess"].index)
    for known in dict.fromkeys(a["known"] for a in agg):
        lines += [f"## {known}", "", "| scenario | rate | R | " + " | ".join(modes) + " |"]
        lines.append("|---|---|---|" + "---|" * len(modes))
        keys = dict.fromkeys((a["scenario"], a["rate"], a["replicas"]) for a in agg if a["known"] == known)
        for scenario, rate, replicas in keys:
            cells = []
            for mode in modes:
                hit = [
                    a
                    for a in agg
                    if (a["known"], a["scenario"], a["rate"], a["replicas"], a["mode"])
                    == (known, scenario, rate, replicas, mode)
                ]
                if not hit:
                    cells.append("")
                    continue
                a = hit[0]
                mark = "" if a["meets"] else " ✗"
                cells.append(f"×{a['throughput_ratio']:.3f} / p99 ×{a['ttft_p99_ratio']:.2f}{mark}")
            lines.append(f"| {scenario} | {rate} | {replicas} | " + " | ".join(cells) + " |")
        lines.append("")
    for mode in modes:
        mine = [a for a in agg if a["mode"] == mode]
        met = sum(a["meets"] for a in mine)
        lines.append(f"- `{mode}`: {met}/{len(mine)} cells meet both bars.")
    lines += [
        "",
        "## Spread over seeds",
        "",
        "Per cell: the per-seed throughput ratios (mean ± its standard error, min–max) and one router's own "
        "throughput over the same seeds (tokens/s, min–max; how much a single router's result moves with "
        "the workload drawn).",
        "",
        "| known | scenario | rate | R | mode | seeds | ratio mean ± s.e. | ratio min–max "
        "| one router, tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a in agg:
        lines.append(
            f"| {a['known']} | {a['scenario']} | {a['rate']} | {a['replicas']} | {a['mode']} "
            f"| {a['seeds']} | "
            f"{a['throughput_ratio']:.3f} ± {a['throughput_ratio_sem']:.3f} | "
            f"{a['throughput_ratio_min']:.3f}–{a['throughput_ratio_max']:.3f} | "
            f"{a['single_throughput_min']:,.0f}–{a['single_throughput_max']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_seeds(text: str) -> list[int]:
    """``1,2,3`` or ranges ``1-10`` (inclusive), mixed: ``1-3,7``; duplicates are an error."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if sep:
            if int(hi) < int(lo):
                raise argparse.ArgumentTypeError(f"--seeds: empty range {part!r}")
            seeds.extend(range(int(lo), int(hi) + 1))
        else:
            seeds.append(int(part))
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds: a seed is listed twice in {text!r}")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="paper-a,paper-b,mixed")
    ap.add_argument("--rates", default="8,16,24,inf")
    ap.add_argument(
        "--seeds", type=parse_seeds, default="1,2,3", help="1,2,3 or a range 1-10 (default 1,2,3)"
    )
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--modes", default="off,raw,scaled,scaled_excess")
    ap.add_argument("--known", default="prior,nothing")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="appended to the output files' stem (replicas_peers_<tag>.*)")
    ap.add_argument(
        "--peer-hint",
        action="store_true",
        help="give every replica server.replicas = R (the start-up burst hint; writes replicas_peer_hint.*)",
    )
    ap.add_argument(
        "--peer-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="the replicas exchange summaries every S seconds (hetroute.routing.peers; 0: no exchange); "
        "writes replicas_peers.* (replicas_peers_hint.* with --peer-hint)",
    )
    ap.add_argument(
        "--no-peer-mirror",
        action="store_true",
        help="with --peer-interval: replicas do not mirror their own changes onto their peers between "
        "summaries (peers.mirror: false; hetroute.routing.peer_mirror); the files get _nomirror",
    )
    args = ap.parse_args(argv)
    args.scenarios = args.scenarios.split(",")
    args.rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    args.replicas = [int(r) for r in args.replicas.split(",")]
    args.modes = args.modes.split(",")
    args.known = args.known.split(",")
    tasks = build_tasks(args)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(args.workers) as pool:
        for k, row in enumerate(pool.map(execute, tasks, chunksize=4), 1):
            rows.append(row)
            if k % 25 == 0 or k == len(tasks):
                print(f"[replicas] {k}/{len(tasks)} runs, {time.perf_counter() - started:.0f} s", flush=True)
    agg = aggregate(rows)
    meta = {
        "command": "python benchmarks/replicas.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
        "wall_s": time.perf_counter() - started,
    }
    text = markdown(agg, meta)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "replicas_peer_hint" if args.peer_hint else "replicas"
    if args.peer_interval > 0:
        stem = "replicas_peers_hint" if args.peer_hint else "replicas_peers"
        if args.no_peer_mirror:
            stem += "_nomirror"
    if args.tag:
        stem += f"_{args.tag}"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "runs": rows, "cells": agg}, indent=1) + "\n"
    )
    (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
