"""The profiler survives an engine that closes idle keep-alive sockets (uvicorn, so vLLM, after 5 s).

The race that failed CI at stop 33: the profiler reused a pooled socket at the moment the engine closed
it as idle, and the request failed with "Server disconnected" before any answer. The server here makes
that race certain: it answers the first request of each connection and closes the connection, unread,
when a second request arrives on it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from hetroute.clock import MonotonicClock
from profiling.client import stream_request

TOKENS = 3


class ClosingEngine:
    """Answers one streamed completion per connection; drops the connection on the next request."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            served = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if served:
                    self.dropped += 1
                    return  # the idle-close race: the request is never answered
                served += 1
                events: list[dict[str, object]] = [
                    {"choices": [{"text": "x", "finish_reason": "length" if i == TOKENS - 1 else None}]}
                    for i in range(TOKENS)
                ]
                events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": TOKENS}})
                body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                body += b"data: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@asynccontextmanager
async def closing_engine() -> AsyncIterator[tuple[str, ClosingEngine]]:
    engine = ClosingEngine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.timeout(20)
async def test_a_request_on_a_socket_the_engine_closed_is_sent_again_once() -> None:
    clock = MonotonicClock()
    body = {"model": "m", "prompt": "hello", "max_tokens": TOKENS, "stream": True}
    async with closing_engine() as (url, engine), aiohttp.ClientSession() as session:
        records = []
        for _ in range(3):  # each request after the first reuses the pooled socket the engine drops
            records.append(await stream_request(session, url, "/v1/completions", body, clock, clock.now()))
    assert [r.completion_tokens for r in records] == [TOKENS] * 3
    assert all(r.chunks == TOKENS and r.finish_reason == "length" for r in records)
    assert engine.answered == 3 and engine.dropped == 2
