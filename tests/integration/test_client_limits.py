"""Slow and idle clients are timed out, and the connection cap holds (issue 12, item 1).

Bounds are small through config; every assertion on time is a bound the gateway promises
(the configured limit plus scheduling slack), not a performance measurement.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from hetroute.app import CLIENT_GUARD
from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually, metric_sum
from tests.integration.raw_http import exchange, parse_response, request

SLACK_S = 1.0  # event-loop scheduling on a loaded 2-core machine


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout_s)


async def _slowloris(port: int, line_every_s: float, limit_s: float) -> tuple[float, bytes]:
    """Trickle header lines; return (seconds from the first byte to the close, bytes received)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
    read = asyncio.ensure_future(_read_until_closed(reader, limit_s + 5.0))
    try:
        for i in range(100):
            if read.done():
                break
            await asyncio.sleep(line_every_s)
            try:
                writer.write(f"X-Slow-{i}: {i}\r\n".encode())
            except (ConnectionError, RuntimeError):
                break
        data = await read
    finally:
        writer.close()
    return time.monotonic() - t0, data


async def test_slowloris_headers_get_408_and_are_closed_within_the_bound(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    vllm = await emulate()
    limit_s = 0.5
    gw = await gateway([vllm], server={"header_timeout_s": limit_s, "keepalive_idle_s": 5.0})
    port = _port(gw.url)
    results = await asyncio.gather(*(_slowloris(port, 0.1, limit_s) for _ in range(30)))
    for elapsed, data in results:
        assert elapsed < limit_s + SLACK_S, elapsed
        resp = parse_response(data)
        assert resp.status == 408 and resp.headers["content-type"].startswith("application/json")
        assert resp.headers["x-hetroute-backend"] == "none"
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert metric_sum(gw, "hetroute_client_connections_closed_total", reason="header_timeout") == 30
    assert metric_sum(gw, "hetroute_requests_total", backend="none", status="408") == 30
    assert await eventually(lambda: gw.app[CLIENT_GUARD].open_connections == 0)
    assert vllm.state.accepted == 0 and gw.ledger.is_zero()


async def test_idle_connection_is_closed_after_keepalive_idle(emulate: EmulateFn, gateway: GatewayFn) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], server={"keepalive_idle_s": 0.4, "header_timeout_s": 5.0})
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw.url))
    t0 = time.monotonic()
    try:
        data = await _read_until_closed(reader, 5.0)  # sends nothing at all
    finally:
        writer.close()
    assert data == b"" and time.monotonic() - t0 < 0.4 + SLACK_S
    assert metric_sum(gw, "hetroute_client_connections_closed_total", reason="idle") == 1


async def test_keepalive_between_requests_then_idle_close(emulate: EmulateFn, gateway: GatewayFn) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], server={"keepalive_idle_s": 0.4})
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw.url))
    try:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(body)}\r\n\r\n"
        for _ in range(2):  # two requests on one connection, each answered
            writer.write(head.encode() + body)
            status_line = await asyncio.wait_for(reader.readline(), 5.0)
            assert status_line.startswith(b"HTTP/1.1 200")
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
        t0 = time.monotonic()
        assert await _read_until_closed(reader, 5.0) == b""
        assert time.monotonic() - t0 < 0.4 + SLACK_S
    finally:
        writer.close()
    assert vllm.state.accepted == 2


async def test_stalled_body_gets_408(emulate: EmulateFn, gateway: GatewayFn) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], server={"body_timeout_s": 0.4})
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw.url))
    t0 = time.monotonic()
    try:
        writer.write(b'POST /generate HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{"inputs": ')
        data = await _read_until_closed(reader, 5.0)
    finally:
        writer.close()
    resp = parse_response(data)
    assert resp.status == 408 and resp.json()["error_type"]  # a TGI path: TGI's shape
    assert time.monotonic() - t0 < 0.4 + SLACK_S
    assert metric_sum(gw, "hetroute_client_connections_closed_total", reason="body_timeout") == 1
    assert vllm.state.accepted == 0 and gw.ledger.is_zero()


async def test_connections_over_the_cap_get_503(emulate: EmulateFn, gateway: GatewayFn) -> None:
    vllm = await emulate()
    gw = await gateway([vllm], server={"max_connections": 3, "keepalive_idle_s": 5.0})
    port = _port(gw.url)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    assert await eventually(lambda: gw.app[CLIENT_GUARD].open_connections == 3)
    over = await exchange(port, request("GET", "/health"))
    assert over.status == 503 and over.json()["error"]["type"] == "service_unavailable"
    assert metric_sum(gw, "hetroute_client_connections_closed_total", reason="too_many_connections") == 1
    for _, writer in held:
        writer.close()
    assert await eventually(lambda: gw.app[CLIENT_GUARD].open_connections == 0)
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/health") as r:
        assert r.status == 200
