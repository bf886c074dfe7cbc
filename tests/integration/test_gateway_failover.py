"""Fail-over before the first byte, error events after it, and upstream timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
from aiohttp import web

from hetroute.app import HEALTH
from hetroute.sim.emulator_faults import FaultConfig
from tests.conftest import MODEL, EmulateFn, GatewayFn, metric_sum

STREAM = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}

NOT_HUNG_S = 4.0
"""Upper bound showing that the short timeout under test fired, not the fixture's 5 s ones (connect
1 s aside): generous, so that a loaded 2-core machine's scheduling cannot fail it."""


async def _post(url: str, path: str, body: dict[str, object]) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read(), r.headers.get("x-hetroute-backend", "")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_5xx_fails_over_before_first_byte(emulate: EmulateFn, gateway: GatewayFn) -> None:
    bad, good = await emulate(faults=FaultConfig(error_rate=1.0)), await emulate()
    gw = await gateway([bad, good], health={"consecutive_failures": 100})
    for body in (STREAM, {**STREAM, "stream": False}):
        for _ in range(4):
            status, data, backend = await _post(gw.url, "/v1/completions", body)
            assert status == 200 and backend == good.name
    assert bad.state.accepted >= 1 and good.state.accepted == 8
    assert (
        metric_sum(gw, "hetroute_retries_total") == bad.state.accepted
    )  # each failure on `bad` was retried on `good`
    assert gw.ledger.is_zero()


async def test_connection_refused_fails_over(emulate: EmulateFn, gateway: GatewayFn) -> None:
    good = await emulate()
    dead = {"name": "dead", "url": f"http://127.0.0.1:{_closed_port()}", "engine": "vllm", "models": [MODEL]}
    gw = await gateway([dead, good], health={"consecutive_failures": 100})
    for _ in range(4):
        status, data, backend = await _post(gw.url, "/v1/completions", STREAM)
        assert status == 200 and backend == good.name and data.endswith(b"data: [DONE]\n\n")
    assert gw.ledger.is_zero()


async def test_first_byte_timeout_fails_over(emulate: EmulateFn, gateway: GatewayFn) -> None:
    hung, good = await emulate(faults=FaultConfig(hang_rate=1.0)), await emulate()
    gw = await gateway([hung, good], timeouts={"first_byte_s": 0.3}, health={"consecutive_failures": 100})
    t0 = time.monotonic()
    status, _, backend = await _post(gw.url, "/v1/completions", STREAM)
    assert status == 200 and backend == good.name
    assert 0.3 <= time.monotonic() - t0 < NOT_HUNG_S
    assert gw.ledger.is_zero()


async def test_all_backends_failing_returns_the_error_in_api_shape(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    dead = {"name": "dead", "url": f"http://127.0.0.1:{_closed_port()}", "engine": "tgi", "models": [MODEL]}
    gw = await gateway([dead], retries={"max_attempts": 2})
    status, data, backend = await _post(gw.url, "/generate", {"inputs": "x"})
    assert status == 502 and backend == "dead"
    assert set(json.loads(data)) == {"error", "error_type"}
    bad = await emulate(faults=FaultConfig(error_rate=1.0))
    gw2 = await gateway([bad], retries={"max_attempts": 3})
    status, data, _ = await _post(gw2.url, "/v1/completions", STREAM)
    assert status in (500, 503) and "injected fault" in json.loads(data)["error"]["message"]
    assert bad.state.accepted == 1  # only one backend: nothing else to fail over to
    assert gw.ledger.is_zero() and gw2.ledger.is_zero()


async def test_failure_after_first_byte_ends_stream_with_openai_error(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    flaky = await emulate(faults=FaultConfig(fail_mid_stream_after_tokens=3))
    gw = await gateway([flaky])
    t0 = time.monotonic()
    status, data, _ = await _post(gw.url, "/v1/completions", STREAM)
    assert status == 200 and time.monotonic() - t0 < NOT_HUNG_S
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 5  # three tokens, the error, [DONE]
    err = json.loads(events[3].removeprefix(b"data: "))
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert events[4] == b"data: [DONE]"
    assert gw.ledger.is_zero()


async def test_failure_after_first_byte_ends_tgi_stream_with_tgi_error(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    flaky = await emulate("tgi", faults=FaultConfig(fail_mid_stream_after_tokens=2))
    gw = await gateway([flaky])
    status, data, _ = await _post(
        gw.url, "/generate_stream", {"inputs": "hello", "parameters": {"max_new_tokens": 8}}
    )
    events = [e for e in data.split(b"\n\n") if e]
    assert status == 200 and len(events) == 3
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert set(last) == {"error", "error_type"}
    assert gw.ledger.is_zero()


async def test_idle_upstream_mid_stream_times_out(emulate: EmulateFn, gateway: GatewayFn) -> None:
    stall = await emulate(faults=FaultConfig(hang_rate=1.0, hang_after_tokens=2))
    gw = await gateway([stall], timeouts={"idle_s": 0.3})
    t0 = time.monotonic()
    status, data, _ = await _post(gw.url, "/v1/completions", STREAM)
    assert status == 200 and 0.3 <= time.monotonic() - t0 < NOT_HUNG_S
    assert b"idle for more than 0.3 s" in data and data.endswith(b"data: [DONE]\n\n")
    assert gw.ledger.is_zero()


async def test_pooled_connection_closed_by_upstream_is_retried_fresh(gateway: GatewayFn) -> None:
    """llama.cpp closes its socket after every stream although it advertised keep-alive.

    The emulator has no such quirk, so a minimal server plays it: the second request on a
    connection is dropped before any byte. With one backend and one attempt, only a retry on
    a fresh connection can answer 200.
    """
    seen: list[asyncio.BaseTransport] = []  # kept alive, so identities are never reused

    async def completions(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        if any(t is transport for t in seen):
            transport.abort()  # the stale pooled socket: nothing answered
            return web.Response()
        seen.append(transport)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n')
        await resp.write(
            b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\ndata: [DONE]\n\n'
        )
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        backend = {
            "name": "llamacpp",
            "url": f"http://127.0.0.1:{port}",
            "engine": "openai",
            "models": [MODEL],
        }
        gw = await gateway([backend], retries={"max_attempts": 1}, health={"consecutive_failures": 1})
        for _ in range(3):
            status, data, name = await _post(gw.url, "/v1/completions", STREAM)
            assert status == 200 and name == "llamacpp" and data.endswith(b"data: [DONE]\n\n"), data
        assert len(seen) == 3  # every request after the first needed a fresh connection
        assert gw.app[HEALTH].is_available(0)  # not counted as a backend failure
        assert gw.ledger.is_zero()
    finally:
        await runner.cleanup()
