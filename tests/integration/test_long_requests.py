"""Issue 12, item 7: a long non-streaming request is bounded by ``request_s``, not by
``first_byte_s``; it is not retried after a timeout unless configured, and a slow request
does not eject a backend that is still answering."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from hetroute.app import HEALTH
from hetroute.sim.emulator_faults import FaultConfig
from tests.conftest import MODEL, EmulateFn, GatewayFn, metric_sum

LONG = {"model": MODEL, "prompt": "hello", "max_tokens": 40}


async def _post(url: str, body: dict[str, object]) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.read(), r.headers.get("x-hetroute-backend", "")


async def test_non_streaming_request_longer_than_first_byte_s_completes_once(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    slow_a, slow_b = await emulate(speedup=2.0), await emulate(speedup=2.0)
    gw = await gateway(
        [slow_a, slow_b],
        timeouts={"first_byte_s": 0.2, "request_s": 30.0},
        health={"consecutive_failures": 1},
    )
    t0 = time.monotonic()
    status, data, _ = await _post(gw.url, LONG)
    assert status == 200, data
    assert time.monotonic() - t0 > 0.2  # it really outlived first_byte_s
    assert json.loads(data)["usage"]["completion_tokens"] == 40
    assert slow_a.state.accepted + slow_b.state.accepted == 1  # the engine work was done once
    assert metric_sum(gw, "hetroute_retries_total") == 0
    assert gw.app[HEALTH].available_count() == 2 and gw.ledger.is_zero()


async def test_request_s_expiry_is_504_and_not_retried(emulate: EmulateFn, gateway: GatewayFn) -> None:
    hung, good = await emulate(faults=FaultConfig(hang_rate=1.0)), await emulate()
    gw = await gateway([hung, good], timeouts={"request_s": 0.3})
    status, data, backend = await _post(gw.url, {**LONG, "max_tokens": 4})
    assert status == 504 and backend == hung.name
    assert json.loads(data)["error"]["type"] == "timeout_error"
    assert hung.state.accepted == 1 and good.state.accepted == 0
    assert metric_sum(gw, "hetroute_retries_total") == 0 and gw.ledger.is_zero()
    assert gw.app[HEALTH].states[0].consecutive_failures == 1  # no sign of life: it counts


async def test_request_s_expiry_is_retried_when_configured(emulate: EmulateFn, gateway: GatewayFn) -> None:
    hung, good = await emulate(faults=FaultConfig(hang_rate=1.0)), await emulate()
    gw = await gateway([hung, good], timeouts={"request_s": 0.3}, retries={"retry_request_timeouts": True})
    status, _, backend = await _post(gw.url, {**LONG, "max_tokens": 4})
    assert status == 200 and backend == good.name
    assert hung.state.accepted == 1 and good.state.accepted == 1 and gw.ledger.is_zero()


async def test_slow_request_on_a_working_backend_is_not_a_failure(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    emu = await emulate(speedup=2.0)
    gw = await gateway([emu], timeouts={"request_s": 0.6}, health={"consecutive_failures": 1})
    slow = asyncio.ensure_future(_post(gw.url, {**LONG, "max_tokens": 200}))  # outlives request_s
    await asyncio.sleep(0.05)
    status, _, _ = await _post(gw.url, {**LONG, "max_tokens": 2})  # completes meanwhile
    assert status == 200
    status, _, _ = await slow
    assert status == 504
    assert gw.app[HEALTH].states[0].consecutive_failures == 0 and gw.app[HEALTH].is_available(0)
    assert gw.ledger.is_zero()
