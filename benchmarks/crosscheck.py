"""Cross-check: the same workload through the real gateway + emulators and through the simulator.

The gateway run starts one in-process ``hetroute emulate`` app per instance of the cluster (the same
:class:`EngineModel` the simulator uses, running ``speedup`` times faster than real time) and the real
gateway (``hetroute.app.build_app``) in front of them, on 127.0.0.1, then replays the workload: each
request is sent at ``arrival_s / speedup`` wall seconds with a prompt of exactly ``input_tokens``
tokens (the emulator counts ceil(chars / 4)) that starts with the request id, so the emulators' prefix
cache serves none of it (the workload's requests share no content), and ``max_tokens = output_tokens``
with ``ignore_eos``.
Throughput is (prompt + completion tokens from the responses' ``usage``) / makespan, the makespan
converted back to virtual seconds (× speedup). The simulator runs the same cluster, workload, policy
and seed. Run:

    python benchmarks/crosscheck.py            # paper-a, 400 requests at 24 req/s, speedup 2, three policies

Measured on the 2-core dev machine (other jobs running): round_robin 5287 vs 5281 tok/s,
weighted_round_robin 6828 vs 6826, default 8073 vs 8067 (simulator vs gateway; ≤ 0.1 % apart, same
per-backend split); in a noisier run default differed by 1.6 %. A run at rate ``inf`` is not a fair
comparison: the client and gateway need about 1 s of wall time to admit 200 requests, so the "burst"
reaches the engines spread out, while the simulator delivers it at one instant.

``tests/integration/test_sim_vs_gateway.py`` runs a small case and asserts agreement within 5 %.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass

import aiohttp

from hetroute.app import build_app, start_app
from hetroute.config import config_from_dict
from hetroute.sim.cluster_file import Fleet, build_fleet
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.emulator_text import filler_prompt
from hetroute.sim.engine_model import EngineModel
from hetroute.sim.prompt_text import PromptRenderer
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import SimRequest, generate_workload, parse_rate
from hetroute.simulation.simulator import run_simulation

GATEWAY_SCRAPE_INTERVAL_S = 1.0
LAG_PROBE_S = 0.005


@dataclass(frozen=True, slots=True)
class Measured:
    """Throughput of one run in virtual time."""

    makespan_s: float
    tokens: int
    per_backend: Mapping[str, int]
    loop_lag_p99_s: float = 0.0
    """Gateway runs: p99 of how late a 5 ms timer fired; large values mean the process was starved of CPU."""

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s


def gateway_config(
    fleet: Fleet,
    urls: Sequence[str],
    policy: str,
    params: Mapping[str, object],
    seed: int,
    scrape_interval_s: float,
) -> dict[str, object]:
    """The router config for the emulated cluster (engine, model, GPU and KV capacity given, no discovery)."""
    backends = [
        {
            "name": b.name,
            "url": url,
            "engine": b.engine,
            "models": list(b.models),
            "weight": b.weight,
            "gpu": b.gpu,
            "tp": b.tp,
            "kv_capacity_tokens": b.kv_capacity_tokens,
            "max_num_seqs": b.max_num_seqs,
        }
        for b, url in zip(fleet.backends, urls, strict=True)
    ]
    return {
        "backends": backends,
        "policy": {"type": policy, "params": dict(params)},
        "seed": seed,
        "scrape": {"interval_s": scrape_interval_s},
        "server": {"access_log": False},
    }


_RENDER = PromptRenderer()


async def _send(session: aiohttp.ClientSession, url: str, model: str, req: SimRequest) -> tuple[int, str]:
    body: dict[str, object] = {
        "model": model,
        # A workload with prompt segments shares exactly those prefixes (the engines cache them, as in
        # the simulator); without, no two prompts share a block.
        "prompt": _RENDER.completion_prompt(req)
        if req.segments
        else filler_prompt(req.input_tokens, req.request_id),
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": False,
    }
    if req.session:
        body["user"] = req.session
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"request {req.request_id}: HTTP {resp.status}: {data}")
        usage = data["usage"]
        if usage["prompt_tokens"] != req.input_tokens or usage["completion_tokens"] != req.output_tokens:
            raise RuntimeError(f"request {req.request_id}: usage {usage} differs from the workload")
        return int(usage["prompt_tokens"] + usage["completion_tokens"]), resp.headers.get(
            "x-hetroute-backend", ""
        )


async def run_gateway(
    fleet: Fleet,
    workload: Sequence[SimRequest],
    policy: str,
    params: Mapping[str, object],
    *,
    speedup: float,
    seed: int = 0,
    timeout_s: float = 120.0,
) -> Measured:
    """Replay ``workload`` through the real gateway in front of emulators; throughput in virtual time."""
    model = fleet.default_model
    async with AsyncExitStack() as stack:
        urls = []
        for k, (config, flavour) in enumerate(zip(fleet.configs, fleet.flavours, strict=True)):
            app = build_emulator_app(
                EngineModel(config),
                served_model=model,
                engine_kind=flavour,
                speedup=speedup,
                seed=seed + k,
                max_concurrent_requests=1_000_000,
            )
            urls.append(await stack.enter_async_context(run_emulator(app)))
        cfg = config_from_dict(
            gateway_config(fleet, urls, policy, params, seed, GATEWAY_SCRAPE_INTERVAL_S / speedup), env={}
        )
        runner, port = await start_app(build_app(cfg, seed=seed))
        stack.push_async_callback(runner.cleanup)
        gateway = f"http://127.0.0.1:{port}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout, connector=connector))
        async with session.get(f"{gateway}/health") as warm:  # open the client connection before t0
            await warm.read()
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(req: SimRequest) -> tuple[int, str, float]:
            delay = t0 + req.arrival_s / speedup - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tokens, backend = await _send(session, gateway, model, req)
            return tokens, backend, loop.time()

        lags: list[float] = []

        async def watch_lag() -> None:
            while True:
                before = loop.time()
                await asyncio.sleep(LAG_PROBE_S)
                lags.append(loop.time() - before - LAG_PROBE_S)

        watcher = asyncio.create_task(watch_lag())
        try:
            results = await asyncio.gather(*(one(r) for r in workload))
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
    end = max(t for _, _, t in results)
    per_backend: dict[str, int] = {}
    for _, backend, _ in results:
        per_backend[backend] = per_backend.get(backend, 0) + 1
    lag_p99 = sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else 0.0
    return Measured((end - t0) * speedup, sum(t for t, _, _ in results), per_backend, lag_p99)


def run_simulator(
    fleet: Fleet, workload: Sequence[SimRequest], policy: str, params: Mapping[str, object], seed: int = 0
) -> Measured:
    res = run_simulation(
        fleet, workload, policy, params, seed=seed, scrape_interval_s=GATEWAY_SCRAPE_INTERVAL_S
    )
    per_backend = {i.name: i.requests for i in res.instances}
    return Measured(res.makespan_s, res.input_tokens + res.output_tokens, per_backend)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="paper-a")
    parser.add_argument("--workload", default="sharegpt")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", default="24")
    parser.add_argument("--policies", default="round_robin,weighted_round_robin,default")
    parser.add_argument("--speedup", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    fleet = build_fleet(get_scenario(args.scenario).cluster())
    rate = parse_rate(args.rate)
    work = generate_workload(
        args.workload,
        args.requests,
        math.inf if rate == "trace" else rate,
        args.seed,
        fleet.max_model_len(),
        send_max_tokens=True,
    )
    worst = 0.0
    for policy in args.policies.split(","):
        sim = run_simulator(fleet, work, policy, {}, args.seed)
        started = time.perf_counter()
        gw = asyncio.run(run_gateway(fleet, work, policy, {}, speedup=args.speedup, seed=args.seed))
        wall = time.perf_counter() - started
        diff = gw.throughput_tokens_per_s / sim.throughput_tokens_per_s - 1.0
        worst = max(worst, abs(diff))
        print(
            f"{policy:<22} simulator {sim.throughput_tokens_per_s:8.0f} tok/s "
            f"(makespan {sim.makespan_s:6.2f} s)  gateway {gw.throughput_tokens_per_s:8.0f} tok/s "
            f"(makespan {gw.makespan_s:6.2f} s, {wall:.1f} s wall, "
            f"loop lag p99 {gw.loop_lag_p99_s * 1e3:.1f} ms)  "
            f"diff {diff * 100:+.1f} %  "
            f"split sim {dict(sim.per_backend)} gateway {dict(gw.per_backend)}"
        )
    print(
        f"worst |difference| {worst * 100:.1f} % "
        f"(speedup {args.speedup:g}, {args.requests} requests, rate {args.rate})"
    )
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
