"""Live backend changes under load: how soon an added backend takes traffic, what a drained removal loses.

Usage: ``python benchmarks/live_backends.py [--trials N] [--concurrency C]``. Writes
``benchmarks/results/live_backends.json`` and ``.md``.

Each trial starts two emulated V100 vLLM engines and the real gateway (``build_app``, the default
policy, every default but ``scrape.interval_s``) in this process on 127.0.0.1, with ``C`` clients
sending requests back to back (half streamed, 32 output tokens) to the gateway while it has only
engine ``a``. Then:

1. ``POST /admin/backends`` adds engine ``b``: the time from the answer to the first request the
   ledger dispatches to ``b``, against the scrape interval (the goal: within one), and how many
   requests ``b`` served in the next 2 s, and the p99 end-to-end latency of the requests sent in the
   2 s before and after the join. Three ways to join (``--join``): ``replica``, an entry equal to
   ``a``'s but for name and URL (as DNS discovery or an autoscaler adds replicas), which starts from
   the model ``a`` learned; ``unknown``, name and URL only (engine and models asked of the server,
   whose ``root`` makes the entry differ from ``a``'s), which starts from the median of the learned
   members (``a``); ``slow``, the same but ``b`` is 4x slower than ``a``, where that start is wrong
   until ``b``'s own requests correct it;
2. after 2 s, ``DELETE /admin/backends/b?drain=true``: how long the call took (the drain), how many
   requests were in flight on ``b`` then, whether any was dispatched to ``b`` after it, and how many
   client requests failed or came back incomplete over the whole trial (the goal: none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry

from hetroute.app import MEMBERSHIP, ROUTER, build_app, start_app
from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
from hetroute.config import config_from_dict
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.engine_model import EngineConfig, EngineModel

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "llama"


async def _client(
    url: str, k: int, stop: asyncio.Event, outcomes: list[tuple[float, float, bool]], s: aiohttp.ClientSession
) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        stream = (k + n) % 2 == 0
        body: dict[str, Any] = {"model": MODEL, "prompt": f"client {k} request {n} " * 16, "max_tokens": 32}
        if stream:
            body["stream"] = True
        started = time.perf_counter()
        try:
            async with s.post(url + "/v1/completions", json=body) as r:
                raw = await r.read()
                ok = r.status == 200 and (b"data: [DONE]" in raw if stream else b'"choices"' in raw)
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        outcomes.append((started, time.perf_counter() - started, ok))


async def trial(concurrency: int, scrape_s: float, speedup: float, join: str = "replica") -> dict[str, Any]:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    async with AsyncExitStack() as stack:
        urls = []
        for k in range(2):
            engine = EngineModel(
                EngineConfig(lookup_gpu(gpus, "V100-SXM2-32GB"), lookup_model(models, "Llama-3-8B"), 1)
            )
            # "slow": the backend that joins is 4x slower than the one the router has learned
            scale = 0.25 if k == 1 and join == "slow" else 1.0
            app = build_emulator_app(engine, served_model=MODEL, engine_kind="vllm", speedup=speedup * scale)
            urls.append(await stack.enter_async_context(run_emulator(app)))
        cfg = config_from_dict(
            {
                "backends": [{"name": "a", "url": urls[0], "engine": "vllm", "models": [MODEL]}],
                "scrape": {"interval_s": scrape_s},
                "server": {"access_log": False},
            },
            env={},
        )
        gw = build_app(cfg, registry=CollectorRegistry())
        runner, port = await start_app(gw)
        stack.push_async_callback(runner.cleanup)
        url = f"http://127.0.0.1:{port}"
        router = gw[ROUTER]
        stop, outcomes = asyncio.Event(), []
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        )
        clients = [asyncio.create_task(_client(url, k, stop, outcomes, session)) for k in range(concurrency)]
        await asyncio.sleep(2.0)
        entry: dict[str, Any] = {"name": "b", "url": urls[1]}
        if join == "replica":  # a's entry but for name and URL: starts from what a learned
            entry |= {"engine": "vllm", "models": [MODEL]}
        async with session.post(url + "/admin/backends", json=entry) as r:
            assert r.status == 201, await r.text()
            slot = (await r.json())["slot"]
        joined = time.perf_counter()
        p99_before = _p99(outcomes, joined - 2.0, joined)
        while router.ledger.dispatched_total[slot] == 0 and time.perf_counter() - joined < 10 * scrape_s:  # noqa: ASYNC110 - polls the ledger, which signals nothing
            await asyncio.sleep(0.001)
        first_s = time.perf_counter() - joined
        await asyncio.sleep(2.0)
        at_leave: dict[str, int] = {}

        def left(i: int, _: object) -> None:  # the counts at the instant the removal took effect
            at_leave["dispatched"] = int(router.ledger.dispatched_total[i])
            at_leave["in_flight"] = int(router.ledger.requests_in_flight[i])

        gw[MEMBERSHIP].on_leave.append(left)
        started = time.perf_counter()
        async with session.delete(url + "/admin/backends/b?drain=true&timeout_s=30") as r:
            status = r.status
        drain_s = time.perf_counter() - started
        dispatched_before, in_flight = at_leave["dispatched"], at_leave["in_flight"]
        after = int(router.ledger.dispatched_total[slot]) - dispatched_before
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*clients)
        return {
            "first_request_after_join_s": round(first_s, 4),
            "drain_status": status,
            "drain_s": round(drain_s, 4),
            "in_flight_on_b_at_delete": in_flight,
            "dispatched_to_b_after_delete": after,
            "requests": len(outcomes),
            "failed_or_incomplete": sum(1 for *_, ok in outcomes if not ok),
            "p99_e2e_s_2s_before_join": round(p99_before, 4),
            "p99_e2e_s_2s_after_join": round(_p99(outcomes, joined, joined + 2.0), 4),
            "served_by_b": dispatched_before,
            "ledger_zero": router.ledger.is_zero(),
        }


def _p99(outcomes: list[tuple[float, float, bool]], start: float, end: float) -> float:
    """p99 end-to-end latency of the requests sent in [start, end)."""
    window = [e2e for sent, e2e, _ in outcomes if start <= sent < end]
    return float(np.percentile(window, 99)) if window else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scrape-interval-s", type=float, default=0.5)
    ap.add_argument("--speedup", type=float, default=5.0, help="emulator speed-up over the modelled V100")
    ap.add_argument("--out", type=Path, default=RESULTS / "live_backends.json")
    ap.add_argument("--join", choices=("replica", "unknown", "slow", "all"), default="all")
    args = ap.parse_args()
    runs = []
    for join in ("replica", "unknown", "slow") if args.join == "all" else (args.join,):
        for k in range(args.trials):
            run = {"join": join} | asyncio.run(
                trial(args.concurrency, args.scrape_interval_s, args.speedup, join)
            )
            runs.append(run)
            print(f"trial {k + 1}/{args.trials}: {run}", file=sys.stderr)
    summary: dict[str, Any] = {}
    for join in sorted({r["join"] for r in runs}):
        mine = [r for r in runs if r["join"] == join]
        first = [r["first_request_after_join_s"] for r in mine]
        summary[join] = {
            "first_request_after_join_s_median": statistics.median(first),
            "within_one_scrape_interval": sum(1 for f in first if f <= args.scrape_interval_s),
            "trials": len(mine),
            "served_by_b_median": statistics.median(r["served_by_b"] for r in mine),
            "drain_s_max": max(r["drain_s"] for r in mine),
            "dispatched_to_b_after_delete": sum(r["dispatched_to_b_after_delete"] for r in mine),
            "failed_or_incomplete": sum(r["failed_or_incomplete"] for r in mine),
            "requests": sum(r["requests"] for r in mine),
        }
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "settings": vars(args) | {"out": str(args.out)},
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    lines = [
        "# Live backend changes under load (benchmarks/live_backends.py)",
        "",
        f"{args.trials} trials, {args.concurrency} clients, scrape interval {args.scrape_interval_s} s, "
        f"emulated V100 vLLM ×{args.speedup:g}, default policy; machine: {out['machine']}.",
        "",
        "| join | trial | first request to b (s) | served by b in 2 s | "
        "p99 e2e 2 s before / after join (s) | in flight at DELETE | drain (s) | "
        "dispatched after DELETE | requests | failed or incomplete |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(runs, 1):
        lines.append(
            f"| {r['join']} | {k} | {r['first_request_after_join_s']:.4f} | {r['served_by_b']} | "
            f"{r['p99_e2e_s_2s_before_join']:.3f} / {r['p99_e2e_s_2s_after_join']:.3f} | "
            f"{r['in_flight_on_b_at_delete']} | {r['drain_s']:.3f} | {r['dispatched_to_b_after_delete']} | "
            f"{r['requests']} | {r['failed_or_incomplete']} |"
        )
    lines.append("")
    for join, sm in summary.items():
        lines.append(
            f"- `{join}`: took traffic within one scrape interval in "
            f"{sm['within_one_scrape_interval']} of "
            f"{sm['trials']} trials (median {sm['first_request_after_join_s_median']:.4f} s), "
            f"served a median of {sm['served_by_b_median']:g} requests in its first 2 s; "
            f"{sm['failed_or_incomplete']} of "
            f"{sm['requests']} requests failed or came back incomplete."
        )
    md = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
