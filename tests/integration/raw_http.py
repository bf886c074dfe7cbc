"""Raw HTTP/1.1 over a loopback socket, for requests no HTTP client library would send."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    interim: list[int]  # 1xx status codes seen before the final answer

    def json(self) -> Any:
        return json.loads(self.body)


def parse_response(raw: bytes) -> RawResponse:
    """The final response in ``raw`` (a Content-Length body, or everything up to EOF)."""
    interim: list[int] = []
    while True:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"no complete response head in {raw[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        if 100 <= status < 200:
            interim.append(status)
            raw = rest
            continue
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = headers.get("content-length")
        body = rest[: int(length)] if length is not None else rest
        return RawResponse(status, headers, body, interim)


async def exchange(port: int, data: bytes, *, timeout_s: float = 5.0) -> RawResponse:
    """Send ``data`` on a new connection, read until the server closes it, parse the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    return parse_response(raw)


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """A well-formed request with ``Connection: close`` (so the server closes after answering)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: gw", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
