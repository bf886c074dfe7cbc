"""``hetroute tune-deploy``: choose TP degrees per machine from lightweight profiles (method.md §4).

Parses the command line, loads the catalogs and the cluster file, builds the request sample (a synthetic
workload or a trace), runs :func:`hetroute.tuner.tune.tune`, prints the ranked table and writes the JSON,
PNG, router config and docker-compose file on request. Runs offline; needs no cluster access. Every
input error is one line on stderr naming the file and the field, with exit status 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from hetroute.catalog.specs import GpuSpec, ModelSpec, load_gpu_catalog, load_model_catalog
from hetroute.errors import ConfigError
from hetroute.latency import LatencyProfile, ProfileError
from hetroute.prior import roofline_prior_profile
from hetroute.sim.workload import WORKLOAD_KINDS, generate_workload, load_trace
from hetroute.tuner.cluster import ClusterSpec, EngineSettings, load_cluster
from hetroute.tuner.emit import write_compose, write_router_config
from hetroute.tuner.estimate import PriorFn
from hetroute.tuner.report import render_png, render_table, result_to_json
from hetroute.tuner.search import SearchTooLarge
from hetroute.tuner.tune import ESTIMATORS, tune


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "tune-deploy",
        help="choose tensor-parallel degrees per machine and emit a deployment",
        description="Choose tensor-parallel degrees per machine from lightweight profiles (method.md §4) "
        "and emit a deployment.",
    )
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster YAML (see docs/tune-deploy.md)")
    p.add_argument(
        "--workload",
        metavar="KIND|TRACE",
        help=f"{' | '.join(WORKLOAD_KINDS)} or a trace file (CSV/JSONL); default: the cluster file's",
    )
    p.add_argument(
        "--requests", type=int, metavar="N", help="requests in the sample (default: cluster file, 1000)"
    )
    p.add_argument("--duplicates", type=int, metavar="D", help="repeat the sample D times (paper §5: 8)")
    p.add_argument("--seed", type=int, help="workload seed (default: cluster file, 0)")
    p.add_argument("--estimator", choices=ESTIMATORS, default="iteration", help="estimate used to choose")
    p.add_argument("--json", metavar="OUT", help="write the full result as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a bar chart of both estimates")
    p.add_argument("--emit-config", metavar="ROUTER.yaml", help="write the hetroute serve config")
    p.add_argument("--emit-compose", metavar="COMPOSE.yaml", help="write a docker-compose file for vLLM")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)


def tuning_prior(engine: EngineSettings) -> PriorFn:
    """The catalog's roofline prior under the cluster's engine settings, for (GPU, TP) without a profile."""

    def prior(gpu: GpuSpec, model: ModelSpec, tp: int) -> LatencyProfile:
        return roofline_prior_profile(
            gpu,
            model,
            tp,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.batched_tokens(),
            gpu_memory_utilization=engine.gpu_memory_utilization,
            overhead_gib_per_gpu=engine.overhead_gib_per_gpu,
            max_model_len=engine.model_len(model),
        )

    return prior


def sample_requests(
    cluster: ClusterSpec, workload: str | None, n: int | None, duplicates: int | None, seed: int | None
) -> tuple[str, list[tuple[int, int]]]:
    """The request sample [(input, output)] and its label."""
    kind = workload or cluster.workload.kind
    count = n if n is not None else cluster.workload.requests
    dup = duplicates if duplicates is not None else cluster.workload.duplicates
    s = seed if seed is not None else cluster.workload.seed
    if count < 1 or dup < 1:
        raise ConfigError("--requests" if count < 1 else "--duplicates", "must be >= 1")
    if kind in WORKLOAD_KINDS:
        reqs = generate_workload(kind, count, float("inf"), s)
    elif Path(kind).is_file():
        reqs = load_trace(kind, n=count, rate=float("inf"), seed=s)
    else:
        raise ConfigError(
            "--workload", f"expected one of {', '.join(WORKLOAD_KINDS)} or a trace file, got {kind!r}"
        )
    pairs = [(r.input_tokens, r.output_tokens) for r in reqs]
    if not pairs:
        raise ConfigError("--workload", f"{kind!r} gave no requests")
    label = kind if dup == 1 else f"{kind} x{dup}"
    return label, pairs * dup


class _ProgressLine:
    """A one-line progress display on a terminal (silent when not a TTY)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.active = stream.isatty()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.active:
            return
        width = 24
        filled = int(width * done / max(total, 1))
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:<40}")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    try:
        gpus = load_gpu_catalog()
        models = load_model_catalog()
        cluster = load_cluster(args.cluster, gpus, models)
        label, requests = sample_requests(cluster, args.workload, args.requests, args.duplicates, args.seed)
        prior = tuning_prior(cluster.engine)
        progress = None if args.quiet else _ProgressLine(sys.stderr)
        result = tune(cluster, requests, prior, workload=label, estimator=args.estimator, progress=progress)
    except (ConfigError, ProfileError, SearchTooLarge) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(render_table(result))
    try:
        if args.json:
            Path(args.json).write_text(json.dumps(result_to_json(result), indent=2) + "\n", encoding="utf-8")
            sys.stdout.write(f"wrote {args.json}\n")
        if args.plot:
            render_png(result, args.plot)
            sys.stdout.write(f"wrote {args.plot}\n")
        if args.emit_config:
            write_router_config(result, args.emit_config, prior)
            sys.stdout.write(f"wrote {args.emit_config}\n")
        if args.emit_compose:
            write_compose(result, args.emit_compose)
            sys.stdout.write(f"wrote {args.emit_compose}\n")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 0 if result.search.infeasible_reason is None else 1
