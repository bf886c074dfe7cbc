"""``hetroute demo``: the paper's heterogeneous pair, emulated, routed two ways, in one process.

Owns the demo scenario only: two emulated vLLM engines serving Llama-3-8B on V100-SXM2-32GB
GPUs, one at TP=4 and one at TP=1 (the paper's experiment A pair), a seeded ShareGPT-like
mixed workload (completions and chat, streamed and not) sent over real HTTP on 127.0.0.1
through the real gateway, once with ``round_robin`` and once with ``default`` (the best
policy hetroute has), then a side-by-side table. No GPU is needed: engine timing comes from
the roofline model, divided by ``--speedup``. Times in the table are emulated GPU seconds
(wall × speedup). ``--serve`` then keeps a router running for curl or the ``openai`` client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from hetroute.app import LEDGER, build_app, start_app
from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
from hetroute.config import config_from_dict
from hetroute.policies import resolve_policy_name
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.engine_model import EngineConfig, EngineModel
from hetroute.sim.workload import SimRequest, generate_workload

GPU = "V100-SXM2-32GB"
MODEL = "Llama-3-8B"
PAIR = (("v100-tp4", 4), ("v100-tp1", 1))


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo",
        help="emulated heterogeneous pair: round_robin vs hetroute's default policy",
        description=(
            "Start two emulated vLLM backends (Llama-3-8B on V100 at TP=4 and TP=1) and the router in "
            "this process, send the same mixed workload (completions and chat, half streamed) through "
            "round_robin and through the default policy, print a per-policy, per-backend table "
            "(throughput, TTFT and end-to-end p50/p99) and exit 0. No GPU needed."
        ),
    )
    p.add_argument("--requests", type=int, default=300, help="requests per policy run (default 300)")
    p.add_argument("--rate", type=float, default=16.0, help="arrival rate in emulated req/s (default 16)")
    p.add_argument("--speedup", type=float, default=3.0, help="emulated time runs K× faster (default 3)")
    p.add_argument("--seed", type=int, default=0, help="workload and policy seed (default 0)")
    p.add_argument("--serve", action="store_true", help="afterwards keep the router running (Ctrl-C stops)")
    p.add_argument("--port", type=int, default=8000, help="router port for --serve (default 8000)")
    p.set_defaults(func=run)


@dataclass
class Result:
    backend: str
    ttft_s: float | None  # streamed requests only
    e2e_s: float
    tokens: int
    ok: bool


@dataclass
class RunReport:
    policy: str
    makespan_s: float
    results: list[Result] = field(default_factory=list)


def _prompt(tokens: int) -> str:
    return ("lorem ipsum dolor sit amet " * (tokens // 5 + 1))[: 4 * tokens]  # the emulator: 4 chars/token


def _body(req: SimRequest, kind: tuple[bool, bool]) -> tuple[str, dict[str, Any]]:
    stream, chat = kind
    common: dict[str, Any] = {"model": MODEL, "max_tokens": req.output_tokens, "ignore_eos": True}
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if chat:
        return "/v1/chat/completions", {
            **common,
            "messages": [{"role": "user", "content": _prompt(req.input_tokens)}],
        }
    return "/v1/completions", {**common, "prompt": _prompt(req.input_tokens)}


async def _send(
    session: aiohttp.ClientSession, url: str, req: SimRequest, kind: tuple[bool, bool], speedup: float
) -> Result:
    path, body = _body(req, kind)
    t0 = time.perf_counter()
    ttft: float | None = None
    async with session.post(url + path, json=body) as r:
        backend = r.headers.get("x-hetroute-backend", "?")
        raw = b""
        async for chunk in r.content.iter_any():
            ttft = time.perf_counter() - t0 if ttft is None else ttft
            raw += chunk
        ok = r.status == 200
    e2e = time.perf_counter() - t0
    tokens = 0
    if ok:
        text = raw.split(b"data: [DONE]")[0]
        usage_src = text.rsplit(b"data: ", 1)[-1] if body.get("stream") else text
        usage = json.loads(usage_src).get("usage") or {}
        tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
    first = ttft * speedup if ttft is not None and body.get("stream") else None
    return Result(backend, first, e2e * speedup, tokens, ok)


async def _stack(
    stack: AsyncExitStack, policy: str, speedup: float, seed: int, port: int = 0
) -> tuple[str, Any]:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    gpu, model = lookup_gpu(gpus, GPU), lookup_model(models, MODEL)
    backends = []
    for name, tp in PAIR:
        app = build_emulator_app(
            EngineModel(EngineConfig(gpu, model, tp)),
            served_model=MODEL,
            engine_kind="vllm",
            speedup=speedup,
            seed=seed,
        )
        url = await stack.enter_async_context(run_emulator(app))
        backends.append({"name": name, "url": url, "engine": "vllm", "models": [MODEL], "gpu": GPU, "tp": tp})
    cfg = config_from_dict(
        {
            "backends": backends,
            "policy": {"type": policy},
            "seed": seed,
            "server": {"access_log": False, "shutdown_grace_s": 1},
            "scrape": {"interval_s": 0.2},
        },
        env={},
    )
    gateway = build_app(cfg)
    runner, bound = await start_app(gateway, "127.0.0.1", port)
    stack.push_async_callback(runner.cleanup)
    return f"http://127.0.0.1:{bound}", gateway


async def _run_policy(policy: str, workload: list[SimRequest], speedup: float, seed: int) -> RunReport:
    rng = random.Random(seed)  # which requests stream / use chat: the same for every policy
    kinds = [(rng.random() < 0.5, rng.random() < 0.3) for _ in workload]
    async with AsyncExitStack() as stack:
        url, gateway = await _stack(stack, policy, speedup, seed)
        done = 0
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            start = time.perf_counter()

            async def one(i: int, req: SimRequest) -> Result:
                nonlocal done
                await asyncio.sleep(max(0.0, start + req.arrival_s / speedup - time.perf_counter()))
                result = await _send(session, url, req, kinds[i], speedup)
                done += 1
                return result

            tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(workload)]
            tty = sys.stdout.isatty()
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=1.0 if tty else 5.0)
                end = "" if tty else "\n"
                print(f"\r  {policy:>12}: {done:4d}/{len(workload)} requests done", end=end, flush=True)
            if tty:
                print()
            results = [t.result() for t in tasks]
            makespan = (time.perf_counter() - start) * speedup
        if not gateway[LEDGER].is_zero():
            raise RuntimeError("ledger did not return to zero")
    return RunReport(policy, makespan, results)


def _p(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):6.2f}" if values else "     -"


def _table(reports: list[RunReport]) -> str:
    lines = []
    head = f"{'policy':>24} {'tok/s':>8} {'ok':>5} | {'backend':>9} {'reqs':>5} {'tokens':>7} {'TTFT p50':>8} {'p99':>6} {'E2E p50':>8} {'p99':>6}"  # noqa: E501
    lines += [head, "-" * len(head)]
    for rep in reports:
        total = sum(r.tokens for r in rep.results)
        ok = sum(r.ok for r in rep.results)
        for j, (name, _) in enumerate(PAIR):
            mine = [r for r in rep.results if r.backend == name and r.ok]
            ttfts = [r.ttft_s for r in mine if r.ttft_s is not None]
            left = f"{rep.policy:>24} {total / rep.makespan_s:8.0f} {ok:5d}" if j == 0 else " " * 39
            lines.append(
                f"{left} | {name:>9} {len(mine):5d} {sum(r.tokens for r in mine):7d} "
                f"{_p(ttfts, 50):>8} {_p(ttfts, 99)} "
                f"{_p([r.e2e_s for r in mine], 50):>8} {_p([r.e2e_s for r in mine], 99)}"
            )
    return "\n".join(lines)


async def _serve(args: argparse.Namespace, policy: str) -> None:
    async with AsyncExitStack() as stack:
        url, _ = await _stack(stack, policy, args.speedup, args.seed, args.port)
        print(f"\nrouter running at {url} (policy {policy}); try:")
        print(f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\")
        print(f'       -d \'{{"model": "{MODEL}", "prompt": "Hello", "max_tokens": 16}}\'')
        print(f"  python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='x'); "
              f"print(c.completions.create(model='{MODEL}', prompt='Hi', max_tokens=8))\"")  # fmt: skip
        print(f"  curl {url}/admin/backends    (Ctrl-C stops)")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


async def _main(args: argparse.Namespace) -> int:
    workload = generate_workload("sharegpt", args.requests, args.rate, args.seed, 2048, send_max_tokens=True)
    best = resolve_policy_name("default")
    print(
        f"hetroute demo: {MODEL} on {GPU} at TP=4 and TP=1 (emulated, {args.speedup:g}x real time);\n"
        f"{args.requests} ShareGPT-like requests at {args.rate:g} req/s, completions and chat, half streamed."
    )
    reports = []
    for policy in ("round_robin", "default"):
        rep = await _run_policy(policy, workload, args.speedup, args.seed)
        rep.policy = f"{policy} ({best})" if policy == "default" else policy
        reports.append(rep)
    print(
        "\nthroughput = (prompt + completion tokens) / makespan; TTFT over streamed requests;"
        " times in emulated GPU seconds\n"
    )
    print(_table(reports))
    base, best_tps = (sum(r.tokens for r in rep.results) / rep.makespan_s for rep in reports)
    print(f"\n{reports[1].policy} vs round_robin: {100 * (best_tps / base - 1):+.1f}% throughput")
    if args.serve:
        await _serve(args, "default")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.rate <= 0 or args.speedup <= 0:
        print("hetroute demo: --requests, --rate and --speedup must be positive", file=sys.stderr)
        return 2
    return asyncio.run(_main(args))
