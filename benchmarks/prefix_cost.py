"""What prefix-aware routing costs the router: added decision latency and index memory.

Decision latency: ``Router.route`` + ``release`` of the default policy at 4, 64 and 512 backends, with
the prefix index on against off (same requests, same background load of 8 in flight per backend). Each
request carries 32 chunk hashes (a 2,048-token prompt); half of them share one of 8 system prompts (16
chunks) that the index already holds on a quarter of the backends, so lookups walk real matches.
Timed with ``perf_counter_ns`` per decision after a warm-up, the two routers alternately (one
block of 50 decisions each in turn), so that a slow spell of a shared machine lands on both; p50/p99 in
microseconds, and "added" is the median of the paired differences (on − off, same request), over all
requests and over each half (since the two halves cost differently, the overall median falls between
them and moves with small changes of either). The fleets are
profiled; one more row runs 64 backends with nothing known (no profile: the neutral default, whose
decisions take the credit-net-of-waiting-tokens path, docs/prefix.md). Memory: the
index after 100,000 distinct 4-chunk prompts over 8 backends, by ``tracemalloc``. Lookup: one
``PrefixIndex.matched_tokens`` at 64 backends for prompts of 32, 128 and 512 chunks (2 K to 32 K
tokens) that a quarter of the backends hold whole and another quarter hold the first half of.

Usage: ``python benchmarks/prefix_cost.py [--decisions N]``; writes results/prefix_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
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
LOOKUP_CHUNKS = (32, 128, 512)
"""Prompt lengths, in 64-token chunks, of the index lookup timing (2 K, 8 K and 32 K tokens)."""
BLOCK = 50
"""Decisions timed on one router before the other takes its turn: long enough that the two do not
evict each other's data from the CPU caches at every decision (alternating one by one read both
routers slower: docs/prefix.md, "Costs"), short enough that a slow spell lands on both."""


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


def _router(n: int, prefix: bool, known: bool) -> Router:
    backends = fleet(n) if known else tuple(replace(b, profile=None) for b in fleet(n))
    policy = build_policy("balanced_minmax", {}, PolicyContext(backends, seed=1))
    state = PrefixState(n, PrefixConfig()) if prefix else None
    return Router(backends, policy, Ledger([b.name for b in backends]), ManualClock(), prefix=state)


def route_us(n: int, decisions: int, known: bool = True) -> dict[str, np.ndarray]:
    """Per decision in µs, index off and on: ``decide_off``/``decide_on`` (decide only) and
    ``off``/``on`` (route + release); ``known`` False drops the profiles;
    ``shared`` marks the requests whose head the index holds.

    The two routers see the same requests and are timed alternately, ``BLOCK`` decisions each in turn
    (which goes first alternates too), so a slow spell of a shared machine lands on both: the added
    cost is the median of the paired differences (the same request, off and on)."""
    routers = {False: _router(n, False, known), True: _router(n, True, known)}
    feats = requests(decisions + 8 * n, seed=1)
    held = {p: [r.route(f) for f in feats[: 8 * n]] for p, r in routers.items()}
    timed = feats[8 * n :]
    for r in routers.values():
        for f in timed[:200]:
            r.release(r.route(f))

    def decide(router: Router, f: RequestFeatures) -> None:
        router.decide(f)

    def route_release(router: Router, f: RequestFeatures) -> None:
        router.release(router.route(f))

    out: dict[str, np.ndarray] = {}
    for label, step in (("decide_", decide), ("", route_release)):
        times = {p: np.empty(len(timed), dtype=np.float64) for p in routers}
        for j, start in enumerate(range(0, len(timed), BLOCK)):
            for prefix in (False, True) if j % 2 == 0 else (True, False):
                router, into = routers[prefix], times[prefix]
                for k in range(start, min(start + BLOCK, len(timed))):
                    t0 = time.perf_counter_ns()
                    step(router, timed[k])
                    into[k] = (time.perf_counter_ns() - t0) / 1e3
        out[label + "off"], out[label + "on"] = times[False], times[True]
    # requests() gives every even-numbered request one of the cached system prompts
    out["shared"] = np.arange(8 * n, 8 * n + len(timed)) % 2 == 0
    for p, r in routers.items():
        for t in held[p]:
            r.release(t)
        assert r.ledger.is_zero()
    return out


def memory_mib(prompts: int = 100_000) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    tracemalloc.start()
    idx = PrefixIndex([math.nan] * 8)
    for k in range(prompts):
        idx.insert(k % 8, tuple(int(h) for h in rng.integers(1, 2**62, size=4)), k * 1e-3)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / 2**20, idx.memory_bytes() / 2**20


def lookup_us(chunks: int, backends: int = 64, calls: int = 2000) -> float:
    """p50 µs of one ``PrefixIndex.matched_tokens`` at ``backends`` backends for a prompt of ``chunks``
    chunks that a quarter of them hold whole and another quarter hold the first half of (two places
    where holders drop out), among 20,000 other chunks."""
    rng = np.random.default_rng(chunks)
    idx = PrefixIndex([math.nan] * backends)
    for k in range(5000):
        idx.insert(k % backends, tuple(int(h) for h in rng.integers(1, 2**62, size=4)), 0.0)
    chain = tuple(int(h) for h in rng.integers(1, 2**62, size=chunks))
    for b in range(backends // 4):
        idx.insert(b, chain, 0.0)
        idx.insert(backends // 4 + b, chain[: chunks // 2], 0.0)
    times = np.empty(calls, dtype=np.float64)
    for k in range(calls):
        t0 = time.perf_counter_ns()
        idx.matched_tokens(chain, 0.0, 64.0, math.inf)
        times[k] = (time.perf_counter_ns() - t0) / 1e3
    return float(np.median(times))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=5000)
    args = ap.parse_args(argv)
    rows = []
    for n, known in ((4, True), (64, True), (512, True), (64, False)):
        t = route_us(n, args.decisions, known)
        d_off, d_on, off, on, shared = t["decide_off"], t["decide_on"], t["off"], t["on"], t["shared"]
        rows.append(
            {
                "backends": n,
                "models": "profiled" if known else "nothing known",
                "decide_off_p50_us": float(np.median(d_off)),
                "decide_on_p50_us": float(np.median(d_on)),
                "decide_added_p50_us": float(np.median(d_on - d_off)),
                "decide_added_shared_p50_us": float(np.median((d_on - d_off)[shared])),
                "decide_added_unshared_p50_us": float(np.median((d_on - d_off)[~shared])),
                "off_p50_us": float(np.median(off)),
                "on_p50_us": float(np.median(on)),
                "added_p50_us": float(np.median(on - off)),
                "off_p99_us": float(np.percentile(off, 99)),
                "on_p99_us": float(np.percentile(on, 99)),
            }
        )
    traced, estimate = memory_mib()
    lookups = {str(c): lookup_us(c) for c in LOOKUP_CHUNKS}
    doc = {
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "decisions": args.decisions,
        "date": datetime.date.today().isoformat(),
        "route_release": rows,
        "index_100k_prompts_mib": {"tracemalloc": traced, "estimate": estimate},
        "index_lookup_p50_us_by_chunks": lookups,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_cost.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    lines = [
        f"# Prefix routing cost ({platform.machine()}, Python {sys.version.split()[0]}, "
        f"{args.decisions} decisions, {doc['date']}; the two routers timed alternately, "
        "'added' is the median of the paired differences, over all requests and over each half: the "
        "head cached on some backend, or not)",
        "",
        "| backends | models | decide p50 off (µs) | on | added | added: head cached | head not cached "
        "| route+release p50 off | on | added | p99 off | p99 on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backends']} | {r['models']} | {r['decide_off_p50_us']:.1f} | {r['decide_on_p50_us']:.1f} "
            f"| {r['decide_added_p50_us']:.1f} | {r['decide_added_shared_p50_us']:.1f} "
            f"| {r['decide_added_unshared_p50_us']:.1f} | {r['off_p50_us']:.1f} | {r['on_p50_us']:.1f} "
            f"| {r['added_p50_us']:.1f} "
            f"| {r['off_p99_us']:.1f} | {r['on_p99_us']:.1f} |"
        )
    lines += ["", f"Index memory, 100,000 distinct 4-chunk prompts over 8 backends: {traced:.1f} MiB "
              f"(tracemalloc), {estimate:.1f} MiB (the index's own estimate)."]  # fmt: skip
    sizes = ", ".join(f"{int(c) * 64:,} tokens ({c} chunks) {us:.1f} µs" for c, us in lookups.items())
    lines += ["", "Index lookup p50 at 64 backends, a prompt a quarter of them hold whole and another "
              f"quarter hold the first half of: {sizes}."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (RESULTS / "prefix_cost.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
