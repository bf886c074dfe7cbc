"""The official `openai` and `text-generation` clients work against hetroute, only the base URL changed.

Sync clients run in a worker thread (asyncio.to_thread) while the gateway serves on this loop.
"""

from __future__ import annotations

import asyncio

import openai
from text_generation import AsyncClient, Client

from tests.conftest import MODEL, EmulateFn, Gateway, GatewayFn


async def _stack(emulate: EmulateFn, gateway: GatewayFn) -> Gateway:
    return await gateway([await emulate("vllm"), await emulate("tgi")])


async def test_openai_sync_stream_and_non_stream(emulate: EmulateFn, gateway: GatewayFn) -> None:
    gw = await _stack(emulate, gateway)

    def run() -> tuple[str, list[str], int]:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=10.0)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        pieces = [
            c.choices[0].text
            for c in client.completions.create(model=MODEL, prompt="once upon", max_tokens=6, stream=True)
            if c.choices
        ]
        models = client.models.list()
        return chat.choices[0].message.content or "", pieces, len(models.data)

    content, pieces, n_models = await asyncio.to_thread(run)
    assert content and len(pieces) == 6 and n_models == 1
    assert gw.ledger.is_zero()


async def test_openai_async_stream_with_usage_and_non_stream(emulate: EmulateFn, gateway: GatewayFn) -> None:
    gw = await _stack(emulate, gateway)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=10.0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 7
        done = await client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
        assert done.usage is not None and done.usage.completion_tokens == 3
        try:
            await client.completions.create(model="no-such-model", prompt="abc", max_tokens=3)
            raise AssertionError("expected NotFoundError")
        except openai.NotFoundError as exc:
            assert "no-such-model" in str(exc)
    finally:
        await client.close()
    assert gw.ledger.is_zero()


async def test_text_generation_clients(emulate: EmulateFn, gateway: GatewayFn) -> None:
    gw = await _stack(emulate, gateway)

    def run_sync() -> tuple[str, int]:
        client = Client(gw.url, timeout=10)
        full = client.generate("What is deep learning?", max_new_tokens=5)
        tokens = [r.token.text for r in client.generate_stream("What is deep learning?", max_new_tokens=4)]
        return full.generated_text, len(tokens) + (full.details.generated_tokens if full.details else 0)

    text, count = await asyncio.to_thread(run_sync)
    assert text and count == 4 + 5

    aclient = AsyncClient(gw.url, timeout=10)
    response = await aclient.generate("Why is the sky blue?", max_new_tokens=3)
    assert response.details is not None and response.details.generated_tokens == 3
    streamed = [r async for r in aclient.generate_stream("Why is the sky blue?", max_new_tokens=6)]
    assert len(streamed) == 6 and streamed[-1].generated_text is not None
    assert gw.ledger.is_zero()
