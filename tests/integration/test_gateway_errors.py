"""Bad input is answered by the gateway in the API's own error shape; nothing reaches a backend."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.conftest import MODEL, EmulateFn, GatewayFn

OPENAI_KEYS = {"message", "type", "param", "code"}

CASES = [
    # (method, path, raw body, status, api, param)
    ("POST", "/v1/completions", b"{not json", 400, "openai", None),
    ("POST", "/v1/chat/completions", b'"just a string"', 400, "openai", None),
    ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode(), 400, "openai", "prompt"),
    (
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "9"}).encode(),
        400,
        "openai",
        "max_tokens",
    ),  # noqa: E501
    (
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": 1}]}).encode(),
        400,
        "openai",
        "messages[0].role",
    ),  # noqa: E501
    (
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "u"}], "stream": 1}).encode(),
        400,
        "openai",
        "stream",
    ),  # noqa: E501
    (
        "POST",
        "/v1/completions",
        json.dumps({"model": "gpt-9", "prompt": "x"}).encode(),
        404,
        "openai",
        "model",
    ),
    ("POST", "/v1/embeddings", b"{}", 404, "openai", None),
    ("GET", "/v1/completions", b"", 405, "openai", None),
    ("POST", "/generate", b"{oops", 400, "tgi", None),
    ("POST", "/generate_stream", json.dumps({"inputs": 3}).encode(), 400, "tgi", None),
    (
        "POST",
        "/generate",
        json.dumps({"inputs": "x", "parameters": {"max_new_tokens": "many"}}).encode(),
        400,
        "tgi",
        None,
    ),  # noqa: E501
]


@pytest.mark.parametrize(("method", "path", "raw", "status", "api", "param"), CASES)
async def test_bad_input(
    emulate: EmulateFn,
    gateway: GatewayFn,
    method: str,
    path: str,
    raw: bytes,
    status: int,
    api: str,
    param: str | None,
) -> None:
    vllm, tgi = await emulate("vllm"), await emulate("tgi")
    gw = await gateway([vllm, tgi])
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, gw.url + path, data=raw, headers={"Content-Type": "application/json"}) as r,
    ):
        assert r.status == status
        assert r.headers["Content-Type"].startswith("application/json")
        body = json.loads(await r.read())
    if api == "openai":
        assert (
            set(body["error"]) == OPENAI_KEYS and body["error"]["param"] == param and body["error"]["message"]
        )
    else:
        assert set(body) == {"error", "error_type"} and body["error"]
    assert vllm.state.accepted == 0 and tgi.state.accepted == 0
    assert gw.ledger.is_zero()


async def test_body_over_the_limit_is_413(emulate: EmulateFn, gateway: GatewayFn) -> None:
    vllm = await emulate("vllm")
    gw = await gateway([vllm], server={"max_body_bytes": 1000})
    big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/completions", data=big) as r:
            assert r.status == 413
            assert json.loads(await r.read())["error"]["type"] == "invalid_request_error"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit is enforced while reading
            for _ in range(4):
                yield b"x" * 500

        async with s.post(gw.url + "/generate", data=chunks()) as r:
            assert r.status == 413
            assert json.loads(await r.read())["error_type"] == "validation"
    assert vllm.state.accepted == 0
