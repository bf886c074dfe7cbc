"""A subset of the policy benchmark through the real gateway in front of ``hetroute emulate`` servers.

Usage: ``python benchmarks/policies_gateway.py [--requests 400] [--rates 24,inf] [--speedup 2]
[--policies round_robin,weighted_round_robin,workload_minmax,default]``.
Writes ``benchmarks/results/policies_gateway.json`` and ``policies_gateway.md``.

Per (policy, rate) it starts fresh processes: two emulated vLLM servers (paper §5 A: Llama-3-8B on
V100-SXM2-32GB at TP4 and TP1, ``--speedup K``) and ``hetroute serve`` with that policy, then replays a
seeded ShareGPT-like workload open-loop: each request is a streamed ``/v1/completions`` call at its
arrival time / K, with a prompt of I tokens (4 characters per token, the emulator's count) and
``max_tokens = O`` with ``ignore_eos`` (as vLLM's benchmark client does; the predictor therefore never
predicts more than O). Times are converted back to model seconds (× K). Reported: throughput
((I + O) / makespan), p99 TTFT, requests per backend (from ``/admin/backends``).

Caveat: on a 2-core machine the gateway, both emulators and this client share the CPU; CPU
contention shows up as extra latency that the simulator does not have. Keep K small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from hetroute.sim.emulator_text import filler_prompt
from hetroute.sim.workload import SimRequest, generate_workload

RESULTS = Path(__file__).resolve().parent / "results"
HETROUTE = [sys.executable, "-m", "hetroute"]
MODEL = "Llama-3-8B"
BACKENDS = (("v100-tp4", 4), ("v100-tp1", 1))
ADMIN_TOKEN = "bench"


_HANDED_OUT: set[int] = set()
"""Ports this benchmark process has already handed out (see :func:`free_port`)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that this process has not handed out before. A port is free when
    picked but is bound only when the server started on it is up, so without the record a later pick
    could return a port an emulator is still starting on: the gateway given it then failed to bind,
    and the client talked straight to that emulator (seen once)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port that was not handed out already")


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (TimeoutError, aiohttp.ClientError):
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


async def stop_processes(procs: Sequence[asyncio.subprocess.Process]) -> None:
    """SIGTERM every process still running, then wait up to 10 s each before SIGKILL."""
    for p in procs:
        if p.returncode is None:
            p.terminate()
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 10)
        except TimeoutError:
            p.kill()
            await p.wait()


def summarise(work: Sequence[SimRequest], out: Sequence[tuple[float, float, bool]]) -> dict[str, float | int]:
    """Completed and failed counts, throughput ((I + O) of completed requests / makespan) and p50/p99
    TTFT of a replay's :func:`one_request` results (model seconds; NaN when nothing completed)."""
    ok = [o for o in out if o[2]]
    tokens = sum(r.input_tokens + r.output_tokens for r, o in zip(work, out, strict=True) if o[2])
    makespan = max(o[1] for o in ok) if ok else math.nan
    ttft = np.array([o[0] for o in ok])
    return {
        "completed": len(ok),
        "failed": len(out) - len(ok),
        "throughput_tokens_s": tokens / makespan if ok else math.nan,
        "makespan_s": makespan,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ok else math.nan,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ok else math.nan,
    }


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    req: SimRequest,
    start: float,
    speedup: float,
    model: str = MODEL,
    routed: dict[str, str] | None = None,
) -> tuple[float, float, bool]:
    """(ttft_s, end_s) in model seconds from the request's arrival; ok flag. ``model``: the served
    model name the request asks for; ``routed``: where given, gets the backend the router named
    (``x-hetroute-backend``) under the request's id."""
    await asyncio.sleep(max(0.0, start + req.arrival_s / speedup - time.monotonic()))
    sent = time.monotonic()
    body = {
        "model": model,
        "prompt": filler_prompt(req.input_tokens, req.request_id),  # no shared prefix
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    first = math.nan
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
            if routed is not None:
                routed[req.request_id] = r.headers.get("x-hetroute-backend", "")
            if r.status != 200:
                await r.read()
                return math.nan, math.nan, False
            async for _ in r.content.iter_any():
                if math.isnan(first):
                    first = time.monotonic()
    except (TimeoutError, aiohttp.ClientError):
        return math.nan, math.nan, False
    end = time.monotonic()
    return (first - sent) * speedup, (end - start) * speedup, True


async def run_one(
    policy: str, params: dict[str, object], rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    procs: list[asyncio.subprocess.Process] = []
    tmp = Path(tempfile.mkdtemp(prefix="hetroute-bench-"))
    try:
        backends = []
        for name, tp in BACKENDS:
            port = free_port()
            cmd = [*HETROUTE, "emulate", "--gpu", "V100-SXM2-32GB", "--model", MODEL, "--tp", str(tp)]
            cmd += ["--port", str(port), "--speedup", str(args.speedup), "--seed", "1"]
            procs.append(
                await asyncio.create_subprocess_exec(
                    *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
            )
            backends.append(
                {
                    "name": name,
                    "url": f"http://127.0.0.1:{port}",
                    "engine": "vllm",
                    "models": [MODEL],
                    "gpu": "V100-SXM2-32GB",
                    "tp": tp,
                    "weight": tp,
                }
            )
        gw_port = free_port()
        config = {
            "seed": 1,
            "admin_token": ADMIN_TOKEN,
            "server": {"host": "127.0.0.1", "port": gw_port, "access_log": False},
            "policy": {"type": policy, "params": params},
            "scrape": {"interval_s": max(0.05, 1.0 / args.speedup)},
            "backends": backends,
        }
        cfg = tmp / "router.yaml"
        cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
        procs.append(
            await asyncio.create_subprocess_exec(
                *HETROUTE,
                "serve",
                "--config",
                str(cfg),
                "--log-level",
                "WARNING",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        )
        work = generate_workload("sharegpt", args.requests, rate, args.seed, 2048)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            for b in backends:
                await wait_ready(session, f"{b['url']}/health")
            base = f"http://127.0.0.1:{gw_port}"
            await wait_ready(session, f"{base}/v1/models")
            start = time.monotonic()
            out = await asyncio.gather(
                *(one_request(session, f"{base}/v1/completions", r, start, args.speedup) for r in work)
            )
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with session.get(f"{base}/admin/backends", headers=headers) as r:
                admin = await r.json() if r.status == 200 else {}
        return {
            "policy": policy,
            "params": params,
            "rate": "inf" if math.isinf(rate) else f"{rate:g}",
            **summarise(work, out),
            "admin_backends": admin,
        }
    finally:
        await stop_processes(procs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rates", default="24,inf")
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default="round_robin,weighted_round_robin,workload_minmax,default")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rates = [math.inf if r == "inf" else float(r) for r in args.rates.split(",")]
    rows = []
    started = time.perf_counter()
    for rate in rates:
        for policy in args.policies.split(","):
            params: dict[str, object] = {"weights": [4, 1]} if policy == "weighted_round_robin" else {}
            row = asyncio.run(run_one(policy, params, rate, args))
            rows.append(row)
            print(
                f"{row['rate']:>4} {policy:22s} {row['throughput_tokens_s']:8.0f} tok/s  "
                f"p99 TTFT {row['ttft_p99_s']:.2f} s  done {row['completed']} failed {row['failed']}",
                flush=True,
            )
    doc = {
        "benchmark": "policies_gateway",
        "requests": args.requests,
        "speedup": args.speedup,
        "seed": args.seed,
        "elapsed_s": time.perf_counter() - started,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "gpu": None,
        },
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(doc, default=str).replace("NaN", "null"))
    (args.out / "policies_gateway.json").write_text(json.dumps(clean, indent=1) + "\n", encoding="utf-8")
    lines = [
        f"# Gateway + emulators (paper-a, {args.requests} requests, speedup {args.speedup:g}, "
        f"seed {args.seed})",
        "",
        "| rate | policy | throughput tok/s | ×RR | p99 TTFT s | completed | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rr = next((r for r in rows if r["rate"] == row["rate"] and r["policy"] == "round_robin"), None)
        ratio = row["throughput_tokens_s"] / rr["throughput_tokens_s"] if rr else math.nan
        lines.append(
            f"| {row['rate']} | {row['policy']} | {row['throughput_tokens_s']:.0f} | {ratio:.3f} | "
            f"{row['ttft_p99_s']:.2f} | {row['completed']} | {row['failed']} |"
        )
    (args.out / "policies_gateway.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
