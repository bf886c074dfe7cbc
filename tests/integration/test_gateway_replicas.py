"""Two gateway replicas in front of the same emulated engines: each counts the other's requests from
the engines' scrapes (``scrape.foreign_load``), and its own ledger stays exact."""

from __future__ import annotations

import asyncio

import aiohttp

from hetroute.app import ROUTER
from tests.conftest import MODEL, EmulateFn, Gateway, GatewayFn, eventually, metric_sum

SPEEDUP = 4.0
WAIT_S = 10.0
"""Bound on each wait below (they end as soon as the condition holds)."""


async def _long_request(s: aiohttp.ClientSession, gw: Gateway) -> int:
    # ignore_eos: exactly 400 tokens (~1.8 s at SPEEDUP), so all of them stay in flight for many scrapes
    # (every 0.05 s) even on a loaded machine; with drawn lengths the first could finish within one
    # scrape interval of the last one's arrival
    body = {"model": MODEL, "prompt": "hello " * 50, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with s.post(gw.url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def _admin(s: aiohttp.ClientSession, gw: Gateway) -> dict[str, float]:
    async with s.get(gw.url + "/admin/backends") as r:
        body = await r.json()
    return {b["name"]: b["foreign_requests"] for b in body["backends"]}


async def test_a_replica_counts_the_requests_another_replica_sent(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate(name="a", speedup=SPEEDUP), await emulate(name="b", speedup=SPEEDUP)
    one = await gateway([a, b], policy={"type": "default"})
    two = await gateway([a, b], policy={"type": "default"}, scrape={"foreign_load": "raw"})
    async with aiohttp.ClientSession() as s:
        sent = [asyncio.create_task(_long_request(s, one)) for _ in range(6)]
        assert await eventually(lambda: one.ledger.in_flight() == 6, WAIT_S)
        # Replica two sent nothing; after a scrape its snapshot holds replica one's six requests.
        assert await eventually(lambda: int(two.app[ROUTER].snapshot().requests_in_flight.sum()) == 6, WAIT_S)
        assert two.ledger.in_flight() == 0 and two.ledger.is_zero()
        shown = await _admin(s, two)
        assert sum(shown.values()) == 6.0
        assert metric_sum(two, "hetroute_foreign_requests") == 6.0
        assert sum((await _admin(s, one)).values()) == 0.0  # one's own requests are not foreign to it
        assert await asyncio.gather(*sent) == [200] * 6
        # Once they finish, the next scrapes clear the foreign count.
        assert await eventually(lambda: int(two.app[ROUTER].snapshot().requests_in_flight.sum()) == 0, WAIT_S)
    assert one.ledger.is_zero()


async def test_by_default_a_replica_scales_its_own_load_by_the_engines_ratio(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a", speedup=SPEEDUP)
    one = await gateway([a], policy={"type": "default"})
    two = await gateway([a], policy={"type": "default"})  # scrape.foreign_load: scaled
    async with aiohttp.ClientSession() as s:
        mine = asyncio.create_task(_long_request(s, two))
        assert await eventually(lambda: two.ledger.in_flight() == 1, WAIT_S)
        theirs = [asyncio.create_task(_long_request(s, one)) for _ in range(3)]
        assert await eventually(lambda: one.ledger.in_flight() == 3, WAIT_S)
        # The engine holds 4, replica two sent 1: its load counts as 4 (1 + 3 × its own).
        assert await eventually(lambda: int(two.app[ROUTER].snapshot().requests_in_flight[0]) == 4, WAIT_S)
        assert two.ledger.in_flight() == 1
        assert await asyncio.gather(mine, *theirs) == [200] * 4
    assert one.ledger.is_zero() and two.ledger.is_zero()


async def test_foreign_load_off_keeps_the_replica_blind(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a = await emulate(name="a", speedup=SPEEDUP)
    one = await gateway([a], policy={"type": "default"})
    two = await gateway([a], policy={"type": "default"}, scrape={"foreign_load": "off"})
    async with aiohttp.ClientSession() as s:
        sent = [asyncio.create_task(_long_request(s, one)) for _ in range(3)]
        assert await eventually(lambda: one.ledger.in_flight() == 3, WAIT_S)
        await asyncio.sleep(0.2)  # several scrapes (every 0.05 s)
        assert int(two.app[ROUTER].snapshot().requests_in_flight.sum()) == 0
        assert await asyncio.gather(*sent) == [200] * 3
