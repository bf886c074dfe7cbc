"""Prefix-cache-aware routing: the default against SGLang-, llm-d- and session-hash-style baselines.

Runs every policy on every prefix workload (``chat``, ``system-prompts``, ``rag``, ``mooncake`` when
the trace is present, and ``no-sharing`` as the control) on paper-a, mixed and a homogeneous fleet
(4 × A100-80GB TP1, Llama-3-8B), in the simulator (``--part sim``) and through real gateways in front
of emulated engines (``--part gateway``, a smaller set). The engines cache prefixes as vLLM does
(``sim/prefix_cache.py``); the policies see the router's prefix index.

Load: per fleet, the capacity C (tokens/s) is the default's throughput on ``no-sharing`` at rate ∞;
each workload then runs at ``--loads`` × C / (mean prompt + output tokens of that workload) requests
per second, so "1.0" is the arrival rate that would saturate the fleet without any cache reuse.
Every workload is fit to the context window the fleet's engines serve (8,192 tokens on paper-a, mixed
and the homogeneous fleet, 32,768 on paper-b; ``--max-model-len`` sets another).

Per run: throughput (tokens/s), TTFT p50/p99 (s), the engines' prefix-cache hit rate (Σ hits / Σ
queries, in tokens), the router's estimated hit rate (Σ cached tokens expected at dispatch / Σ prompt
tokens) and the router's index memory. Model knowledge: the simulator's policies use the roofline
prior fitted to the same engine model (the flattering case) with live learning on; ``--blind`` runs
them with nothing known (house model names), which the README's claims also cover. ``--queue`` puts
every policy behind the router's admission queue (one unbounded class: requests wait at the router
only while every backend is full, and are placed when one has room), for the overloaded cells.

    python benchmarks/prefix.py --part sim            # the full simulator table (a few minutes)
    python benchmarks/prefix.py --part gateway        # through the gateway (about 35 minutes)
    python benchmarks/prefix.py --part sim --render   # summarise the saved rows again, running nothing
    python benchmarks/prefix.py --part sim --cells homogeneous:mooncake:1.2 --seeds 4,5,6 \
        --rates-from benchmarks/results/prefix_sim.json --with-rows benchmarks/results/prefix_sim.json \
        --out benchmarks/results/prefix_sim_more_seeds    # more seeds for one cell, at its stored rate

Writes benchmarks/results/prefix_{sim,gateway}.json and .md. The JSON is rewritten after every run
(``"complete": false`` until the last), so a run stopped early keeps what it measured; ``--render``
turns it into the tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TRACE = HERE.parent.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
FLEETS = ("paper-a", "mixed", "homogeneous")
"""The fleets a table runs unless ``--fleets`` says otherwise; :func:`known_fleets` are accepted."""
WORKLOADS = ("chat", "system-prompts", "rag", "mooncake", "no-sharing")
POLICIES: dict[str, tuple[str, dict[str, object]]] = {
    "default": ("balanced_minmax", {}),
    "default-no-prefix": ("balanced_minmax", {"prefix": False}),
    "cache_aware": ("cache_aware", {}),
    "prefix_scorer": ("prefix_scorer", {}),
    "session_hash": ("session_hash", {}),
    "default-peer-latency": ("balanced_minmax", {"peer_latency": True}),
    "default-no-peer-latency": ("balanced_minmax", {"peer_latency": False}),
    "default-stop40": ("balanced_minmax", {"peer_prefill_weight": 3.0, "peer_queue_weight": 0.0}),
    "default-stop46": ("balanced_minmax", {"fresh_queue_weight": 0.0, "duplicate_weight": 0.0}),
    "default-stop47": ("balanced_minmax", {"duplicate_weight": 0.0}),
}
"""``default-peer-latency`` is the default's settings since stop 40 (kept for the stop-39 tables that
ran it as an option); ``default-no-peer-latency`` is the default as it was until then.
``default-stop40`` is the default of stop 40, before its weights among peers changed (r's own prefill
counted 3 times instead of 6, the wait behind the queued prompts once instead of 2.5 times;
docs/prefix.md, "Stop 41"). ``default-stop46`` is the default of stop 46, before a fresh prompt's
floor counted the prompts queued ahead of it 2.5 times instead of once (docs/prefix.md, "Fresh prompts");
``default-stop47`` the default of stop 47, before the duplicate price (docs/prefix.md, "Duplicates")."""
TABLE_POLICIES = ("default", "default-no-prefix", "cache_aware", "prefix_scorer", "session_hash")
"""What a table runs unless ``--policies`` says otherwise (the two peer variants only when named)."""
METRICS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "engine_hit_rate", "router_hit_estimate")
BASELINES = ("default-no-prefix", "cache_aware", "prefix_scorer", "session_hash")
HOMOGENEOUS = {
    "name": "homogeneous",
    "description": "4 x A100-80GB TP1, Llama-3-8B",
    "defaults": {"model": "Llama-3-8B", "engine": "vllm"},
    "instances": [{"name": "a100", "gpu": "A100-80GB", "tp": 1, "count": 4}],
}


def fleet_of(name: str, blind: bool) -> Any:
    from hetroute.sim.cluster_file import blind_fleet, build_fleet, parse_cluster
    from hetroute.sim.scenarios import get_scenario

    cluster = parse_cluster(HOMOGENEOUS) if name == "homogeneous" else get_scenario(name).cluster()
    fleet = build_fleet(cluster)
    return blind_fleet(fleet) if blind else fleet


def window_of(fleet_name: str, max_model_len: int | None = None) -> int:
    """The context window a fleet's workloads are made to fit: ``max_model_len`` when given
    (``--max-model-len``), else the one its engines serve its model with (8,192 for Llama-3-8B, 32,768
    for paper-b's DeepSeek-R1-Distill-Qwen-14B). The generators end a session whose next turn would not
    fit; the trace replay cuts a prompt at its end, then its output, so that both fit
    (``mooncake_trace``): at 8,192 tokens half the trace's prompts keep 1 output token."""
    return max_model_len if max_model_len is not None else served_window(fleet_name)


@functools.cache
def served_window(fleet_name: str) -> int:
    """The smallest ``max_model_len`` the fleet's engines serve its model with."""
    return int(fleet_of(fleet_name, False).max_model_len())


def workload_of(kind: str, n: int, rate: float, seed: int, max_model_len: int) -> list[Any]:
    from hetroute.sim.mooncake_trace import load_mooncake_trace
    from hetroute.sim.prefix_workloads import generate_prefix_workload

    if kind == "mooncake":
        return load_mooncake_trace(TRACE, n=n, rate=rate, seed=seed, max_model_len=max_model_len)
    return generate_prefix_workload(kind, n, rate, seed, max_model_len)


def mean_tokens(workload: Sequence[Any]) -> float:
    return float(np.mean([r.input_tokens + r.output_tokens for r in workload]))


UNBOUNDED_QUEUE: dict[str, Any] = {
    "classes": [{"name": "default", "max_queue_len": 10**6, "max_queue_wait_s": 1e6}]
}
"""``--queue``'s ``admission:`` section, in the simulator and the gateway alike: one class, unbounded in
length and wait, so the queue holds a request only while every backend is full and sheds none."""


def queue_of(on: bool) -> Any:
    """``--queue``: the simulator's admission queue of :data:`UNBOUNDED_QUEUE` (docs/admission.md);
    else None."""
    if not on:
        return None
    from hetroute.admission.config import parse_admission
    from hetroute.simulation.admission_run import SimAdmission

    return SimAdmission(parse_admission(UNBOUNDED_QUEUE))


def sim_run(
    fleet: Any, workload: Sequence[Any], policy: str, learning: bool, queue: bool = False
) -> dict[str, Any]:
    from hetroute.learning.settings import LearningConfig
    from hetroute.simulation.simulator import run_simulation

    name, params = POLICIES[policy]
    res = run_simulation(
        fleet,
        workload,
        name,
        params,
        label=policy,
        learning=LearningConfig() if learning else None,
        admission=queue_of(queue),
    )
    extra = res.extra
    queries = extra.get("prefix_cache_queries_tokens", 0.0)
    return {
        "policy": policy,
        "throughput_tok_s": res.throughput_tokens_per_s,
        "ttft_p50_s": res.percentile("ttft", 50),
        "ttft_p99_s": res.percentile("ttft", 99),
        "engine_hit_rate": extra.get("prefix_cache_hits_tokens", 0.0) / queries if queries else 0.0,
        "router_hit_estimate": extra.get("prefix_expected_hit_ratio", math.nan),
        "router_index_mib": extra.get("prefix_index_bytes", 0.0) / 2**20,
        "completed": res.completed,
        "requests": res.num_requests,
        "ledger_zero": res.ledger_zero,
    }


Cell = tuple[str, str, float]
"""(fleet, workload, load): one cell of the table."""


def known_fleets() -> tuple[str, ...]:
    """Every fleet a cell may name: the homogeneous one and each built-in scenario (``paper-b`` too,
    which the default tables do not run)."""
    from hetroute.sim.scenarios import SCENARIOS

    return ("homogeneous", *SCENARIOS)


def parse_fleets(text: str) -> list[str]:
    """``--fleets``: names of :func:`known_fleets` separated by commas."""
    known = known_fleets()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fleet {unknown or text!r} (known: {', '.join(known)})")
    return names


def parse_cells(text: str) -> list[Cell]:
    """``--cells``: ``fleet:workload:load`` items separated by commas, e.g. ``mixed:mooncake:0.7``."""
    fleets = known_fleets()
    cells: list[Cell] = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in fleets or parts[1] not in WORKLOADS:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not fleet:workload:load (fleets {', '.join(fleets)}; "
                f"workloads {', '.join(WORKLOADS)})"
            )
        try:
            load = float(parts[2])
        except ValueError:
            raise argparse.ArgumentTypeError(f"load {parts[2]!r} in {item!r} is not a number") from None
        cells.append((parts[0], parts[1], load))
    return cells


def parse_policies(text: str) -> list[str]:
    """``--policies``: names of :data:`POLICIES` separated by commas."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown or text!r} (known: {', '.join(POLICIES)})")
    return names


def planned_cells(args: argparse.Namespace) -> list[Cell]:
    """The cells to run: ``--cells`` as given, else every fleet × workload × load (``mooncake`` only
    where the trace is present)."""
    if args.cells is not None:
        return list(args.cells)
    workloads = [w for w in args.workloads if w != "mooncake" or TRACE.is_file()]
    return [(f, w, load) for f in args.fleets for w in workloads for load in args.loads]


def pinned_rates(args: argparse.Namespace, cells: Sequence[Cell]) -> dict[Cell, float] | None:
    """``--rates-from``: each cell's arrival rate (requests/s) stored in that results file, or None
    without the option; every planned cell must be there (rows without a ``rate``, rebuilt from an
    older run's log, are skipped)."""
    if args.rates_from is None:
        return None
    rows = json.loads(args.rates_from.read_text(encoding="utf-8"))["rows"]
    pinned = {(r["fleet"], r["workload"], float(r["load"])): float(r["rate"]) for r in rows if "rate" in r}
    missing = [c for c in cells if c not in pinned]
    if missing:
        raise SystemExit(f"--rates-from {args.rates_from}: no rate stored for {missing}")
    return pinned


def kept_rows(args: argparse.Namespace, cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """``--with-rows``: that file's rows for the planned cells, but for the seeds and policies run now."""
    if args.with_rows is None:
        return []
    earlier = json.loads(args.with_rows.read_text(encoding="utf-8"))["rows"]
    wanted = set(cells)
    rows = [
        r
        for r in earlier
        if (r["fleet"], r["workload"], float(r["load"])) in wanted
        and not (r["seed"] in args.seeds and r["policy"] in args.policies)
    ]
    print(f"kept {len(rows)} rows of {args.with_rows}", flush=True)
    return rows


def cell_rate(
    cell: Cell,
    pinned: dict[Cell, float] | None,
    capacities: dict[str, float],
    capacity_of: Callable[[str], float],
    requests: int,
    max_model_len: int | None = None,
) -> float:
    """The cell's arrival rate (requests/s): stored (``--rates-from``), else its load × the fleet's
    no-sharing capacity (``capacity_of(fleet)``, once per fleet into ``capacities``) / the workload's
    mean prompt + output tokens (module docstring)."""
    if pinned is not None:
        return pinned[cell]
    fleet_name, kind, load = cell
    if fleet_name not in capacities:
        capacities[fleet_name] = capacity_of(fleet_name)
        print(f"{fleet_name}: no-sharing capacity {capacities[fleet_name]:,.0f} tokens/s", flush=True)
    probe = workload_of(kind, requests, math.inf, 0, window_of(fleet_name, max_model_len))
    return load * capacities[fleet_name] / mean_tokens(probe)


def sim_part(
    args: argparse.Namespace, on_row: Callable[[list[dict[str, Any]]], None]
) -> list[dict[str, Any]]:
    """Every run of the simulator table; ``on_row`` gets the rows so far after each run.

    With ``args.rates_from`` each cell runs at the arrival rate stored there (no capacity run), so
    more seeds can be added to a table at exactly its rates even after the default's capacity moved;
    with ``args.with_rows`` that file's rows for the planned cells come first, but for the seeds and
    policies run now."""
    cells = planned_cells(args)
    pinned = pinned_rates(args, cells)
    rows = kept_rows(args, cells)
    capacities: dict[str, float] = {}
    fleets: dict[str, Any] = {}

    def fleet_named(name: str) -> Any:
        if name not in fleets:
            fleets[name] = fleet_of(name, args.blind)
        return fleets[name]

    def capacity_of(name: str) -> float:
        base = workload_of("no-sharing", args.requests, math.inf, 0, window_of(name, args.max_model_len))
        return float(sim_run(fleet_named(name), base, "default-no-prefix", True)["throughput_tok_s"])

    for fleet_name, kind, load in cells:
        fleet = fleet_named(fleet_name)
        rate = cell_rate(
            (fleet_name, kind, load), pinned, capacities, capacity_of, args.requests, args.max_model_len
        )
        for seed in args.seeds:
            wl = workload_of(kind, args.requests, rate, seed, window_of(fleet_name, args.max_model_len))
            for policy in args.policies:
                started = time.perf_counter()
                row = sim_run(fleet, wl, policy, True, args.queue)
                row.update(fleet=fleet_name, workload=kind, load=load, rate=rate, seed=seed, queue=args.queue)
                rows.append(row)
                on_row(rows)
                print(
                    f"  {kind:14s} load {load:.2f} ({rate:5.2f}/s) seed {seed} {policy:18s} "
                    f"{row['throughput_tok_s']:9,.0f} tok/s  ttft p50 {row['ttft_p50_s']:7.3f} "
                    f"p99 {row['ttft_p99_s']:7.3f}  hit {row['engine_hit_rate']:.3f} "
                    f"(router {row['router_hit_estimate']:.3f})  "
                    f"[{time.perf_counter() - started:.1f}s]",
                    flush=True,
                )
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (fleet, workload, load): median over seeds per policy, and the default against the baselines."""
    keys = sorted({(r["fleet"], r["workload"], r["load"]) for r in rows})
    out = []
    for key in keys:
        cell = [r for r in rows if (r["fleet"], r["workload"], r["load"]) == key]
        med: dict[str, dict[str, float]] = {}
        for policy in POLICIES:
            mine = [r for r in cell if r["policy"] == policy]
            if not mine:
                continue
            med[policy] = {m: float(np.median([r[m] for r in mine])) for m in METRICS}
        if "default" not in med:
            continue
        d = med["default"]
        base = [p for p in BASELINES if p in med and p != "default-no-prefix"]
        best_thr = max(med[p]["throughput_tok_s"] for p in base) if base else math.nan
        best_p99 = min(med[p]["ttft_p99_s"] for p in base) if base else math.nan
        best_hit = max(med[p]["engine_hit_rate"] for p in base) if base else math.nan
        no_prefix = med.get("default-no-prefix", dict.fromkeys(METRICS, math.nan))  # absent mid-run
        out.append(
            {
                "fleet": key[0],
                "workload": key[1],
                "load": key[2],
                "policies": med,
                "thr_vs_best_baseline": d["throughput_tok_s"] / best_thr,
                "p99_vs_best_baseline": d["ttft_p99_s"] / best_p99,
                "hit_vs_best_baseline": d["engine_hit_rate"] / best_hit if best_hit > 0 else math.nan,
                "thr_vs_no_prefix": d["throughput_tok_s"] / no_prefix["throughput_tok_s"],
                "p99_vs_no_prefix": d["ttft_p99_s"] / no_prefix["ttft_p99_s"],
            }
        )
    return out


def markdown(summary: list[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", ""]
    lines.append(
        "| fleet | workload | load | policy | tok/s | TTFT p50 s | TTFT p99 s | engine hit | router est. |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        for policy, m in s["policies"].items():
            lines.append(
                f"| {s['fleet']} | {s['workload']} | {s['load']:.2f} | {policy} "
                f"| {m['throughput_tok_s']:,.0f} "
                f"| {m['ttft_p50_s']:.3f} | {m['ttft_p99_s']:.3f} | {m['engine_hit_rate']:.3f} "
                f"| {m['router_hit_estimate']:.3f} |"
            )
    lines += [
        "",
        "Default against the best of cache_aware, prefix_scorer, session_hash (medians over seeds), and "
        "against the default without the prefix term (throughput and p99 TTFT ratios):",
        "",
    ]
    lines.append(
        "| fleet | workload | load | throughput ratio | p99 TTFT ratio | hit-rate ratio "
        "| no prefix: throughput | no prefix: p99 TTFT |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for s in summary:
        p99_np = s.get("p99_vs_no_prefix", math.nan)
        lines.append(
            f"| {s['fleet']} | {s['workload']} | {s['load']:.2f} | {s['thr_vs_best_baseline']:.3f} "
            f"| {s['p99_vs_best_baseline']:.3f} | {s['hit_vs_best_baseline']:.3f} "
            f"| {s['thr_vs_no_prefix']:.3f} | {p99_np:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("sim", "gateway"), default="sim")
    p.add_argument(
        "--fleets",
        type=parse_fleets,
        default=list(FLEETS),
        help=f"fleets separated by commas (default {','.join(FLEETS)}; also paper-b)",
    )
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    p.add_argument("--requests", type=int, default=2000, help="requests per run (gateway: use ~400)")
    p.add_argument("--speedup", type=float, default=4.0, help="gateway: emulated time runs this much faster")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.7, 1.2])
    p.add_argument("--blind", action="store_true", help="nothing known: house model names, no GPU labels")
    p.add_argument(
        "--queue",
        action="store_true",
        help="every policy behind the router's admission queue (one class, unbounded: it holds a "
        "request only while every backend is full and sheds none); capacities are still measured without",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="fit every workload to this context window in tokens (default: each fleet's own, 8,192 "
        "for paper-a, mixed and homogeneous, 32,768 for paper-b; the paper-b tables before stop 52 "
        "used 8,192)",
    )
    p.add_argument("--out", type=Path, default=None, help="results file stem (default results/prefix_<part>)")
    p.add_argument(
        "--policies",
        type=parse_policies,
        default=list(TABLE_POLICIES),
        help=f"the policies to run, separated by commas (default {','.join(TABLE_POLICIES)}; "
        f"also: {', '.join(p for p in POLICIES if p not in TABLE_POLICIES)})",
    )
    p.add_argument(
        "--cells",
        type=parse_cells,
        default=None,
        help="run only these cells, fleet:workload:load separated by commas (instead of "
        "--fleets x --workloads x --loads), e.g. homogeneous:mooncake:1.2,mixed:mooncake:0.7",
    )
    p.add_argument(
        "--rates-from",
        type=Path,
        default=None,
        help="run each cell at the arrival rate stored in this results JSON (no capacity run), "
        "to add seeds to an earlier table at its exact rates",
    )
    p.add_argument(
        "--with-rows",
        type=Path,
        default=None,
        help="keep this results JSON's rows for the cells run, but for the seeds and policies run now, "
        "so the summary covers both (e.g. seeds 1-3 stored, 4-9 run now)",
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="run nothing: summarise the rows already in the results file again (after a summary change)",
    )
    args = p.parse_args(argv)
    run_only = [
        o
        for o, v in (
            ("--policies", None if args.policies == list(TABLE_POLICIES) else args.policies),
            ("--cells", args.cells),
            ("--rates-from", args.rates_from),
            ("--with-rows", args.with_rows),
        )
        if v is not None
    ]
    if run_only and args.render:
        p.error(f"{', '.join(run_only)}: not with --render")
    for option, path in (("--rates-from", args.rates_from), ("--with-rows", args.with_rows)):
        if path is not None and not path.is_file():
            p.error(f"{option}: {path} is not a file")
    RESULTS.mkdir(exist_ok=True)
    stem = args.out or RESULTS / f"prefix_{args.part}{'_blind' if args.blind else ''}"

    def save(rows: list[dict[str, Any]], complete: bool = False) -> None:
        """The rows so far, written after each run: a benchmark stopped early keeps what it measured."""
        payload = json.dumps({"rows": rows, "summary": summarise(rows), "complete": complete}, indent=1)
        Path(f"{stem}.json").write_text(payload, encoding="utf-8")

    if args.render:
        rows = json.loads(Path(f"{stem}.json").read_text(encoding="utf-8"))["rows"]
        title = f"Prefix-aware routing {'in the simulator' if args.part == 'sim' else 'through the gateway'}"
        title += " (nothing known)" if args.blind else ""
    elif args.part == "sim":
        rows = sim_part(args, save)
        title = "Prefix-aware routing in the simulator" + (" (nothing known)" if args.blind else "")
        title += " behind the admission queue" if args.queue else ""
    else:
        from prefix_gateway import gateway_part

        rows = gateway_part(args, save)
        title = "Prefix-aware routing through the gateway" + (" (nothing known)" if args.blind else "")
        title += " behind the admission queue" if args.queue else ""
    save(rows, complete=True)
    text = markdown(summarise(rows), title)
    Path(f"{stem}.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
