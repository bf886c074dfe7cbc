"""The admission queue through the real gateway: hold, late dispatch, 429 + Retry-After, disconnects.

Each backend is configured with ``max_num_seqs: 1`` (and ``seqs_high_water_frac: 1``), so one
request in flight makes it "full" and the next one waits in the router. After every test the
ledger and the queue are exactly empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from typing import Any

import aiohttp
import pytest

from hetroute.app import ADMISSION
from tests.conftest import MODEL, Emu, EmulateFn, Gateway, GatewayFn, backend_entry, eventually, metric_sum


def one_seq(emu: Emu) -> dict[str, Any]:
    return {**backend_entry(emu), "max_num_seqs": 1}


ONE = {"full": {"seqs_high_water_frac": 1.0}}  # with max_num_seqs 1: one in flight is full


def queue_len(gw: Gateway) -> int:
    return len(gw.app[ADMISSION].queue)


def drained(gw: Gateway) -> bool:
    return gw.ledger.is_zero() and queue_len(gw) == 0


async def streamed(s: aiohttp.ClientSession, gw: Gateway, body: dict[str, Any]) -> bytes:
    """One streamed completion through the gateway; it must be answered 200."""
    async with s.post(gw.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_second_request_waits_then_runs_on_the_freed_backend(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    emu = await emulate(speedup=20.0)
    gw = await gateway([one_seq(emu)], admission=ONE)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 300, "stream": True}  # ~0.4 s each
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(streamed(s, gw, body))
        assert await eventually(lambda: gw.ledger.in_flight() == 1)
        second = asyncio.create_task(streamed(s, gw, body))
        assert await eventually(lambda: queue_len(gw) == 1)
        assert gw.ledger.in_flight() == 1  # the queued one is not in the ledger
        outs = await asyncio.gather(first, second)
    assert all(o.rstrip().endswith(b"data: [DONE]") for o in outs)
    assert emu.state.accepted == 2
    assert await eventually(lambda: drained(gw))
    assert metric_sum(gw, "hetroute_queue_wait_seconds_count", outcome="dispatched") == 2


async def test_queue_full_and_wait_timeout_get_429_with_retry_after(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    emu = await emulate(speedup=1.0)  # slow: the first request holds the backend
    classes = [{"name": "default", "max_queue_len": 1, "max_queue_wait_s": 0.3, "retry_after_s": 7}]
    gw = await gateway([one_seq(emu)], admission={**ONE, "classes": classes})
    long_body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        hold = await s.post(gw.url + "/v1/completions", json=long_body)
        assert hold.status == 200
        waiting = asyncio.create_task(s.post(gw.url + "/v1/completions", json=long_body))
        assert await eventually(lambda: queue_len(gw) == 1)
        async with s.post(gw.url + "/v1/completions", json=long_body) as full:
            assert full.status == 429
            assert full.headers["Retry-After"] == "7"
            err = json.loads(await full.read())["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        timed_out = await waiting
        assert timed_out.status == 429
        assert timed_out.headers["Retry-After"] == "7"
        assert json.loads(await timed_out.read())["error"]["code"] == "wait_timeout"
        timed_out.close()
        hold.close()
    assert emu.state.accepted == 1  # nothing shed ever reached the backend
    assert await eventually(lambda: drained(gw) and not emu.state.lives)
    assert metric_sum(gw, "hetroute_queue_shed_total", reason="queue_full") == 1
    assert metric_sum(gw, "hetroute_queue_shed_total", reason="wait_timeout") == 1


async def test_tgi_client_gets_429_in_tgi_shape(emulate: EmulateFn, gateway: GatewayFn) -> None:
    emu = await emulate("tgi", speedup=1.0)
    no_queue = [{"name": "default", "max_queue_len": 0}]
    gw = await gateway([one_seq(emu)], admission={**ONE, "classes": no_queue})
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2000}}
    async with aiohttp.ClientSession() as s:
        hold = await s.post(gw.url + "/generate_stream", json=body)
        assert hold.status == 200
        async with s.post(gw.url + "/generate", json=body) as shed:
            assert shed.status == 429
            assert shed.headers["Retry-After"] == "60"
            assert json.loads(await shed.read())["error_type"] == "overloaded"
        hold.close()
    assert await eventually(lambda: drained(gw) and not emu.state.lives)
    assert emu.state.accepted == 1


async def test_client_gone_while_queued_leaves_at_once_and_never_reaches_the_ledger(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    emu = await emulate(speedup=1.0)
    gw = await gateway([one_seq(emu)], admission=ONE)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        hold = await s.post(gw.url + "/v1/completions", json=body)
        queued = asyncio.create_task(s.post(gw.url + "/v1/completions", json=body))
        assert await eventually(lambda: queue_len(gw) == 1)
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
        assert await eventually(lambda: queue_len(gw) == 0, timeout_s=1.0)
        assert int(gw.ledger.dispatched_total.sum()) == 1
        hold.close()
    assert await eventually(lambda: drained(gw) and not emu.state.lives)
    assert emu.state.accepted == 1
    assert metric_sum(gw, "hetroute_queue_disconnects_total") == 1


async def test_priority_header_and_api_key_order_the_queue(emulate: EmulateFn, gateway: GatewayFn) -> None:
    emu = await emulate(speedup=20.0)
    admission = {
        **ONE,
        "classes": [{"name": "interactive"}, {"name": "batch", "ageing_s": 60}],
        "api_keys": {"sk-vip": {"class": "interactive", "tenant": "vip"}},
    }
    gw = await gateway([one_seq(emu)], admission=admission)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 30, "stream": False}
    order: list[str] = []
    async with aiohttp.ClientSession() as s:

        async def one(tag: str, headers: dict[str, str]) -> None:
            sent = {**body, "max_tokens": 400} if tag == "hold" else body  # holds the backend ~0.5 s
            async with s.post(gw.url + "/v1/completions", json=sent, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
                order.append(tag)

        tasks = [asyncio.create_task(one("hold", {}))]
        assert await eventually(lambda: gw.ledger.in_flight() == 1)
        tasks.append(asyncio.create_task(one("batch", {"x-hetroute-priority": "batch"})))
        assert await eventually(lambda: queue_len(gw) == 1)
        tasks.append(asyncio.create_task(one("header", {"x-hetroute-priority": "interactive"})))
        assert await eventually(lambda: queue_len(gw) == 2)
        tasks.append(asyncio.create_task(one("key", {"Authorization": "Bearer sk-vip"})))
        assert await eventually(lambda: queue_len(gw) == 3)
        await asyncio.gather(*tasks)
    assert order == ["hold", "header", "key", "batch"]
    assert await eventually(lambda: drained(gw))


async def test_queue_off_dispatches_everything_at_once(emulate: EmulateFn, gateway: GatewayFn) -> None:
    emu = await emulate(speedup=1.0)
    gw = await gateway([one_seq(emu)], admission={"enabled": False})
    assert ADMISSION not in gw.app
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        resps = [await s.post(gw.url + "/v1/completions", json=body) for _ in range(2)]
        assert [r.status for r in resps] == [200, 200]
        assert gw.ledger.in_flight() == 2
        for r in resps:
            r.close()
    assert await eventually(lambda: gw.ledger.is_zero() and not emu.state.lives)


async def test_a_backend_added_while_requests_wait_takes_them_at_once(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate(name="a", speedup=10.0), await emulate(name="b", speedup=10.0)
    admission = {**ONE, "recheck_s": 30.0}  # only a wake-up can dispatch the waiter in time
    gw = await gateway([one_seq(a)], admission=admission, admin_token="tok")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 300, "stream": True}  # ~0.8 s each on a
    async with aiohttp.ClientSession() as s:

        async def one() -> tuple[str, bytes]:
            async with s.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                return resp.headers["x-hetroute-backend"], await resp.read()

        first = asyncio.create_task(one())
        assert await eventually(lambda: gw.ledger.in_flight() == 1)
        second = asyncio.create_task(one())
        assert await eventually(lambda: queue_len(gw) == 1)
        headers = {"Authorization": "Bearer tok"}
        async with s.post(gw.url + "/admin/backends", json=one_seq(b), headers=headers) as r:
            assert r.status == 201
        assert await eventually(lambda: queue_len(gw) == 0, timeout_s=0.3)  # long before a frees
        assert gw.ledger.in_flight() == 2
        outs = await asyncio.gather(first, second)
    assert sorted(backend for backend, _ in outs) == ["a", "b"]
    assert all(o.rstrip().endswith(b"data: [DONE]") for _, o in outs)
    assert await eventually(lambda: drained(gw))


def sequence_limit(gw: Gateway, backend: str) -> float:
    return metric_sum(gw, "hetroute_queue_sequence_limit", backend=backend)


async def test_the_queue_exports_each_backends_sequence_limit_and_learns_an_unknown_one(
    emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    """``hetroute_queue_sequence_limit``: a configured ``max_num_seqs`` as it is; a backend with none
    (served under a name no catalog knows) is NaN, named in a warning at start-up, until two scrapes
    in a row show its engine running the same count with requests waiting."""
    known = await emulate(name="known", speedup=20.0)
    blind = await emulate(name="blind", speedup=20.0, max_num_seqs=2)
    with caplog.at_level(logging.WARNING, logger="hetroute.app"):
        gw = await gateway([one_seq(known), backend_entry(blind)], admission=ONE)
    warned = [r.getMessage() for r in caplog.records if "max_num_seqs" in r.getMessage()]
    assert len(warned) == 1 and "blind" in warned[0] and "known" not in warned[0]
    assert sequence_limit(gw, "known") == 1.0
    assert math.isnan(sequence_limit(gw, "blind"))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": True}  # ~1 s each
    async with aiohttp.ClientSession() as s:
        # "known" holds one at a time; the rest go to "blind", whose engine runs 2 and queues the
        # others. The queue reads scrapes when it places a request, so requests keep arriving.
        tasks: list[asyncio.Task[bytes]] = []
        for _ in range(40):
            tasks.append(asyncio.create_task(streamed(s, gw, body)))
            await asyncio.sleep(0.05)
            if sequence_limit(gw, "blind") == 3.0:  # 2 running + 1
                break
        assert sequence_limit(gw, "blind") == 3.0
        outs = await asyncio.gather(*tasks)
    assert all(o.rstrip().endswith(b"data: [DONE]") for o in outs)
    assert blind.state.accepted + known.state.accepted == len(tasks) < 40
    assert sequence_limit(gw, "known") == 1.0
    assert await eventually(lambda: drained(gw))
