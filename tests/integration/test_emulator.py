"""The emulator over real HTTP on 127.0.0.1: API shapes, metrics, errors, disconnects, faults, speedup."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from text_generation import AsyncClient

from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog
from hetroute.clock import ManualClock
from hetroute.errors import ConfigError
from hetroute.sim.emulator import build_emulator_app, emulator_of, run_emulator
from hetroute.sim.emulator_core import Emulator
from hetroute.sim.emulator_faults import FaultConfig
from hetroute.sim.engine_model import EngineConfig, EngineModel

GPUS = load_gpu_catalog()
MODELS = load_model_catalog()
TIMEOUT = aiohttp.ClientTimeout(total=10)


def make_engine(
    kind: str = "vllm", gpu: str = "A100-80GB", model: str = "Llama-3-8B", **kw: Any
) -> EngineModel:
    return EngineModel(EngineConfig(gpu=GPUS[gpu], model=MODELS[model], engine=kind, **kw))  # type: ignore[arg-type]


@asynccontextmanager
async def serve(
    engine: EngineModel, kind: str = "vllm", speedup: float = 200.0, **kw: Any
) -> AsyncIterator[tuple[str, Emulator, aiohttp.ClientSession]]:
    app = build_emulator_app(engine, served_model="llama", engine_kind=kind, speedup=speedup, **kw)  # type: ignore[arg-type]
    async with run_emulator(app) as url, aiohttp.ClientSession(timeout=TIMEOUT) as session:
        yield url, emulator_of(app), session


def sse_payloads(text: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("data:")]


async def wait_until(predicate: Any, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_non_stream_completion_and_chat_report_exact_usage() -> None:
    async with serve(make_engine()) as (url, _, s):
        body = {"model": "llama", "prompt": "abcd" * 10, "max_tokens": 12, "ignore_eos": True}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            data = await r.json()
        assert data["object"] == "text_completion" and data["model"] == "llama"
        assert data["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
        assert data["choices"][0]["finish_reason"] == "length"
        assert len(data["choices"][0]["text"].split()) == 12
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "min_tokens": 5}
        async with s.post(f"{url}/v1/chat/completions", json=chat) as r:
            data = await r.json()
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["message"]["role"] == "assistant"
        assert data["usage"] == {"prompt_tokens": 2 + 4 + 3, "completion_tokens": 5, "total_tokens": 14}


async def test_stream_with_include_usage_has_separate_usage_chunk() -> None:
    async with serve(make_engine()) as (url, _, s):
        body = {
            "prompt": "hi",
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            payloads = sse_payloads(await r.text())
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert [c["usage"] for c in chunks[:-1]] == [None] * 4
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
        plain = dict(body, stream_options=None)
        async with s.post(
            f"{url}/v1/chat/completions", json=dict(plain, messages=[{"role": "user", "content": "x"}])
        ) as r:
            chat = [json.loads(p) for p in sse_payloads(await r.text())[:-1]]
        assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("usage" not in c for c in chat) and len(chat) == 5


async def test_openai_client_library_works_against_the_emulator() -> None:
    async with serve(make_engine()) as (url, _, _s):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=5.0)
        try:
            out = await client.completions.create(model="llama", prompt="hello", max_tokens=3)
            assert out.usage is not None and out.usage.completion_tokens <= 3
            stream = await client.chat.completions.create(
                model="llama",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="other", prompt="x", max_tokens=1)
        finally:
            await client.close()


async def test_vllm_side_endpoints_and_errors() -> None:
    async with serve(make_engine(max_model_len=1024)) as (url, _, s):
        async with s.get(f"{url}/health") as r:
            assert r.status == 200 and await r.text() == ""
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "llama"
        async with s.post(f"{url}/tokenize", json={"model": "llama", "prompt": "hello world"}) as r:
            tok = await r.json()
        assert tok["count"] == 3 and len(tok["tokens"]) == 3 and tok["max_model_len"] == 1024
        async with s.get(f"{url}/version") as r:
            assert "version" in await r.json()
        async with s.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "x"}) as r:
            assert r.status == 404
            assert await r.json() == {
                "error": {
                    "message": "The model `gpt-4` does not exist.",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            }
        async with s.post(f"{url}/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "BadRequestError"
        async with s.post(f"{url}/v1/completions", json={"prompt": "abcd" * 1000, "max_tokens": 100}) as r:
            err = (await r.json())["error"]
        assert r.status == 400 and err["type"] == "BadRequestError"
        assert "maximum context length is 1024 tokens" in err["message"] and "1100 tokens" in err["message"]


async def test_tgi_shapes_with_the_real_client() -> None:
    async with serve(make_engine("tgi", max_model_len=2048), kind="tgi") as (url, _, s):
        client = AsyncClient(url, timeout=5)
        response = await client.generate("hello there", max_new_tokens=5)
        assert response.details.generated_tokens == len(response.details.tokens) <= 5
        assert response.generated_text == "".join(t.text for t in response.details.tokens)
        events = [e async for e in client.generate_stream("hello", max_new_tokens=3)]
        assert [e.token.text != "" for e in events] == [True] * len(events)
        assert events[-1].details is not None and events[-1].generated_text is not None
        assert all(e.details is None for e in events[:-1])
        async with s.post(
            f"{url}/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 2}}
        ) as r:
            raw = await r.text()
        assert raw.startswith("data:{") and "[DONE]" not in raw
        async with s.get(f"{url}/info") as r:
            info = await r.json()
        for key in ("max_total_tokens", "max_input_tokens", "max_concurrent_requests", "model_id", "version"):
            assert key in info
        assert info["max_total_tokens"] == 2048 and info["max_batch_total_tokens"] > 2048
        async with s.post(f"{url}/generate", json={"inputs": "abcd" * 2100}) as r:
            assert r.status == 422
            err = await r.json()
        assert err["error_type"] == "validation" and set(err) == {"error", "error_type"}
        # TGI's OpenAI routes cannot force the length: ignore_eos/min_tokens are vLLM extensions
        forced = {"prompt": "x", "max_tokens": 1500, "min_tokens": 1500, "ignore_eos": True}
        async with s.post(f"{url}/v1/completions", json=forced) as r:
            assert (await r.json())["usage"]["completion_tokens"] < 1500


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_vllm_metrics_move_under_load() -> None:
    engine = make_engine(max_num_seqs=4, num_gpu_blocks_override=256, max_model_len=2048)
    async with serve(engine, speedup=10.0) as (url, emu, s):
        labels = '{engine="0",model_name="llama"}'
        body = {"prompt": "abcd" * 50, "max_tokens": 40, "ignore_eos": True}
        tasks = [asyncio.create_task(s.post(f"{url}/v1/completions", json=body)) for _ in range(8)]
        await wait_until(lambda: emu.engine.stats().running == 4)
        m = await scrape(s, url)
        assert m[f"vllm:num_requests_running{labels}"] == 4 and m[f"vllm:num_requests_waiting{labels}"] == 4
        assert 0 < m[f"vllm:kv_cache_usage_perc{labels}"] <= 1
        cache = [k for k in m if k.startswith("vllm:cache_config_info")]
        assert len(cache) == 1 and 'num_gpu_blocks="256"' in cache[0] and 'block_size="16"' in cache[0]
        for response in await asyncio.gather(*tasks):
            assert response.status == 200
            response.release()
        m = await scrape(s, url)
        assert m[f"vllm:num_requests_running{labels}"] == 0 and m[f"vllm:kv_cache_usage_perc{labels}"] == 0
        assert (
            m[f"vllm:generation_tokens_total{labels}"] == 320
            and m[f"vllm:prompt_tokens_total{labels}"] == 400
        )
        assert m['vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"}'] == 8
        assert m['vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"}'] == 8


async def test_tgi_metrics_names() -> None:
    async with serve(make_engine("tgi", max_num_seqs=2), kind="tgi", speedup=10.0) as (url, emu, s):
        body = {"inputs": "abcd" * 20, "parameters": {"max_new_tokens": 30}}
        tasks = [asyncio.create_task(s.post(f"{url}/generate", json=body)) for _ in range(5)]
        await wait_until(lambda: emu.engine.stats().running == 2)
        m = await scrape(s, url)
        assert m["tgi_batch_current_size"] == 2 and m["tgi_queue_size"] == 3
        assert m["tgi_batch_current_max_tokens"] == 2 * (20 + 30) and m["tgi_request_count"] == 5
        for response in await asyncio.gather(*tasks):
            response.release()
        m = await scrape(s, url)
        assert m["tgi_request_success"] == 5 and m["tgi_queue_size"] == 0


async def test_two_emulators_in_one_process_keep_separate_metrics() -> None:
    labels = '{engine="0",model_name="llama"}'  # the same served model: identical series names in both
    async with serve(make_engine()) as (url_a, emu_a, s), serve(make_engine()) as (url_b, emu_b, _):
        body = {"prompt": "abcd" * 10, "max_tokens": 3, "ignore_eos": True}
        for _ in range(2):
            async with s.post(f"{url_a}/v1/completions", json=body) as r:
                assert r.status == 200
        a, b = await scrape(s, url_a), await scrape(s, url_b)
    assert emu_a.metrics.registry is not emu_b.metrics.registry
    for name, busy in (("vllm:prompt_tokens_total", 20), ("vllm:e2e_request_latency_seconds_count", 2)):
        assert (a[f"{name}{labels}"], b[f"{name}{labels}"]) == (busy, 0)


async def test_client_disconnect_aborts_and_frees_kv() -> None:
    engine = make_engine()
    async with serve(engine, speedup=5.0) as (url, emu, s):
        body = {"prompt": "abcd" * 200, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            await r.content.readline()
            assert engine.stats().used_blocks > 0
        # leaving the block closes the connection mid-stream
        await wait_until(lambda: engine.stats().used_blocks == 0 and not engine.has_work())
        assert engine.stats().requests_aborted_total == 1
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                f"{url}/v1/completions",
                json=dict(body, stream=False),
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
        await wait_until(
            lambda: engine.stats().used_blocks == 0 and engine.stats().requests_aborted_total == 2
        )
        assert emu.metrics.finished_by_reason["abort"] == 2


async def test_injected_errors_are_seeded_json() -> None:
    async with serve(make_engine(), faults=FaultConfig(error_rate=1.0), seed=3) as (url, _, s):
        statuses = []
        for _ in range(6):
            async with s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
                statuses.append(r.status)
                assert (await r.json())["error"]["code"] == r.status
        assert set(statuses) <= {500, 503} and len(set(statuses)) == 2


async def test_crash_after_requests_drops_connections() -> None:
    async with serve(make_engine(), faults=FaultConfig(crash_after_requests=1)) as (url, _, s):
        async with s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientConnectionError):
            await s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        with pytest.raises(aiohttp.ClientConnectionError):
            await s.get(f"{url}/health")


async def test_slow_start_answers_503_until_ready() -> None:
    clock = ManualClock()
    async with serve(make_engine(), clock=clock, faults=FaultConfig(slow_start_s=30.0)) as (url, _, s):
        async with s.get(f"{url}/health") as r:
            assert r.status == 503
        clock.advance(31.0)
        async with s.get(f"{url}/health") as r:
            assert r.status == 200


async def test_hang_and_mid_stream_faults() -> None:
    engine = make_engine()
    async with serve(engine, faults=FaultConfig(hang_rate=1.0)) as (url, _, s):
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                f"{url}/v1/completions", json={"prompt": "x"}, timeout=aiohttp.ClientTimeout(total=0.3)
            )
        await wait_until(lambda: engine.stats().used_blocks == 0)
    stall = FaultConfig(hang_rate=1.0, hang_after_tokens=2)
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    async with (
        serve(make_engine(), faults=stall) as (url, _, s),
        s.post(f"{url}/v1/completions", json=body) as r,
    ):
        lines = [await r.content.readline() for _ in range(4)]  # 2 chunks, each followed by a blank line
        assert sum(1 for line in lines if line.startswith(b"data: {")) == 2
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.content.readline(), timeout=0.3)
    dropping = FaultConfig(fail_mid_stream_after_tokens=3)
    async with (
        serve(make_engine(), faults=dropping) as (url, _, s),
        s.post(f"{url}/v1/completions", json=body) as r,
    ):
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()


async def test_speedup_divides_modelled_time() -> None:
    # Llama-2-7B on an L4: ~57 ms per decode step, so 40 tokens take ~2.3 s of modelled time.
    offline = make_engine(gpu="L4", model="Llama-2-7B")
    offline.submit("a", 25, 40, 0.0)
    modelled_s = 0.0
    while offline.has_work():
        modelled_s += offline.step(modelled_s).duration_s
    body = {"prompt": "abcd" * 25, "max_tokens": 40, "ignore_eos": True}
    for speedup in (10.0, 40.0):
        async with serve(make_engine(gpu="L4", model="Llama-2-7B"), speedup=speedup) as (url, _, s):
            start = time.monotonic()
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert (await r.json())["usage"]["completion_tokens"] == 40
            wall_s = time.monotonic() - start
        assert modelled_s / speedup <= wall_s < modelled_s / speedup + 0.15


async def test_same_seed_same_answers() -> None:
    async def run() -> list[str]:
        out = []
        async with serve(make_engine(), seed=11) as (url, _, s):
            for i in range(3):
                async with s.post(f"{url}/v1/completions", json={"prompt": f"q{i}", "max_tokens": 400}) as r:
                    out.append((await r.json())["choices"][0]["text"])
        return out

    first = await run()
    assert first == await run()
    assert len({len(t.split()) for t in first}) > 1  # lengths are drawn, not constant


_CLI = (
    "import argparse, sys\n"
    "from hetroute.commands import emulate\n"
    "parser = argparse.ArgumentParser(prog='hetroute')\n"
    "emulate.add_parser(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


async def test_emulate_command_prints_url_and_stops_on_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "emulate", "--gpu", "v100-sxm2-32gb", "--model", "Llama-3-8B",
        "--port", "0", "--speedup", "50", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=15)).decode()
        assert "KV capacity 97008 tokens" in line
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url is not None
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(f"{url.group(0)}/health") as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), timeout=10)
        assert rc == 0 and b"stopped" in await proc.stdout.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_emulate_command_rejects_unknown_gpu() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "emulate", "--gpu", "B200", "--model", "Llama-3-8B",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), timeout=15)
    assert proc.returncode == 2
    assert b"unknown GPU 'B200'; valid names:" in err and b"V100-SXM2-32GB" in err


async def test_slowdown_fault_starts_after_its_delay() -> None:
    clock = ManualClock()
    faults = FaultConfig(slowdown_factor=2.0, slowdown_after_s=30.0)
    async with serve(make_engine(), faults=faults, clock=clock) as (url, emu, session):
        body = {"model": "llama", "prompt": "hello", "max_tokens": 4}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
        assert emu.engine.slowdown_factor == 1.0  # before its delay: full speed
        clock.advance(31.0)
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
        assert emu.engine.slowdown_factor == 2.0
    with pytest.raises(ConfigError):
        FaultConfig(slowdown_factor=0.0)
