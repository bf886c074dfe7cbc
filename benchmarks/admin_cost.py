"""Event-loop time of ``GET /admin/backends`` at 4, 16 and 64 backends.

Usage: ``python benchmarks/admin_cost.py [--sizes 4,16,64] [--calls 200]``.
Writes ``benchmarks/results/admin_cost.json`` and ``admin_cost.md``.

Per fleet size it builds the real gateway (``build_app``, default policy, live learning on, prefix
index on; half the backends with a GPU label and TP so the roofline prior is used, half with nothing
known) whose backends are unreachable addresses (the handler reads only the router's own state: the
ledger, health, the latest scrapes, the learned models), serves it on 127.0.0.1 and calls the endpoint
``--calls`` times after a warm-up. The event-loop time of one call is measured inside the process as
the CPU time (``time.thread_time``) the loop's thread spent from the request's arrival to the
response, through an aiohttp middleware, so the client's own work is not counted. Issue 13's bar:
under 1 ms at 16 backends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hetroute.app import build_app, start_app  # noqa: E402
from hetroute.config import config_from_dict  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BAR_MS = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _config(n: int) -> Any:
    backends = []
    for i in range(n):
        entry: dict[str, Any] = {
            "name": f"b{i}",
            "url": f"http://127.0.0.1:{9 + i}",  # nothing listens there: probes and scrapes fail
            "engine": "vllm",
            "models": ["Llama-3-8B"],
        }
        if i % 2 == 0:
            entry |= {"gpu": "A100-80GB", "tp": 1 + (i % 4 == 0)}
        backends.append(entry)
    return config_from_dict(
        {
            "backends": backends,
            "policy": {"type": "default"},
            "server": {"access_log": False},
            "health": {"probe_interval_s": 3600},
            "scrape": {"interval_s": 3600},
        },
        env={},
    )


async def measure(n: int, calls: int) -> dict[str, Any]:
    cpu_ms: list[float] = []

    @web.middleware
    async def timed(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.thread_time()
        response = await handler(request)
        if request.path == "/admin/backends":
            cpu_ms.append((time.thread_time() - started) * 1e3)
        return response

    app = build_app(_config(n), registry=CollectorRegistry())
    app.middlewares.insert(0, timed)
    runner, port = await start_app(app)
    size = 0
    try:
        async with aiohttp.ClientSession() as session:
            for k in range(calls + 20):
                async with session.get(f"http://127.0.0.1:{port}/admin/backends") as resp:
                    body = await resp.read()
                    assert resp.status == 200, body[:200]
                    size = len(body)
                if k == 19:
                    cpu_ms.clear()  # warm-up done
    finally:
        await runner.cleanup()
    return {
        "backends": n,
        "calls": len(cpu_ms),
        "p50_ms": statistics.median(cpu_ms),
        "p99_ms": sorted(cpu_ms)[int(0.99 * (len(cpu_ms) - 1))],
        "mean_ms": statistics.fmean(cpu_ms),
        "body_bytes": size,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", default="4,16,64")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows = [asyncio.run(measure(int(n), args.calls)) for n in args.sizes.split(",")]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    lines = [
        "# Event-loop CPU time of GET /admin/backends",
        "",
        f"`python benchmarks/admin_cost.py --sizes {args.sizes} --calls {args.calls}` on {machine}. "
        f"Bar: under {BAR_MS:g} ms at 16 backends.",
        "",
        "| backends | p50 ms | p99 ms | mean ms | body bytes |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backends']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} | "
            f"{r['body_bytes']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admin_cost.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    (args.out / "admin_cost.md").write_text(text)
    at16 = [r for r in rows if r["backends"] == 16]
    return 0 if not at16 or at16[0]["p50_ms"] < BAR_MS else 1


if __name__ == "__main__":
    sys.exit(main())
