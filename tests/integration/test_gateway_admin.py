"""Observability: /admin/backends (bearer token), /metrics, the access log, x-hetroute-backend."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import aiohttp
import pytest

from hetroute.app import METRICS
from hetroute.latency import LatencyParams, LatencyProfile, save_profile
from tests.conftest import MODEL, EmulateFn, GatewayFn, backend_entry, eventually


async def test_admin_requires_token_and_describes_backends(
    emulate: EmulateFn, gateway: GatewayFn, tmp_path: Path
) -> None:
    a, b = await emulate("vllm"), await emulate("tgi")
    profile = LatencyProfile(
        LatencyParams(0, 1e-4, 1e-5, 1e-3, 0, 1e-4, 1e-6, 1e-2), 50000, "vllm:cache_config_info"
    )
    save_profile(profile, tmp_path / "p.yaml")
    gw = await gateway(
        [{**backend_entry(a), "profile": str(tmp_path / "p.yaml"), "labels": {"gpu": "V100", "tp": 4}}, b],
        admin_token="sekret",
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/admin/backends") as r:
            assert r.status == 401
        async with s.get(gw.url + "/admin/backends", headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        assert await eventually(lambda: all(gw.app[METRICS].latest(i) is not None for i in range(2)))
        async with s.post(
            gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}
        ) as r:
            assert r.status == 200
        async with s.get(gw.url + "/admin/backends", headers={"Authorization": "Bearer sekret"}) as r:
            assert r.status == 200
            admin = json.loads(await r.read())
    first, second = admin["backends"]
    assert first["profile"]["path"] == str(tmp_path / "p.yaml")
    assert first["profile"]["kv_capacity_tokens"] == 50000 and first["gpu"] == "V100" and first["tp"] == 4
    assert second["profile"]["path"] is None and "no latency profile" in second["profile"]["note"]
    assert first["ledger"]["dispatched_total"] + second["ledger"]["dispatched_total"] == 1
    assert {"available", "ejected", "times_ejected"} <= set(first["health"])
    assert admin["policy"] == "round_robin" and admin["in_flight"] == 0


async def test_metrics_and_access_log(
    emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    a = await emulate("vllm")
    gw = await gateway([a])
    caplog.set_level(logging.INFO, logger="hetroute.access")
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", json=body, headers={"x-request-id": "req-42"}) as r:
            await r.read()
            assert r.headers["x-hetroute-backend"] == a.name and r.headers["x-request-id"] == "req-42"
        async with s.get(gw.url + "/metrics") as r:
            text = await r.text()
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "hetroute.access"]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == "req-42" and line["backend"] == a.name and line["status"] == 200
    assert (
        line["api"] == "openai"
        and line["model"] == MODEL
        and line["attempts"] == 1
        and line["stream"] is True
    )
    assert line["completion_tokens"] == 4 and line["prompt_tokens"] > 0 and line["policy"] == "round_robin"
    assert line["ttft_s"] is not None and line["duration_s"] >= line["ttft_s"] and line["reason"] is not None
    for name in (
        f'hetroute_requests_total{{api="openai",backend="{a.name}",model="{MODEL}",'
        'policy="round_robin",status="200"} 1.0',
        f'hetroute_ttft_seconds_count{{backend="{a.name}",model="{MODEL}"}} 1.0',
        f'hetroute_inter_token_latency_seconds_count{{backend="{a.name}"}} 1.0',
        'hetroute_routing_decision_seconds_count{policy="round_robin"} 1.0',
        f'hetroute_backend_available{{backend="{a.name}"}} 1.0',
        f'hetroute_requests_in_flight{{backend="{a.name}"}} 0.0',
    ):
        assert name in text, name
