"""Passive ejection and its recovery, active probes, and 503 when nothing is healthy."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from hetroute.app import HEALTH
from hetroute.sim.emulator_faults import FaultConfig
from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[int, str]:
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-hetroute-backend", "")


async def test_ejection_then_recovery(emulate: EmulateFn, gateway: GatewayFn) -> None:
    bad, good = await emulate(faults=FaultConfig(error_rate=1.0)), await emulate()
    gw = await gateway(
        [bad, good],
        health={
            "consecutive_failures": 2,
            "base_ejection_s": 0.4,
            "max_ejection_s": 1.0,
            "max_ejection_percent": 50,
        },
    )
    health = gw.app[HEALTH]
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            assert (await _post(s, gw.url, BODY)) == (200, good.name)
        assert not health.is_available(0) and bad.state.accepted == 2
        async with s.get(gw.url + "/admin/backends") as r:
            admin = json.loads(await r.read())
        assert admin["backends"][0]["health"]["ejected"] is True
        assert admin["backends"][0]["health"]["ejections_total"] == 1
        for _ in range(4):  # ejected: no new traffic at all
            assert (await _post(s, gw.url, BODY)) == (200, good.name)
        assert bad.state.accepted == 2
        bad.state.faults = FaultConfig()  # the backend heals
        assert await eventually(lambda: health.is_available(0), timeout_s=1.0)
        seen = {(await _post(s, gw.url, BODY))[1] for _ in range(4)}
        assert seen == {bad.name, good.name}
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
        assert f'hetroute_ejections_total{{backend="{bad.name}"}} 1.0' in text
    assert gw.ledger.is_zero()


async def test_crashed_backend_is_probed_out_and_no_healthy_backend_gives_503(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    crashy = await emulate(faults=FaultConfig(crash_after_requests=0))
    gw = await gateway(
        [crashy],
        health={"probe_interval_s": 0.05, "unhealthy_threshold": 1, "consecutive_failures": 100},
        retries={"max_attempts": 1},
    )
    async with aiohttp.ClientSession() as s:
        status, _ = await _post(s, gw.url, BODY)  # crashes the emulator: connection dropped
        assert status == 502
        assert await eventually(lambda: not gw.app[HEALTH].is_available(0))
        async with s.post(gw.url + "/v1/completions", json=BODY) as r:
            assert r.status == 503
            err = json.loads(await r.read())["error"]
        assert "no healthy backend" in err["message"] and err["type"] == "service_unavailable"
        async with s.post(gw.url + "/generate", json={"inputs": "x"}) as r:
            assert r.status == 404  # no TGI backend configured
        async with s.get(gw.url + "/health") as r:
            assert r.status == 503
        async with s.get(gw.url + "/v1/models") as r:
            assert json.loads(await r.read())["data"] == []
    await asyncio.sleep(0)
    assert gw.ledger.is_zero()
