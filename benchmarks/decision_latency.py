"""Routing-decision latency of every policy for 4, 64 and 512 backends.

Usage: ``python benchmarks/decision_latency.py [--decisions N] [--sizes 4,64,512]``.
Writes ``benchmarks/results/decision_latency.json`` and ``decision_latency.md``.

Per (policy, fleet size) it builds a fleet of alternating fast/slow profiled backends (all serving one
model, 8 × n requests in flight), wired as the gateway wires its router (a health tracker and a
metrics store holding one fresh scrape per backend, read through their whole-fleet providers), then
times ``policy.choose`` alone and
``Router.route`` + ``Router.release`` (snapshot copy + policy + ledger) with ``time.perf_counter_ns``
over N decisions after a warm-up, and reports p50/p99/mean in microseconds. Single-threaded, one core.
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

from hetroute.backends.health import HealthTracker
from hetroute.backends.scrape import MetricsStore
from hetroute.clock import ManualClock
from hetroute.config import HealthConfig
from hetroute.latency import EngineLimits, LatencyParams, LatencyProfile
from hetroute.policies import POLICIES, PolicyContext, build_policy
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import BackendSpec, EngineMetrics, RequestFeatures

RESULTS = Path(__file__).resolve().parent / "results"
FAST = LatencyParams(4.7e-5, 0.0, 4.7e-6, 0.0, 3.7e-8, 4.1e-5, 1.3e-7, 9.4e-3)
SLOW = LatencyParams(1.7e-4, 0.0, 9.2e-6, 0.0, 1.5e-7, 1.4e-4, 5.3e-7, 2.3e-2)


def fleet(n: int) -> tuple[BackendSpec, ...]:
    out = []
    for i in range(n):
        fast = i % 2 == 0
        prof = LatencyProfile(
            params=FAST if fast else SLOW,
            kv_capacity_tokens=786_000 if fast else 97_000,
            kv_capacity_source="benchmark",
            limits=EngineLimits(max_num_seqs=256),
        )
        out.append(
            BackendSpec(
                name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm", models=("m",), profile=prof
            )
        )
    return tuple(out)


def measure(name: str, n: int, decisions: int) -> dict[str, float]:
    backends = fleet(n)
    params: dict[str, object] = {}
    if name == "weighted_round_robin":
        params = {"weights": [4 if i % 2 == 0 else 1 for i in range(n)]}
    policy = build_policy(name, params, PolicyContext(backends, seed=1))
    ledger = Ledger([b.name for b in backends])
    # Wired as the gateway wires it (app.py): health tracker and metrics store, one fresh scrape per
    # backend, and their whole-fleet providers for the snapshot.
    clock = ManualClock(10.0)
    health = HealthTracker(HealthConfig(), [b.name for b in backends], clock)
    store = MetricsStore(n, clock, stale_after_s=5.0)
    router = Router(
        backends,
        policy,
        ledger,
        clock,
        is_available=health.is_available,
        latest_metrics=store.latest,
        available_all=health.available_all,
        latest_metrics_all=store.latest_all,
    )
    store.on_publish = router.scraped
    rng = np.random.default_rng(1)
    feats = [
        RequestFeatures(f"r{k}", "m", "openai", int(rng.integers(4, 1024)), None, int(rng.integers(4, 600)))
        for k in range(decisions)
    ]
    held = [router.route(f) for f in feats[: 8 * n]]  # background load: 8 in flight per backend
    for i in range(n):  # one router: each engine holds exactly the router's own requests
        running = float(ledger.requests_in_flight[i])
        store.publish(
            i, EngineMetrics(scraped_at_s=9.5, num_requests_running=running, num_requests_waiting=0.0)
        )
    snap = router.snapshot()
    cands = np.arange(n, dtype=np.int64)
    for f in feats[:200]:  # warm-up
        policy.choose(f, snap, cands)
    choose_ns = np.empty(decisions, dtype=np.int64)
    for k, f in enumerate(feats):
        t0 = time.perf_counter_ns()
        policy.choose(f, snap, cands)
        choose_ns[k] = time.perf_counter_ns() - t0
    route_ns = np.empty(decisions, dtype=np.int64)
    for k, f in enumerate(feats):
        t0 = time.perf_counter_ns()
        ticket = router.route(f)
        router.release(ticket)
        route_ns[k] = time.perf_counter_ns() - t0
    for t in held:
        router.release(t)
    assert ledger.is_zero()
    us_c = choose_ns / 1e3
    us_r = route_ns / 1e3
    return {
        "choose_p50_us": float(np.percentile(us_c, 50)),
        "choose_p99_us": float(np.percentile(us_c, 99)),
        "choose_mean_us": float(us_c.mean()),
        "route_release_p50_us": float(np.percentile(us_r, 50)),
        "route_release_p99_us": float(np.percentile(us_r, 99)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--sizes", default="4,64,512")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in sorted(POLICIES):
        for n in sizes:
            results.setdefault(name, {})[str(n)] = measure(name, n, args.decisions)
    doc: dict[str, Any] = {
        "benchmark": "decision_latency",
        "decisions": args.decisions,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": 2,
            "gpu": None,
        },
        "numpy": np.__version__,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decision_latency.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    head = " | ".join(f"{n} backends: choose p50 / p99, route+release p50" for n in sizes)
    lines = [
        f"# Decision latency (µs), {args.decisions} decisions, {platform.processor() or platform.machine()}",
        "",
        f"| policy | {head} |",
        "|---|" + "---|" * len(sizes),
    ]
    for name, per in results.items():
        cells = [
            f"{per[str(n)]['choose_p50_us']:.1f} / {per[str(n)]['choose_p99_us']:.1f}, "
            f"{per[str(n)]['route_release_p50_us']:.1f}"
            for n in sizes
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (args.out / "decision_latency.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
