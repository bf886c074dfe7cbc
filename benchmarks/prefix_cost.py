"""What prefix-aware routing costs the router: added decision latency and index memory.

Decision latency: ``Router.route`` + ``release`` of the default policy at 4, 64 and 512 backends, with
the prefix index on against off (same requests, same background load of 8 in flight per backend). Each
request carries 32 chunk hashes (a 2,048-token prompt); half of them share one of 8 system prompts (16
chunks) that the index already holds on a quarter of the backends, so lookups walk real matches.
Timed with ``perf_counter_ns`` per decision after a warm-up; p50/p99 in microseconds. The fleets are
profiled; one more row runs 64 backends with nothing known (no profile: the neutral default, whose
decisions take the credit-net-of-waiting-tokens path, docs/prefix.md). Memory: the
index after 100,000 distinct 4-chunk prompts over 8 backends, by ``tracemalloc``.

Usage: ``python benchmarks/prefix_cost.py [--decisions N]``; writes results/prefix_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decision_latency import fleet  # noqa: E402

from hetroute.clock import ManualClock  # noqa: E402
from hetroute.policies import PolicyContext, build_policy  # noqa: E402
from hetroute.prefix.index import PrefixIndex  # noqa: E402
from hetroute.prefix.settings import PrefixConfig  # noqa: E402
from hetroute.prefix.state import PrefixState  # noqa: E402
from hetroute.routing.ledger import Ledger  # noqa: E402
from hetroute.routing.router import Router  # noqa: E402
from hetroute.types import RequestFeatures  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def requests(n: int, seed: int) -> list[RequestFeatures]:
    rng = np.random.default_rng(seed)
    systems = [tuple(int(h) for h in rng.integers(1, 2**62, size=16)) for _ in range(8)]
    out = []
    for k in range(n):
        tail = tuple(int(h) for h in rng.integers(1, 2**62, size=16))
        head = systems[k % 8] if k % 2 == 0 else tuple(int(h) for h in rng.integers(1, 2**62, size=16))
        out.append(
            RequestFeatures(
                f"r{k}", "m", "openai", 2048, None, int(rng.integers(4, 600)),
                prefix_hashes=head + tail, prefix_chunk_tokens=64.0,
            )
        )  # fmt: skip
    return out


def route_us(n: int, decisions: int, prefix: bool, known: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(decide only, route + release) in µs per decision; ``known`` False drops the profiles."""
    backends = fleet(n) if known else tuple(replace(b, profile=None) for b in fleet(n))
    policy = build_policy("balanced_minmax", {}, PolicyContext(backends, seed=1))
    state = PrefixState(n, PrefixConfig()) if prefix else None
    router = Router(backends, policy, Ledger([b.name for b in backends]), ManualClock(), prefix=state)
    feats = requests(decisions + 8 * n, seed=1)
    held = [router.route(f) for f in feats[: 8 * n]]
    timed = feats[8 * n :]
    for f in timed[:200]:
        router.release(router.route(f))
    decide = np.empty(len(timed), dtype=np.float64)
    for k, f in enumerate(timed):
        t0 = time.perf_counter_ns()
        router.decide(f)
        decide[k] = (time.perf_counter_ns() - t0) / 1e3
    out = np.empty(len(timed), dtype=np.float64)
    for k, f in enumerate(timed):
        t0 = time.perf_counter_ns()
        ticket = router.route(f)
        router.release(ticket)
        out[k] = (time.perf_counter_ns() - t0) / 1e3
    for t in held:
        router.release(t)
    assert router.ledger.is_zero()
    return decide, out


def memory_mib(prompts: int = 100_000) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    tracemalloc.start()
    idx = PrefixIndex([math.nan] * 8)
    for k in range(prompts):
        idx.insert(k % 8, tuple(int(h) for h in rng.integers(1, 2**62, size=4)), k * 1e-3)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / 2**20, idx.memory_bytes() / 2**20


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=5000)
    args = ap.parse_args(argv)
    rows = []
    for n, known in ((4, True), (64, True), (512, True), (64, False)):
        (d_off, off) = route_us(n, args.decisions, False, known)
        (d_on, on) = route_us(n, args.decisions, True, known)
        rows.append(
            {
                "backends": n,
                "models": "profiled" if known else "nothing known",
                "decide_off_p50_us": float(np.median(d_off)),
                "decide_on_p50_us": float(np.median(d_on)),
                "decide_added_p50_us": float(np.median(d_on) - np.median(d_off)),
                "off_p50_us": float(np.median(off)),
                "on_p50_us": float(np.median(on)),
                "added_p50_us": float(np.median(on) - np.median(off)),
                "off_p99_us": float(np.percentile(off, 99)),
                "on_p99_us": float(np.percentile(on, 99)),
            }
        )
    traced, estimate = memory_mib()
    doc = {
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "decisions": args.decisions,
        "route_release": rows,
        "index_100k_prompts_mib": {"tracemalloc": traced, "estimate": estimate},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_cost.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    lines = [
        f"# Prefix routing cost ({platform.machine()}, Python {sys.version.split()[0]}, "
        f"{args.decisions} decisions)",
        "",
        "| backends | models | decide p50 off (µs) | on | added | route+release p50 off | on | added "
        "| p99 off | p99 on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backends']} | {r['models']} | {r['decide_off_p50_us']:.1f} | {r['decide_on_p50_us']:.1f} "
            f"| {r['decide_added_p50_us']:.1f} | {r['off_p50_us']:.1f} | {r['on_p50_us']:.1f} "
            f"| {r['added_p50_us']:.1f} "
            f"| {r['off_p99_us']:.1f} | {r['on_p99_us']:.1f} |"
        )
    lines += ["", f"Index memory, 100,000 distinct 4-chunk prompts over 8 backends: {traced:.1f} MiB "
              f"(tracemalloc), {estimate:.1f} MiB (the index's own estimate)."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (RESULTS / "prefix_cost.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
