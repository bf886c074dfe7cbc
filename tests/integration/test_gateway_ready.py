"""``/ready`` (readiness) and ``/live`` (liveness) over real HTTP, as a Kubernetes kubelet probes them.

``/ready`` is 200 only once a backend has passed a health check (or served a request) and is still
available; before that, and when every backend is down, it is 503 with a JSON body. ``/live`` is 200
whatever the backends' state, so a liveness probe never restarts a router whose backends are down.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp

from hetroute.app import HEALTH
from hetroute.sim.emulator_faults import FaultConfig
from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually

FAST_PROBES = {"probe_interval_s": 0.05, "unhealthy_threshold": 1}


async def _get(url: str) -> tuple[int, str, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, r.content_type, json.loads(await r.read())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_ready_waits_for_a_backend_that_passed_a_probe(emulate: EmulateFn, gateway: GatewayFn) -> None:
    loading = await emulate(faults=FaultConfig(slow_start_s=0.6))  # vLLM still loading its weights
    gw = await gateway([loading], health=FAST_PROBES)
    status, ctype, body = await _get(gw.url + "/ready")
    assert (status, ctype) == (503, "application/json")
    assert body["status"] == "not ready" and body["discovered_backends"] == 1
    assert body["healthy_backends"] == 0 and body["reason"]
    assert (await _get(gw.url + "/live"))[:2] == (200, "application/json")

    for _ in range(150):  # bounded (3 s): the emulator answers its probes after 0.6 s
        status, _, body = await _get(gw.url + "/ready")
        if status == 200:
            break
        await asyncio.sleep(0.02)
    assert status == 200
    assert body == {"status": "ready", "discovered_backends": 1, "healthy_backends": 1}


async def test_ready_is_503_when_every_backend_is_down_but_live_stays_200(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    dead = {"name": "dead", "url": f"http://127.0.0.1:{_closed_port()}", "engine": "vllm", "models": [MODEL]}
    crashy = await emulate(faults=FaultConfig(crash_after_requests=0))
    gw = await gateway([dead, crashy], health=FAST_PROBES, retries={"max_attempts": 1})
    health = gw.app[HEALTH]
    assert await eventually(lambda: health.confirmed_available_count() == 1)
    status, _, body = await _get(gw.url + "/ready")
    assert status == 200 and body["healthy_backends"] == 1 and body["discovered_backends"] == 2
    async with aiohttp.ClientSession() as s:
        body_json = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        async with s.post(gw.url + "/v1/completions", json=body_json) as r:
            assert r.status == 502  # the request crashes the only live backend
    assert await eventually(lambda: health.available_count() == 0)
    status, _, body = await _get(gw.url + "/ready")
    assert status == 503 and body["healthy_backends"] == 0 and body["status"] == "not ready"
    assert await _get(gw.url + "/live") == (200, "application/json", {"status": "alive"})


async def test_ready_and_live_reject_other_methods(emulate: EmulateFn, gateway: GatewayFn) -> None:
    gw = await gateway([await emulate()])
    async with aiohttp.ClientSession() as s:
        for path in ("/ready", "/live"):
            async with s.post(gw.url + path) as r:
                assert r.status == 405, path
