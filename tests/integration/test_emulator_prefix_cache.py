"""The emulator's prefix cache over real HTTP on 127.0.0.1: a repeated prompt is served faster, chats that
share a system prompt hit it, and ``/metrics`` counts it under vLLM's names (TGI exports no such metric)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from typing import Any

import aiohttp

from hetroute.backends.engines import parse_vllm
from hetroute.sim.emulator_text import chat_token_ids
from tests.integration.test_emulator import _CLI, TIMEOUT, make_engine, serve

PROMPT = "".join(f"{i:08d}" for i in range(2000))  # 16,000 characters: 4,000 emulator tokens


async def ttft_s(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    """Client-side time to the first streamed token of a completion (the stream is read to its end)."""
    sent = time.monotonic()
    first: float | None = None
    async with session.post(url, json=dict(body, stream=True)) as r:
        assert r.status == 200
        async for line in r.content:
            if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                first = time.monotonic() - sent
    assert first is not None
    return first


async def test_a_repeated_long_prompt_is_faster_and_metrics_count_the_hit() -> None:
    # speedup 1: the 4,000-token prefill takes ~0.3 s of wall time, the cached one ~0.02 s
    async with serve(make_engine(), speedup=1.0) as (url, emu, s):
        body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
        cold = await ttft_s(s, f"{url}/v1/completions", body)
        warm = await ttft_s(s, f"{url}/v1/completions", body)
        assert warm < cold / 3, (cold, warm)
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
    # at most 3,999 tokens hit, in whole blocks of 16: 249 blocks; the last block is recomputed
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 8000.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 3984.0' in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert 'enable_prefix_caching="True"' in text
    scraped = parse_vllm(text)  # the gateway's scraper reads them
    assert (scraped.prefix_cache_queries_total, scraped.prefix_cache_hits_total) == (8000.0, 3984.0)
    assert emu.engine.stats().prefix_cache_hits_total == 3984


async def test_chats_sharing_a_system_prompt_hit_its_blocks() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}  # 1,160 characters
    async with serve(make_engine()) as (url, emu, s):
        for question in ("What is a KV cache?", "Why does prefix caching help?"):
            body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 3}
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
    shared = 4 + 1160 // 4  # the system message's header and content ids
    ids = chat_token_ids([system, {"role": "user", "content": "x"}])
    assert ids[:shared] == chat_token_ids([system, {"role": "user", "content": "y"}])[:shared]
    assert emu.engine.stats().prefix_cache_hits_total == 16 * (shared // 16)


async def test_no_prefix_caching_and_tgi_metrics() -> None:
    body = {"prompt": PROMPT[:4000], "max_tokens": 1}
    async with serve(make_engine(enable_prefix_caching=False)) as (url, emu, s):
        for _ in range(2):
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
    assert emu.engine.stats().prefix_cache_queries_total == 0
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 0.0' in text
    assert 'enable_prefix_caching="False"' in text
    async with serve(make_engine("tgi"), kind="tgi") as (url, emu, s):
        tgi_body = {"inputs": PROMPT[:4000], "parameters": {"max_new_tokens": 1}}
        for _ in range(2):
            async with s.post(f"{url}/generate", json=tgi_body) as r:
                assert r.status == 200
        async with s.get(f"{url}/metrics") as r:
            text = await r.text()
    # the first request's 62 full blocks were cached when it left the batch; the second hits them all
    assert emu.engine.stats().prefix_cache_hits_total == 62 * 16
    assert "prefix" not in text  # TGI exports no prefix-cache metric


async def test_emulate_command_turns_prefix_caching_off_with_vllms_flag() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CLI, "emulate", "--gpu", "A100-80GB", "--model", "Llama-3-8B",
        "--port", "0", "--no-enable-prefix-caching", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=15)).decode()
        assert "prefix caching off" in line
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url is not None
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for _ in range(2):
                async with s.post(
                    f"{url.group(0)}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}
                ) as r:
                    assert r.status == 200
            async with s.get(f"{url.group(0)}/metrics") as r:
                text = await r.text()
        assert 'enable_prefix_caching="False"' in text
        assert parse_vllm(text).prefix_cache_hits_total == 0.0
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
