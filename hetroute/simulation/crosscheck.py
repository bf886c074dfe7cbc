"""Cross-check harness: the same workload through the real gateway + emulators and through the simulator.

The gateway run (:func:`run_gateway`) starts one in-process ``hetroute emulate`` app per instance of the
cluster (the same :class:`EngineModel` the simulator uses, running ``speedup`` times faster than real
time) and the real gateway (``hetroute.app.build_app``) in front of them, on 127.0.0.1, then replays the
workload: each request is sent at ``arrival_s / speedup`` wall seconds with a prompt of exactly
``input_tokens`` tokens (the emulator counts ceil(chars / 4)) that starts with the request id, so the
emulators' prefix cache serves none of it (the workload's requests share no content), and
``max_tokens = output_tokens`` with ``ignore_eos``. Throughput is (prompt + completion tokens from the
responses' ``usage``) / makespan, the makespan converted back to virtual seconds (× speedup).
:func:`run_simulator` runs the same cluster, workload, policy and seed in the simulator.

Used by ``benchmarks/crosscheck.py`` (larger cases, measured figures in its docstring) and by
``tests/integration/test_sim_vs_gateway.py`` (a small case, agreement within 5 %).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass

import aiohttp

from hetroute.app import build_app, start_app
from hetroute.config import config_from_dict
from hetroute.sim.cluster_file import Fleet
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.emulator_text import filler_prompt
from hetroute.sim.engine_model import EngineModel
from hetroute.sim.prompt_text import PromptRenderer
from hetroute.sim.workload import SimRequest
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
