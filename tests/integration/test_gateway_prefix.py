"""Prefix-cache locality and session affinity through the real gateway in front of emulated vLLMs."""

from __future__ import annotations

import aiohttp

from hetroute.app import ROUTER
from hetroute.proxy.api_errors import BACKEND_HEADER
from tests.conftest import EmulateFn, Gateway, GatewayFn, metric_sum

SHARED = "You are a careful assistant. " * 120  # ≈ 3,360 characters: 13 chunks of 256


async def _complete(
    s: aiohttp.ClientSession, gw: Gateway, prompt: str, headers: dict[str, str] | None = None, **extra: object
) -> str:
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, **extra}
    async with s.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers[BACKEND_HEADER]


async def _engine_hits(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the emulator exports no vllm:prefix_cache_hits_total")


async def test_requests_sharing_a_long_prefix_follow_the_backend_that_caches_it(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate(name="a"), await emulate(name="b")
    gw = await gateway([a, b], policy={"type": "default"})
    async with aiohttp.ClientSession() as s:
        first = await _complete(s, gw, SHARED + "question 0")
        chosen = [await _complete(s, gw, SHARED + f"question {k}") for k in range(1, 8)]
        assert chosen == [first] * 7
        home = a if first == "a" else b
        other = b if home is a else a
        assert await _engine_hits(s, home.url) >= 7 * 12 * 64 * 0.9  # the shared chunks hit each time
        assert await _engine_hits(s, other.url) == 0.0
        # An unrelated prompt is free to go anywhere; the index now holds both prompts' chunks.
        await _complete(s, gw, "Something else entirely. " * 40)
    assert metric_sum(gw, "hetroute_prefix_index_chunks", backend=first) >= 13
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/backends") as r:
        admin = await r.json()
    shown = {b["name"]: b["prefix_index"] for b in admin["backends"]}
    assert shown[first]["chunks"] >= 13 and 0.05 <= shown[first]["trust"] <= 1.0
    assert 0.5 < metric_sum(gw, "hetroute_prefix_expected_hit_ratio") < 1.0
    assert metric_sum(gw, "hetroute_prefix_index_bytes") > 0
    assert gw.ledger.is_zero()


async def test_a_session_stays_on_its_backend_while_the_load_model_agrees(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate(name="a"), await emulate(name="b")
    gw = await gateway([a, b], policy={"type": "default"}, prefix={"session_header": "x-conversation"})
    async with aiohttp.ClientSession() as s:
        by_header = {await _complete(s, gw, f"hi {k}", headers={"x-conversation": "c1"}) for k in range(8)}
        by_user = {await _complete(s, gw, f"hello {k}", user="alice") for k in range(8)}
    assert len(by_header) == 1 and len(by_user) == 1
    assert gw.ledger.is_zero()


async def test_an_empty_session_header_turns_session_affinity_off_user_field_included(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate(name="a"), await emulate(name="b")
    on = await gateway([a, b], policy={"type": "default"})
    off = await gateway([a, b], policy={"type": "default"}, prefix={"session_header": ""})
    async with aiohttp.ClientSession() as s:
        for gw in (on, off):
            await _complete(s, gw, "hello", user="alice", headers={"x-session-id": "s1"})
    on_prefix, off_prefix = on.app[ROUTER].prefix, off.app[ROUTER].prefix
    assert on_prefix is not None and off_prefix is not None
    assert len(on_prefix.sessions) == 1  # the header (else `user`) names a session
    assert len(off_prefix.sessions) == 0  # "": neither the header nor `user`
    assert on.ledger.is_zero() and off.ledger.is_zero()


async def test_prefix_routing_can_be_turned_off(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a, b = await emulate(name="a"), await emulate(name="b")
    gw = await gateway([a, b], policy={"type": "round_robin"}, prefix={"enabled": False})
    async with aiohttp.ClientSession() as s:
        chosen = [await _complete(s, gw, SHARED + f"q {k}") for k in range(4)]
    assert chosen == ["a", "b", "a", "b"]
    assert metric_sum(gw, "hetroute_prefix_index_bytes") == 0.0  # no index, no gauge
    assert gw.ledger.is_zero()
