"""Cost of one admission placement (``Placer.place``) with and without a backlog, at 8, 64 and 512 backends.

Usage: ``python benchmarks/admission_place_cost.py [--placements 2000] [--sizes 8,64,512]``.
Writes ``benchmarks/results/admission_place_cost.{json,md}``.

Per fleet size it builds a fleet of H100, A100 and L4 backends in turn (the catalog's roofline priors,
``max_num_seqs`` 256, one model), places 4 × n requests so every backend has work, then times
``Placer.place`` (policy decision, the "full" test and, under a backlog, the tail test; plus
``Router.commit``) and ``Router.release`` with ``time.perf_counter_ns`` over N placements:

- **no backlog**: ``waiting`` = 1 and no backend full: the tail test is skipped;
- **backlog**: ``waiting`` = 100, nothing arriving: the tail test prices the request on every backend.

Reports the median and p99 in microseconds. Single-threaded, one core.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetroute.admission.config import ClassConfig, FullConfig
from hetroute.admission.full import Placer
from hetroute.clock import ManualClock
from hetroute.policies import PolicyContext, build_policy
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import BackendSpec, RequestFeatures

RESULTS = Path(__file__).resolve().parent / "results"
GPUS = ("H100-SXM", "A100-80G", "L4")
MODEL = "Llama-3-8B"
CLASS = ClassConfig()


def _placer(n: int) -> Placer:
    backends = [
        BackendSpec(
            name=f"b{i}",
            url=f"http://127.0.0.1:{9000 + i}",
            engine="vllm",
            models=(MODEL,),
            gpu=GPUS[i % len(GPUS)],
            tp=1,
            max_num_seqs=256,
        )
        for i in range(n)
    ]
    router = Router(
        backends,
        build_policy("default", {}, PolicyContext(tuple(backends))),
        Ledger([b.name for b in backends]),
        ManualClock(),
    )
    placer = Placer(router, FullConfig())
    for k in range(4 * n):  # every backend busy, none full
        if placer.place(_request(f"warm{k}"), 1, CLASS) is None:
            raise RuntimeError("a warm-up request found every backend full")
    return placer


def _request(request_id: str) -> RequestFeatures:
    return RequestFeatures(request_id, MODEL, "openai", 300, None, 200)


def _time(placer: Placer, waiting: int, placements: int) -> dict[str, float]:
    samples = np.empty(placements, dtype=np.float64)
    for k in range(placements):
        features = _request(f"r{waiting}-{k}")
        started = time.perf_counter_ns()
        ticket = placer.place(features, waiting, CLASS)
        if ticket is not None:
            placer.router.release(ticket)
        samples[k] = (time.perf_counter_ns() - started) / 1000.0
    return {"p50_us": float(np.median(samples)), "p99_us": float(np.percentile(samples, 99))}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--placements", type=int, default=2000, help="timed placements per cell")
    ap.add_argument("--sizes", default="8,64,512", help="fleet sizes, comma-separated")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for n in (int(s) for s in args.sizes.split(",")):
        placer = _placer(n)
        _time(placer, 100, 200)  # warm-up
        plain, backlog = _time(placer, 1, args.placements), _time(placer, 100, args.placements)
        rows.append({"backends": n, "no_backlog": plain, "backlog": backlog})
        p50 = (plain["p50_us"], backlog["p50_us"])
        print(f"{n:4d} backends: p50 {p50[0]:.1f} us without a backlog, {p50[1]:.1f} with", file=sys.stderr)
    machine = f"{platform.platform()}, Python {platform.python_version()}, one core, no GPU"
    md = [
        "# Admission placement cost (`benchmarks/admission_place_cost.py`)",
        "",
        f"`Placer.place` + `Router.release`, {args.placements} placements per cell. Machine: {machine}.",
        "",
        "| backends | no backlog p50 µs | p99 µs | backlog (tail test) p50 µs | p99 µs | added p50 µs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["no_backlog"], r["backlog"]
        md.append(
            f"| {r['backends']} | {a['p50_us']:.1f} | {a['p99_us']:.1f} | {b['p50_us']:.1f} | "
            f"{b['p99_us']:.1f} | {b['p50_us'] - a['p50_us']:.1f} |"
        )
    text = "\n".join(md) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "admission_place_cost", "machine": machine, "rows": rows}
    out_json = args.out / "admission_place_cost.json"
    out_json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    (args.out / "admission_place_cost.md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
