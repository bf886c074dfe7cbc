"""A client that goes away cancels the upstream request and releases the ledger."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually


async def test_disconnect_mid_stream_aborts_upstream(emulate: EmulateFn, gateway: GatewayFn) -> None:
    slow = await emulate(speedup=1.0)  # real-time V100: ~tens of ms per token
    gw = await gateway([slow])
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/completions", json=body)
        assert resp.status == 200
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        assert len(slow.state.lives) == 1 and gw.ledger.in_flight() == 1
        resp.close()  # the client goes away mid-stream
    assert await eventually(lambda: not slow.state.lives and gw.ledger.is_zero(), timeout_s=2.0)
    assert slow.state.metrics.finished_by_reason["abort"] == 1


async def test_disconnect_before_first_byte_aborts_upstream(emulate: EmulateFn, gateway: GatewayFn) -> None:
    slow = await emulate(speedup=1.0)
    gw = await gateway([slow])
    # non-stream: no byte reaches the client before the whole (long) answer is ready
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": False}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(gw.url + "/v1/completions", json=body))
        assert await eventually(lambda: len(slow.state.lives) == 1, timeout_s=2.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert await eventually(lambda: not slow.state.lives and gw.ledger.is_zero(), timeout_s=2.0)
    assert slow.state.metrics.finished_by_reason["abort"] == 1
