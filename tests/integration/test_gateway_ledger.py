"""After a mixed run of successes, errors, timeouts and disconnects the ledger is exactly zero."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from hetroute.sim.emulator_faults import FaultConfig
from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually, metric_sum


async def _one(s: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    stream = rng.random() < 0.6
    api = rng.choice(["completions", "chat", "tgi"])
    n = rng.randint(1, 30)
    body: dict[str, object]
    if api == "tgi":
        path, body = (
            ("/generate_stream" if stream else "/generate"),
            {"inputs": "hello " * n, "parameters": {"max_new_tokens": n}},
        )
    elif api == "chat":
        path = "/v1/chat/completions"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi " * n}],
            "max_tokens": n,
            "stream": stream,
        }
    else:
        path, body = (
            "/v1/completions",
            {"model": MODEL, "prompt": "x " * n, "max_tokens": n, "stream": stream},
        )
    disconnect = stream and rng.random() < 0.2
    async with s.post(url + path, json=body) as r:
        if disconnect:
            await r.content.readany()
            r.close()
            return "disconnect"
        await r.read()
        return str(r.status)


async def test_mixed_run_returns_ledger_to_zero(emulate: EmulateFn, gateway: GatewayFn) -> None:
    backends = [
        await emulate("vllm", faults=FaultConfig(error_rate=0.2)),
        await emulate("tgi", faults=FaultConfig(fail_mid_stream_after_tokens=5)),
        await emulate("vllm", faults=FaultConfig(hang_rate=0.3, hang_after_tokens=3)),
        await emulate("tgi", faults=FaultConfig(hang_rate=0.2)),
    ]
    gw = await gateway(
        backends,
        policy={"type": "least_outstanding"},
        timeouts={"first_byte_s": 0.3, "idle_s": 0.3},
        health={"consecutive_failures": 1000},
    )
    rng = random.Random(11)
    async with aiohttp.ClientSession() as s:
        outcomes = await asyncio.gather(*(_one(s, gw.url, rng) for _ in range(60)))
    assert {"200", "disconnect"} <= set(outcomes)
    # the mix really contained upstream errors, timeouts (retried) and client disconnects
    assert metric_sum(gw, "hetroute_retries_total") > 0
    assert metric_sum(gw, "hetroute_requests_total", status="502") > 0
    assert metric_sum(gw, "hetroute_requests_total", status="499") > 0
    assert await eventually(gw.ledger.is_zero, timeout_s=3.0)
    led = gw.ledger
    assert int(led.dispatched_total.sum()) == int(led.released_total.sum()) >= 60
