"""A request's output limit through the gateway: the context window is discovered from the engines, the
output-length prediction never exceeds what the window leaves after the prompt, and outputs that stopped
at a limit (``max_tokens``, the window) are not learned as output lengths below the estimate
(hetroute/output_limits.py, predictors/online.py "Cut outputs")."""

from __future__ import annotations

import asyncio

import aiohttp

from hetroute.app_keys import FORWARDER, ROUTER
from hetroute.backends.discovery import discover
from hetroute.config import config_from_dict, quick_config
from predictors.online import OnlineQuantilePredictor
from tests.conftest import MODEL, EmulateFn, GatewayFn, backend_entry, eventually


async def _window_of(url: str, path: str, key: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + path) as resp:
        body = await resp.json()
    value = body["data"][0][key] if path == "/v1/models" else body[key]
    assert isinstance(value, int)
    return value


async def test_discovery_reads_the_context_window_of_vllm_and_tgi(emulate: EmulateFn) -> None:
    vllm, tgi = await emulate("vllm"), await emulate("tgi", served_model="tgi-model")
    expected = [
        await _window_of(vllm.url, "/v1/models", "max_model_len"),
        await _window_of(tgi.url, "/info", "max_total_tokens"),
    ]
    cfg = await discover(quick_config([vllm.url, tgi.url], env={}))
    assert [b.max_model_len for b in cfg.backends] == expected and expected[0] > 1
    assert [s.max_model_len for s in cfg.specs()] == expected
    configured = config_from_dict({"backends": [{"url": vllm.url, "max_model_len": 4096}]}, env={})
    assert (await discover(configured)).backends[0].max_model_len == 4096  # the config wins


async def test_the_router_takes_the_largest_window_only_when_every_backend_gives_one(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate("vllm"), await emulate("vllm")
    both = await gateway(
        [{**backend_entry(a), "max_model_len": 2048}, {**backend_entry(b), "max_model_len": 4096}]
    )
    assert both.app[ROUTER].context_tokens(MODEL) == 4096
    assert both.app[ROUTER].context_tokens("not-served") is None
    one = await gateway([{**backend_entry(a), "max_model_len": 2048}, backend_entry(b)])
    assert one.app[ROUTER].context_tokens(MODEL) is None  # b's window unknown: no clamp


async def test_admin_shows_each_window_and_a_backend_added_live_has_its_window_discovered(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate("vllm", name="a"), await emulate("vllm", name="b")
    window = await _window_of(b.url, "/v1/models", "max_model_len")
    gw = await gateway([{**backend_entry(a), "max_model_len": 2048}], admin_token="tok")
    router, auth = gw.app[ROUTER], {"Authorization": "Bearer tok"}
    assert router.context_tokens(MODEL) == 2048
    async with aiohttp.ClientSession() as s:
        # No engine or models: the server is asked, and its window comes with the answer.
        entry = {"name": "b", "url": b.url}
        async with s.post(gw.url + "/admin/backends", json=entry, headers=auth) as r:
            assert r.status == 201, await r.text()
            assert (await r.json())["max_model_len"] == window
        async with s.get(gw.url + "/admin/backends", headers=auth) as r:
            shown = {x["name"]: x["max_model_len"] for x in (await r.json())["backends"]}
    assert shown == {"a": 2048, "b": window} and window != 2048
    assert router.context_tokens(MODEL) == max(2048, window)  # the cache follows the change
    async with aiohttp.ClientSession() as s, s.delete(gw.url + "/admin/backends/b", headers=auth) as r:
        assert r.status == 200
    assert router.context_tokens(MODEL) == 2048


async def test_predictions_are_clamped_to_the_window_and_cut_outputs_below_the_estimate_are_not_learned(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    emu = await emulate("vllm", speedup=20.0)
    gw = await gateway([{**backend_entry(emu), "max_model_len": 1000}])  # the router's window: 1,000
    router, forwarder = gw.app[ROUTER], gw.app[FORWARDER]
    predictor = forwarder.predictor
    assert isinstance(predictor, OnlineQuantilePredictor)
    url = gw.url + "/v1/completions"
    long_prompt = "word " * 900  # about 900 tokens: about 100 of the window left
    async with aiohttp.ClientSession() as s:
        # The prediction (the prior, 200) is clamped to what the window leaves after the prompt, as the
        # ledger shows while the request runs.
        async with s.post(url, json={"model": MODEL, "prompt": long_prompt, "stream": True}) as resp:
            assert resp.status == 200
            assert await eventually(lambda: int(router.snapshot().requests_in_flight[0]) == 1)
            snap = router.snapshot()
            input_tokens = int(snap.input_tokens_in_flight[0])
            predicted = int(snap.predicted_output_tokens_in_flight[0])
            await resp.read()
        assert input_tokens > 700 and predicted == max(1000 - input_tokens, 1) and predicted < 200

        async def answer(prompt: str, max_tokens: int) -> tuple[int, int]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            async with s.post(url, json=body) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
                return int(usage["prompt_tokens"]), int(usage["completion_tokens"])

        # 150 tokens after the long prompt fill the router's window: cut, below the estimate, not learned
        cut = await asyncio.gather(*(answer(long_prompt, 150) for _ in range(25)))
        assert all(p + c >= 1000 and c == 150 for p, c in cut)
        forwarder.answers.flush()
        assert predictor.estimate(MODEL, cut[0][0])[1] == "prior"
        # 4 tokens after a short prompt stopped at max_tokens, not at the window: learned as they are
        assert await asyncio.gather(*(answer("hello there", 4) for _ in range(25))) == [(3, 4)] * 25
        forwarder.answers.flush()
        assert predictor.estimate(MODEL, 3) == (4.0, "bucket")
    assert router.ledger.is_zero()
