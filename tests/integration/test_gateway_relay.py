"""The real gateway relays emulated vLLM/TGI answers unchanged, stream and non-stream."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import aiohttp

from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually

_CREATED = re.compile(rb'"created": ?\d+')


def _norm(data: bytes) -> bytes:
    return _CREATED.sub(b'"created":0', data)


async def _post(url: str, path: str, body: Mapping[str, object]) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read(), dict(r.headers)


async def test_stream_bytes_unchanged_when_client_asks_usage(emulate: EmulateFn, gateway: GatewayFn) -> None:
    direct, proxied = await emulate(seed=7), await emulate(seed=7)
    gw = await gateway([proxied])
    body = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    s1, want, _ = await _post(direct.url, "/v1/completions", body)
    s2, got, headers = await _post(gw.url, "/v1/completions", body)
    assert s1 == s2 == 200
    assert _norm(got) == _norm(want) and got.count(b"data: ") == 14
    assert headers["x-hetroute-backend"] == proxied.name
    assert headers["Content-Type"].startswith("text/event-stream")
    assert gw.ledger.is_zero()


async def test_usage_chunk_the_client_did_not_ask_for_is_stripped(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    direct, proxied = await emulate(seed=3), await emulate(seed=3)
    gw = await gateway([proxied])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}
    _, want, _ = await _post(
        direct.url,
        "/v1/chat/completions",
        {**chat, "stream": True, "stream_options": {"include_usage": True}},
    )
    _, got, _ = await _post(gw.url, "/v1/chat/completions", {**chat, "stream": True})
    events = [e for e in want.split(b"\n\n") if e]
    usage = [e for e in events if b'"choices":[]' in e]
    assert len(usage) == 1
    assert _norm(got) == _norm(want.replace(usage[0] + b"\n\n", b""))
    assert b'"usage":{' not in got and got.endswith(b"data: [DONE]\n\n")
    # the gateway still learned the true completion tokens from the stripped chunk
    metrics = (await _get(gw.url, "/metrics")).decode()
    assert f'hetroute_tokens_total{{backend="{proxied.name}",kind="completion"}} 6.0' in metrics


async def _get(url: str, path: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return await r.read()


async def test_non_stream_json_unchanged(emulate: EmulateFn, gateway: GatewayFn) -> None:
    direct, proxied = await emulate(seed=5), await emulate(seed=5)
    gw = await gateway([proxied])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    _, want, _ = await _post(direct.url, "/v1/chat/completions", body)
    status, got, headers = await _post(gw.url, "/v1/chat/completions", body)
    assert status == 200 and _norm(got) == _norm(want)
    assert json.loads(got)["usage"]["completion_tokens"] == 4
    assert headers["x-hetroute-backend"] == proxied.name and "x-request-id" in {k.lower() for k in headers}


async def test_tgi_generate_stream_unchanged_and_routed_to_tgi_only(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    direct, tgi, vllm = await emulate("tgi", seed=2), await emulate("tgi", seed=2), await emulate("vllm")
    gw = await gateway([vllm, tgi])
    body = {"inputs": "what is a GPU?", "parameters": {"max_new_tokens": 5}}
    _, want, _ = await _post(direct.url, "/generate_stream", body)
    status, got, _ = await _post(gw.url, "/generate_stream", body)
    assert status == 200 and got == want  # TGI frames are relayed byte for byte
    assert got.count(b"data:") == 5 and b'"generated_tokens":5' in got
    for _ in range(3):  # round robin would alternate if the vLLM backend were eligible
        status, _, headers = await _post(gw.url, "/generate_stream", body)
        assert status == 200 and headers["x-hetroute-backend"] == tgi.name
    status, non_stream, _ = await _post(gw.url, "/generate", body)
    assert status == 200 and json.loads(non_stream)["details"]["generated_tokens"] == 5
    assert vllm.state.accepted == 0
    info = json.loads(await _get(gw.url, "/info"))
    assert info["model_id"] == MODEL


async def test_models_union_and_engine_metrics_scraped(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a, b = await emulate("vllm"), await emulate("tgi", served_model="other")
    gw = await gateway([a, {"name": b.name, "url": b.url, "engine": "tgi", "models": ["other"]}])
    listing = json.loads(await _get(gw.url, "/v1/models"))
    assert sorted(m["id"] for m in listing["data"]) == [MODEL, "other"]
    from hetroute.app import METRICS

    store = gw.app[METRICS]
    assert await eventually(lambda: store.latest(0) is not None and store.latest(1) is not None)
    vllm_m, tgi_m = store.latest(0), store.latest(1)
    assert vllm_m is not None and tgi_m is not None
    assert vllm_m.kv_usage_frac is not None and vllm_m.kv_capacity_tokens == a.state.engine.kv_capacity_tokens
    assert tgi_m.kv_usage_frac is None and tgi_m.num_requests_waiting is not None
