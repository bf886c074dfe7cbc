"""Issue 12, items 2, 5, 6 and 10: request encodings, topology leaks, admin auth,
Connection-nominated hop-by-hop headers, and ``Expect: 100-continue`` over the limit."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from hetroute.app import HEALTH
from hetroute.commands.serving import warn_if_admin_exposed
from hetroute.config import config_from_dict
from hetroute.proxy.encodings import SUPPORTED_ENCODINGS
from tests.conftest import MODEL, EmulateFn, GatewayFn, metric_sum
from tests.integration.raw_http import exchange, request

BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, await r.read()


# ------------------------------------------------------------------ item 2: encodings


@pytest.mark.parametrize(
    "encoding, encode",
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("GZIP", gzip.compress), ("identity", bytes)],
)
async def test_compressed_bodies_are_decoded_and_forwarded_plain(
    encoding: str, encode: object, emulate: EmulateFn, gateway: GatewayFn
) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], health={"consecutive_failures": 1})
    assert callable(encode)
    for _ in range(4):  # before the fix each of these cost a backend failure (and an ejection)
        status, data = await _post(
            gw.url + "/v1/completions",
            encode(BODY),
            {"Content-Encoding": encoding, "Content-Type": "application/json"},
        )
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] == 4
    assert vllm.state.accepted == 4 and gw.app[HEALTH].is_available(0)
    assert metric_sum(gw, "hetroute_retries_total") == 0


async def test_bad_or_unsupported_encodings_are_4xx(
    emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    vllm = await emulate()
    gw = await gateway([vllm], server={"max_body_bytes": 100_000})
    url = gw.url + "/v1/completions"
    for encoding in ("gzip", "deflate"):  # not data of that encoding
        status, data = await _post(url, b"this is not compressed" * 10, {"Content-Encoding": encoding})
        assert status == 400 and "Content-Encoding" in json.loads(data)["error"]["message"]
    status, data = await _post(url, gzip.compress(BODY)[:-12], {"Content-Encoding": "gzip"})  # truncated
    assert status == 400
    for encoding in ("compress", "x-foo", "gzip, gzip"):
        status, data = await _post(url, gzip.compress(BODY), {"Content-Encoding": encoding})
        assert status == 415 and json.loads(data)["error"]["code"] == "unsupported_content_encoding"
    status, _ = await _post(url, b"x", {"Content-Encoding": "br"})
    assert status == (400 if "br" in SUPPORTED_ENCODINGS else 415)
    bomb = gzip.compress(json.dumps({"model": MODEL, "prompt": " " * 3_000_000}).encode())
    assert len(bomb) < 100_000  # the limit applies to the decoded size
    status, data = await _post(url, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and json.loads(data)["error"]["type"] == "invalid_request_error"
    assert vllm.state.accepted == 0 and gw.ledger.is_zero()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


# ------------------------------------------------------------------ item 5: topology, admin


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_502_body_does_not_show_the_backend_address(gateway: GatewayFn) -> None:
    port = _closed_port()
    dead = {"name": "dead", "url": f"http://127.0.0.1:{port}", "engine": "vllm", "models": [MODEL]}
    gw = await gateway([dead], retries={"max_attempts": 2})
    for path, body in (
        ("/v1/completions", BODY),
        ("/v1/completions", BODY.replace(b"}", b',"stream":true}')),
    ):
        status, data = await _post(gw.url + path, body, {"Content-Type": "application/json"})
        assert status == 502
        text = data.decode()
        assert "127.0.0.1" not in text and str(port) not in text
        assert json.loads(data)["error"]["type"] == "upstream_error"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/backends") as r:
        admin = json.loads(await r.read())
    assert str(port) in admin["backends"][0]["health"]["last_error"]  # the details are for operators


async def test_admin_bearer_scheme_is_case_insensitive(emulate: EmulateFn, gateway: GatewayFn) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], admin_token="sekret")
    async with aiohttp.ClientSession() as s:
        for auth, status in (
            ("bearer sekret", 200),
            ("BEARER sekret", 200),
            ("Bearer  sekret", 200),
            ("Basic sekret", 401),
            ("bearer wrong", 401),
            ("sekret", 401),
        ):
            async with s.get(gw.url + "/admin/backends", headers={"Authorization": auth}) as r:
                assert r.status == status, auth
                if status == 401:
                    assert json.loads(await r.read())["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "host, token, warned",
    [("0.0.0.0", None, True), ("10.1.2.3", None, True), ("::", None, True),
     ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False), ("0.0.0.0", "t", False)],
)  # fmt: skip
def test_startup_warns_when_admin_is_open_on_a_non_loopback_listener(
    host: str, token: str | None, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config_from_dict(
        {"backends": [{"url": "http://127.0.0.1:1"}], "server": {"host": host}, "admin_token": token}, env={}
    )
    with caplog.at_level(logging.WARNING, logger="hetroute.serve"):
        warn_if_admin_exposed(cfg)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "/admin" in r.getMessage()]
    assert bool(warnings) == warned


# ------------------------------------------------------------------ item 6: hop-by-hop


@asynccontextmanager
async def _recording_backend(seen: list[dict[str, str]]) -> AsyncIterator[str]:
    """A raw HTTP backend that records request headers and answers with a nominated header."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[1:-2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                seen.append(headers)
                body = json.dumps({"object": "text_completion", "choices": [], "usage": {}}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Connection: keep-alive, X-Upstream-Secret\r\nX-Upstream-Secret: 1\r\nX-Kept: 2\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_connection_nominated_headers_are_stripped_both_ways(gateway: GatewayFn) -> None:
    seen: list[dict[str, str]] = []
    async with _recording_backend(seen) as url:
        gw = await gateway(
            [{"name": "rec", "url": url, "engine": "vllm", "models": [MODEL]}], scrape={"enabled": False}
        )
        headers = {
            "Connection": "keep-alive, X-Client-Secret",
            "X-Client-Secret": "s",
            "X-Client-Kept": "k",
            "Content-Type": "application/json",
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/completions", data=BODY, headers=headers) as r,
        ):
            assert r.status == 200
            assert "X-Upstream-Secret" not in r.headers and r.headers["X-Kept"] == "2"
    upstream = [h for h in seen if "x-client-kept" in h]
    assert len(upstream) == 1
    assert "x-client-secret" not in upstream[0] and "content-encoding" not in upstream[0]
    assert upstream[0]["x-client-kept"] == "k"


# ------------------------------------------------------------------ item 10: Expect


async def test_expect_continue_over_the_limit_gets_413_without_100(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], server={"max_body_bytes": 1000})
    port = _port(gw.url)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
        "Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n"
    )
    resp = await exchange(port, head.encode())  # no body: the client waits for 100 Continue
    assert resp.interim == [] and resp.status == 413
    assert resp.json()["error"]["type"] == "invalid_request_error"
    resp = await exchange(port, request("POST", "/generate", b"{}", {"Expect": "something-else"}))
    assert resp.status == 417 and "error_type" in resp.json()
    resp = await exchange(port, request("POST", "/v1/completions", BODY, {"Expect": "100-continue"}))
    assert resp.interim == [100] and resp.status == 200
    assert vllm.state.accepted == 1
