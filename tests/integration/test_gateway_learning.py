"""Live latency learning through the real gateway in front of emulated engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import aiohttp

from hetroute.app import LEARNER
from hetroute.backends.discovery import discover
from hetroute.config import quick_config
from hetroute.sim.emulator_faults import FaultConfig
from tests.conftest import MODEL, EmulateFn, Gateway, GatewayFn, backend_entry, eventually, metric_sum

HOUSE = "house-llm"
LEARNING = {"refit_interval_s": 0.05}


async def _send(gw: Gateway, n: int, *, stream: bool = True, model: str | None = HOUSE) -> list[int]:
    async def one(s: aiohttp.ClientSession, k: int) -> int:
        body: dict[str, Any] = {"prompt": "word " * (20 + 7 * k), "max_tokens": 8 + k % 9, "stream": stream}
        if model is not None:
            body["model"] = model
        async with s.post(gw.url + "/v1/completions", json=body) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        statuses = []
        for start in range(0, n, 8):  # waves of 8: the backends see varied batch sizes
            statuses += await asyncio.gather(*(one(s, k) for k in range(start, min(n, start + 8))))
        return statuses


async def _admin(gw: Gateway) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/backends") as r:
        assert r.status == 200
        out: dict[str, Any] = json.loads(await r.read())
        return out


def _entry(emu: Any, gpu: str, tp: int) -> dict[str, Any]:
    return {**backend_entry(emu), "models": [HOUSE], "labels": {"gpu": gpu, "tp": tp}}


async def test_an_unknown_model_is_learned_from_traffic_and_shown_in_admin_and_metrics(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(gpu="V100-SXM2-32GB", tp=4, served_model=HOUSE)
    b = await emulate(gpu="V100-SXM2-32GB", tp=1, served_model=HOUSE)
    gw = await gateway(
        [_entry(a, "V100-SXM2-32GB", 4), _entry(b, "V100-SXM2-32GB", 1)],
        policy={"type": "default"},
        learning=LEARNING,
    )
    assert all(s == 200 for s in await _send(gw, 48))
    # The refit publishes what the requests recorded (they only append): wait for one after the last.
    assert await eventually(lambda: metric_sum(gw, "hetroute_model_samples") == 48)
    admin = await _admin(gw)
    for backend in admin["backends"]:
        learned = backend["learned_model"]
        # The catalog does not know "house-llm": learning starts from the neutral default, never silently.
        assert learned["prior"]["kind"] == "neutral"
        assert "neutral default" in backend["model_sources"]
        assert learned["samples"] >= 1 and learned["observed_total"] == learned["samples"]
        assert set(learned["params"]) == {f"p{k}" for k in range(1, 9)}
        assert {"value", "stderr", "prior", "source"} <= set(learned["params"]["p8"])
    assert sum(b["learned_model"]["samples"] for b in admin["backends"]) == 48
    assert metric_sum(gw, "hetroute_model_e2e_error_ratio") >= 0.0
    assert gw.ledger.is_zero()


async def test_a_backend_that_only_fails_never_enters_the_fit(emulate: EmulateFn, gateway: GatewayFn) -> None:
    good = await emulate(served_model=HOUSE)
    bad = await emulate(served_model=HOUSE, faults=FaultConfig(error_rate=1.0))
    gw = await gateway(
        [_entry(good, "V100-SXM2-32GB", 1), _entry(bad, "V100-SXM2-32GB", 1)],
        policy={"type": "default"},
        learning=LEARNING,
        health={"consecutive_failures": 1000},
    )
    learner = gw.app[LEARNER]
    before = learner.params[1].tolist()
    statuses = await _send(gw, 24)
    assert statuses == [200] * 24, statuses  # failed over before the first byte
    assert await eventually(lambda: learner.fit_of(0) is not None)
    assert learner.observed_total(1) == 0 and learner.fit_of(1) is None
    # Nothing known, the same engine reporting the same KV capacity: the failing backend publishes the
    # pooled fit of the two, which holds only the good one's requests (docs/learning.md, "Nothing-known
    # peers pool their traffic"), so its model equals the good one's, not the neutral default.
    assert learner.params[1].tolist() == learner.params[0].tolist() != before
    assert str(learner.describe(1)["published_from"]).startswith("pooled fit of ")
    assert learner.observed_total(0) == 24
    assert gw.ledger.is_zero()


async def test_non_streaming_requests_teach_the_model_too(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a = await emulate(served_model=HOUSE)
    gw = await gateway([_entry(a, "V100-SXM2-32GB", 1)], policy={"type": "default"}, learning=LEARNING)
    assert all(s == 200 for s in await _send(gw, 16, stream=False))
    learner = gw.app[LEARNER]
    assert await eventually(lambda: (fit := learner.fit_of(0)) is not None and fit.samples == 16)
    fit = learner.fit_of(0)
    assert fit is not None and fit.e2e_mape == fit.e2e_mape  # e2e rows, not NaN


async def test_learned_models_persist_across_restarts(
    emulate: EmulateFn, gateway: GatewayFn, tmp_path: Path
) -> None:
    a = await emulate(served_model=HOUSE)
    entries = [_entry(a, "V100-SXM2-32GB", 1)]
    learning = {**LEARNING, "state_dir": str(tmp_path)}
    app_runner_gw = await gateway(entries, policy={"type": "default"}, learning=learning)
    assert all(s == 200 for s in await _send(app_runner_gw, 16))
    learner = app_runner_gw.app[LEARNER]
    assert await eventually(lambda: (fit := learner.fit_of(0)) is not None and fit.samples == 16)
    learned = learner.params[0].tolist()
    await app_runner_gw.app.shutdown()
    await app_runner_gw.app.cleanup()  # the cleanup context saves the models
    saved = tmp_path / f"{entries[0]['name']}.yaml"
    assert saved.is_file() and "source: live" in saved.read_text()
    again = await gateway(entries, policy={"type": "default"}, learning=learning)
    restarted = again.app[LEARNER]
    assert restarted.prior_of(0).kind == "saved"
    assert restarted.params[0].tolist() == learned


async def test_a_request_without_model_goes_to_the_only_model(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a = await emulate()
    gw = await gateway([a])
    assert await _send(gw, 2, model=None) == [200, 200]
    b = await emulate(served_model="other")
    gw2 = await gateway([a, {**backend_entry(b), "models": ["other"]}])
    body = {"messages": [{"role": "user"}]}
    async with aiohttp.ClientSession() as s, s.post(gw2.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
        assert error["param"] == "model" and MODEL in error["message"] and "other" in error["message"]
    assert gw.ledger.is_zero() and gw2.ledger.is_zero()


async def test_served_model_aliases_and_vllm_root_find_the_catalog_prior(emulate: EmulateFn) -> None:
    alias = await emulate(served_model="meta-llama/Meta-Llama-3-8B")  # a usual HF id, not the catalog's
    house = await emulate(served_model=HOUSE)  # vLLM's `root` names the weights behind the house name
    cfg = await discover(quick_config([alias.url, house.url], env={}))
    specs = cfg.specs()
    assert specs[1].models == (HOUSE,) and specs[1].labels["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    from hetroute.policies.backend_model import BackendModels

    gpu = [dataclasses.replace(s, gpu="V100-SXM2-32GB") for s in specs]
    models = BackendModels.from_specs(gpu)
    assert [m.latency_source.split(" (")[0] for m in models.models] == ["roofline prior", "roofline prior"]
