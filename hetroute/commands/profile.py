"""``hetroute profile``: measure a live engine and write its latency-profile artifact (method.md §3).

Parses arguments into :class:`profiling.runner.ProfileOptions` and runs
:func:`profiling.runner.profile_backend`. Ctrl-C cancels the sweep: every open response is closed,
which aborts the request in the engine, and the command exits 130 without writing anything.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any, cast

from hetroute.clock import MonotonicClock
from hetroute.types import ENGINE_KINDS, EngineKind


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="profile a live engine and fit its latency model (p1..p8)",
        description="Sweep batch sizes against a live backend, fit p1..p8, write a YAML latency profile.",
    )
    p.add_argument("--backend", required=True, help="base URL of the engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--engine", required=True, choices=ENGINE_KINDS)
    p.add_argument("--model", help="served model name (default: the only one the backend lists)")
    p.add_argument("--out", required=True, type=Path, help="YAML profile to write")
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 2, 4, 8, 16, 32))
    p.add_argument("--input-lens", type=_int_list, default=None, help="default: 128,512,1024,2048 that fit")
    p.add_argument("--output-lens", "--output-len", dest="output_lens", type=_int_list, default=(64, 128))
    p.add_argument("--reps", type=int, default=3, help="batches per shape")
    p.add_argument("--budget-s", type=float, default=600.0, help="stop sweeping and fit after this long")
    p.add_argument("--seed", type=int, default=0, help="seeds shape order and the held-out split")
    p.add_argument("--heldout-frac", type=float, default=0.25)
    p.add_argument("--max-mape", type=float, default=0.10, help="refuse above this held-out MAPE")
    p.add_argument("--force", action="store_true", help="write the profile even if the fit is refused")
    p.add_argument("--max-concurrency", type=int, default=32, help="never more requests in flight")
    p.add_argument("--max-requests", type=int, default=4000, help="never more requests in all")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-batch and per-read timeout")
    p.add_argument("--gpu", help="GPU type label (also used for the catalog KV fallback)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree label (also for the catalog)")
    p.add_argument("--catalog-model", help="catalog name of the model when it differs from the served name")
    p.add_argument("--kv-capacity-tokens", type=int, help="override the discovered KV capacity")
    p.add_argument("--max-num-seqs", type=int, help="the engine's max concurrent sequences (vLLM hides it)")
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--plot", type=Path, help="PNG of measured versus fitted, per phase")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply measured times by this (the emulator's --speedup, to fit modelled GPU seconds)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from profiling.collect import SweepConfig
    from profiling.discover import Overrides
    from profiling.runner import ProfileOptions, profile_backend

    try:
        opts = ProfileOptions(
            backend_url=args.backend,
            engine=cast(EngineKind, args.engine),
            out=args.out,
            sweep=SweepConfig(
                batch_sizes=args.batch_sizes,
                input_lens=args.input_lens,
                output_lens=args.output_lens,
                reps=args.reps,
                max_concurrency=args.max_concurrency,
                max_requests=args.max_requests,
                budget_s=args.budget_s,
                timeout_s=args.timeout_s,
                run_id=uuid.uuid4().hex[:8],
            ),
            overrides=Overrides(
                model=args.model,
                kv_capacity_tokens=args.kv_capacity_tokens,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                gpu=args.gpu,
                tp=args.tp,
                catalog_model=args.catalog_model,
            ),
            heldout_frac=args.heldout_frac,
            max_mape=args.max_mape,
            force=args.force,
            seed=args.seed,
            plot=args.plot,
            time_scale=args.time_scale,
            labels={"gpu": args.gpu, "tp": str(args.tp) if args.tp is not None else None},
        )

    except ValueError as exc:
        print(f"hetroute profile: {exc}", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        outcome = asyncio.run(profile_backend(opts, MonotonicClock(), log))
    except KeyboardInterrupt:
        log("[profile] interrupted: open requests were closed (aborted upstream); nothing written")
        return 130
    log(f"[profile] {outcome.message}")
    return outcome.exit_code
