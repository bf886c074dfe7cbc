"""The gateway half of benchmarks/prefix.py: real gateways in front of emulated engines on 127.0.0.1.

Per (fleet, workload, load, policy): fresh emulators (one per instance, vLLM prefix caching on, time
sped up ``--speedup`` times), a fresh ``hetroute serve`` with that policy and its defaults (learning
on, prefix index on), then the workload's requests as streamed ``/v1/completions`` whose prompt text
shares exactly the workload's segments (``sim/prompt_text.py``; the OpenAI ``user`` field carries the
session). Reported in model seconds (wall × speedup) like the simulator: throughput, TTFT p50/p99, the
engines' hit rate from their own ``vllm:prefix_cache_*_total`` counters, the router's estimate and its
index memory from the gateway's ``/metrics``. With ``blind`` (``--blind``) the engines serve a house model
name (``HOUSE_MODEL``) and the gateway's entries carry no GPU or TP labels: every backend starts on the
neutral default and is learned from its own traffic, as in front of engines the catalog does not know.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
HETROUTE = [sys.executable, "-m", "hetroute"]
HOUSE_MODEL = "house-llm"
"""The served-model name of the ``--blind`` runs: no catalog entry matches it."""


def _metric(text: str, name: str) -> float:
    """Sum of the samples of the gateway's own metric ``name`` in exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _send(
    session: Any, url: str, model: str, req: Any, prompt: str, start: float, k: float
) -> tuple[float, float]:
    import aiohttp

    await asyncio.sleep(max(0.0, start + req.arrival_s / k - time.monotonic()))
    sent = time.monotonic()
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    if req.session:
        body["user"] = req.session
    first = math.nan
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
            if r.status != 200:
                await r.read()
                return math.nan, math.nan
            async for _ in r.content.iter_any():
                if math.isnan(first):
                    first = time.monotonic()
    except (TimeoutError, aiohttp.ClientError):
        return math.nan, math.nan
    return (first - sent) * k, (time.monotonic() - start) * k


def queue_waits(text: str) -> float:
    """Requests the gateway's admission queue held (waited more than 0 s), from its ``/metrics``
    ``text``: the count of ``hetroute_queue_wait_seconds`` less its ``le="0.0"`` bucket."""
    total = _metric(text, "hetroute_queue_wait_seconds_count")
    at_once = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hetroute_queue_wait_seconds_bucket{") and 'le="0.0"' in line
    )
    return total - at_once


async def one_run(
    fleet: Any,
    workload: list[Any],
    policy: str,
    params: dict[str, object],
    k: float,
    blind: bool = False,
    queue: bool = False,
) -> dict[str, Any]:
    import aiohttp
    import yaml

    from hetroute.backends.engines import parse_vllm
    from hetroute.sim.prompt_text import PromptRenderer

    sys.path.insert(0, str(HERE))
    from policies_gateway import free_port, wait_ready

    renderer = PromptRenderer()
    prompts = [renderer.completion_prompt(r) for r in workload]
    model = fleet.backends[0].models[0]
    served = HOUSE_MODEL if blind else model
    procs: list[asyncio.subprocess.Process] = []
    tmp = Path(tempfile.mkdtemp(prefix="hetroute-prefix-"))
    try:
        entries, emu_urls = [], []
        for i, b in enumerate(fleet.backends):
            port = free_port()
            cmd = [*HETROUTE, "emulate", "--gpu", str(b.gpu), "--model", model, "--tp", str(b.tp)]
            cmd += ["--port", str(port), "--speedup", f"{k:g}", "--seed", str(i)]
            cmd += ["--served-model-name", served] if blind else []
            procs.append(
                await asyncio.create_subprocess_exec(
                    *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
            )
            url = f"http://127.0.0.1:{port}"
            emu_urls.append(url)
            labels = {} if blind else {"gpu": str(b.gpu), "tp": str(b.tp)}
            entries.append(
                {"name": b.name, "url": url, "engine": "vllm", "models": [served], "labels": labels}
            )
        gw_port = free_port()
        config = {
            "server": {"host": "127.0.0.1", "port": gw_port, "access_log": False},
            "policy": {"type": policy, "params": params},
            "scrape": {"interval_s": max(0.05, 1.0 / k)},
            "learning": {"refit_interval_s": 1.0 / k, "half_life_s": 30.0 / k},
            "backends": entries,
        }
        if queue:
            from prefix import UNBOUNDED_QUEUE

            config["admission"] = UNBOUNDED_QUEUE
        cfg = tmp / "router.yaml"
        cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
        procs.append(
            await asyncio.create_subprocess_exec(
                *HETROUTE, "serve", "--config", str(cfg), "--log-level", "ERROR",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
        )  # fmt: skip
        gw = f"http://127.0.0.1:{gw_port}"
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            for url in emu_urls:
                await wait_ready(s, url + "/health")
            await wait_ready(s, gw + "/v1/models")
            start = time.monotonic() + 0.5
            results = await asyncio.gather(
                *(
                    _send(s, gw + "/v1/completions", served, r, p, start, k)
                    for r, p in zip(workload, prompts, strict=True)
                )
            )
            hits = queries = 0.0
            for url in emu_urls:
                async with s.get(url + "/metrics") as r:
                    scraped = parse_vllm(await r.text())  # the gateway's own scraper
                hits += scraped.prefix_cache_hits_total or 0.0
                queries += scraped.prefix_cache_queries_total or 0.0
            async with s.get(gw + "/metrics") as r:
                gw_text = await r.text()
    finally:
        for p in procs:
            if p.returncode is None:
                p.terminate()
        for p in procs:
            await p.wait()
    ttft = np.array([t for t, _ in results], dtype=np.float64)
    ends = np.array([e for _, e in results], dtype=np.float64)
    done = ~np.isnan(ends)
    tokens = sum(r.input_tokens + r.output_tokens for r, ok in zip(workload, done, strict=True) if ok)
    makespan = float(np.nanmax(ends)) - workload[0].arrival_s if done.any() else math.nan
    return {
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "ttft_p50_s": float(np.nanpercentile(ttft, 50)),
        "ttft_p99_s": float(np.nanpercentile(ttft, 99)),
        "engine_hit_rate": hits / queries if queries else 0.0,
        "router_hit_estimate": _metric(gw_text, "hetroute_prefix_expected_hit_ratio"),
        "router_index_mib": _metric(gw_text, "hetroute_prefix_index_bytes") / 2**20,
        "completed": int(done.sum()),
        "requests": len(workload),
        **({"queue_waits": queue_waits(gw_text)} if queue else {}),
    }


def gateway_part(
    args: argparse.Namespace, on_row: Callable[[list[dict[str, Any]]], None]
) -> list[dict[str, Any]]:
    """Every run through the gateway; ``on_row`` gets the rows so far after each run. The loads are
    fractions of the simulated no-sharing capacity of the same fleet, nothing known with ``--blind``
    (as the simulator's ``--blind`` table)."""
    from prefix import (
        POLICIES,
        cell_rate,
        fleet_of,
        kept_rows,
        pinned_rates,
        planned_cells,
        sim_run,
        window_of,
        workload_of,
    )

    def capacity_of(name: str) -> float:
        """The simulated no-sharing capacity of the fleet, nothing known with ``--blind``."""
        base = workload_of("no-sharing", 2000, math.inf, 0, window_of(name, args.max_model_len))
        return float(sim_run(fleet_of(name, args.blind), base, "default-no-prefix", True)["throughput_tok_s"])

    cells = planned_cells(args)
    pinned = pinned_rates(args, cells)
    rows = kept_rows(args, cells)
    capacities: dict[str, float] = {}
    for fleet_name, kind, load in cells:
        fleet = fleet_of(fleet_name, False)
        rate = cell_rate(
            (fleet_name, kind, load), pinned, capacities, capacity_of, args.requests, args.max_model_len
        )
        for seed in args.seeds:
            wl = workload_of(kind, args.requests, rate, seed, window_of(fleet_name, args.max_model_len))
            for policy in args.policies:
                name, params = POLICIES[policy]
                started = time.perf_counter()
                run = one_run(fleet, wl, name, dict(params), args.speedup, args.blind, args.queue)
                row = asyncio.run(run)
                row.update(policy=policy, fleet=fleet_name, workload=kind, load=load, rate=rate, seed=seed)
                row.update(queue=args.queue)
                rows.append(row)
                on_row(rows)
                print(
                    f"  {kind:14s} load {load:.2f} seed {seed} {policy:18s} "
                    f"{row['throughput_tok_s']:9,.0f} tok/s  ttft p50 {row['ttft_p50_s']:7.3f} "
                    f"p99 {row['ttft_p99_s']:7.3f}  hit {row['engine_hit_rate']:.3f} "
                    f"(router {row['router_hit_estimate']:.3f}, {row['router_index_mib']:.1f} MiB) "
                    f"done {row['completed']}/{row['requests']} "
                    + (f"queued {row['queue_waits']:.0f} " if args.queue else "")
                    + f"[{time.perf_counter() - started:.0f}s]",
                    flush=True,
                )
    return rows
