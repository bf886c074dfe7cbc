"""A bounded, seeded fuzz of the gateway with malformed requests on every endpoint (issue 12).

About 1,200 generated requests, each on its own loopback connection: broken request lines,
methods, headers and framing, bad encodings, and JSON bodies that are malformed, mistyped,
out of range or deeply nested. Asserted: no 5xx other than 502/503/504, every error body in
the API's error shape (OpenAI's or TGI's), no traceback and nothing at ERROR in the log, and
the ledger back at 0. The seed makes every run send the same requests.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import random
from collections import Counter
from typing import Any

import pytest

from tests.conftest import MODEL, EmulateFn, GatewayFn, eventually
from tests.integration.raw_http import RawResponse, parse_response

SEED = 20261123
CASES = 1200
CONCURRENCY = 16
POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/generate", "/generate_stream", "/"]
GET_PATHS = ["/v1/models", "/info", "/health", "/metrics", "/admin/backends"]
OTHER_PATHS = ["/v1/embeddings", "/v2", "/%00", "/..%2f..%2fetc/passwd", "//x", "/v1/completions/"]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "PRI", "G\x00T"]
WEIRD_VALUES: list[Any] = [
    None, True, -1, 0, 2**70, 1e308, -0.0, "", "x" * 5000, "\ud800", "\x00", [], {}, [1, "a"],
    {"a": {"b": {}}}, "9", 3.5, float("nan"),
]  # fmt: skip


def _valid(path: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    return {"inputs": "hi", "parameters": {"max_new_tokens": 2}}


def _mutate_json(rng: random.Random, path: str) -> bytes:
    obj = _valid(path)
    kind = rng.randrange(9)
    if kind == 0:  # a field gets a weird value
        target = obj["parameters"] if "parameters" in obj and rng.random() < 0.5 else obj
        key = rng.choice([*target, "stream", "n", "stop", "temperature", "stream_options", "details"])
        target[key] = rng.choice(WEIRD_VALUES)
    elif kind == 1:  # a field goes missing
        obj.pop(rng.choice(list(obj)))
    elif kind == 2:  # deep nesting
        depth = rng.choice([100, 900, 1000, 5000])
        return b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
    elif kind == 3:  # not JSON, or not an object
        return rng.choice([b"{", b"nul", b'"s"', b"[]", b"1", b"\xff\xfe{}", b"{'a': 1}", b"", b"{}" * 3])
    elif kind == 4:  # truncated
        raw = json.dumps(obj).encode()
        return raw[: rng.randrange(len(raw))]
    elif kind == 5 and "messages" in obj:
        obj["messages"] = rng.choice([[], [{}], [{"role": "user"}], [{"role": "user", "content": [1]}], "x"])
    elif kind == 6:
        obj["model"] = rng.choice(["", "nope", "x" * 300, None, 7, MODEL + "\x00"])
    elif kind == 7:  # valid, with streaming on or off: reaches a backend
        obj["stream"] = rng.random() < 0.5
    raw = json.dumps(obj, allow_nan=True).encode()
    if rng.random() < 0.05:  # random byte flips
        b = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        raw = bytes(b)
    return raw


def _head(method: str, path: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def _case(rng: random.Random) -> bytes:
    """One malformed (or occasionally valid) request."""
    path = rng.choice(POST_PATHS * 3 + GET_PATHS + OTHER_PATHS)
    body = _mutate_json(rng, path) if rng.random() < 0.8 else b""
    method = "POST" if path in POST_PATHS and rng.random() < 0.85 else rng.choice(METHODS)
    headers = [("Host", "gw"), ("Connection", "close"), ("Content-Type", "application/json")]
    framing = rng.randrange(12)
    if framing == 0:
        headers.append(("Transfer-Encoding", "chunked"))
        chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        body = chunk if rng.random() < 0.5 else chunk.replace(b"\r\n", b"\n", 1)
    elif framing == 1:
        headers.append(("Content-Length", rng.choice(["-1", "1e3", "0x10", " ", "99999999999999999999"])))
    elif framing == 2:
        headers += [
            ("Content-Length", str(len(body))),
            ("Transfer-Encoding", rng.choice(["chunked", "gzip"])),
        ]
    elif framing == 3:
        enc = rng.choice(["gzip", "deflate", "br", "compress", "gzip, gzip", "identity"])
        if enc == "gzip" and rng.random() < 0.5:
            body = gzip.compress(body)
        headers += [("Content-Encoding", enc), ("Content-Length", str(len(body)))]
    elif framing == 4:
        headers.append((rng.choice(["X\x00A", "Bad Name", "X:Y", "", "Ü"]), "v"))
        headers.append(("Content-Length", str(len(body))))
    elif framing == 5:
        headers.append(("X-Long", "a" * rng.choice([8000, 9000, 20000])))
    elif framing == 6:
        headers += [(f"X-{i}", "v") for i in range(rng.choice([100, 200, 1000]))]
    elif framing == 7:
        headers += [("Host", "other"), ("Content-Length", str(len(body)))]
    elif framing == 8:
        headers += [("Expect", rng.choice(["100-continue", "nope"])), ("Content-Length", str(len(body)))]
    elif framing == 9:
        return rng.choice(
            [
                b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + rng.randbytes(40) + b"\r\n\r\n",
                f"{method} {path} HTTP/9.9\r\n\r\n".encode("utf-8", "surrogateescape"),
                f"{method} {path}\r\n\r\n".encode("utf-8", "surrogateescape"),
                b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
                b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\nConnection: close\r\n\r\n",
                f"{method} http://evil.example{path} HTTP/1.1\r\nConnection: close\r\n\r\n".encode(
                    "utf-8", "surrogateescape"
                ),
                b"OPTIONS * HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                rng.randbytes(rng.randrange(1, 200)) + b"\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}garbage\r\n\r\n",
            ]
        )
    else:
        headers.append(("Content-Length", str(len(body))))
    return _head(method, path, headers) + body


async def _send(port: int, data: bytes) -> RawResponse | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        raw = await asyncio.wait_for(reader.read(), 10.0)
    except ConnectionResetError:
        return None
    finally:
        writer.close()
    return parse_response(raw) if raw else None


def _api_shaped(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    err = data.get("error")
    if isinstance(err, dict):  # OpenAI
        return {"message", "type", "param", "code"} <= set(err) and isinstance(err["message"], str)
    return isinstance(err, str) and isinstance(data.get("error_type"), str)  # TGI


async def test_fuzz_malformed_requests(
    emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    vllm, tgi = await emulate("vllm"), await emulate("tgi")
    gw = await gateway(
        [vllm, tgi],
        server={
            "header_timeout_s": 0.5,
            "body_timeout_s": 0.5,
            "keepalive_idle_s": 1.0,
            "max_body_bytes": 64 * 1024,
        },
    )
    port = int(gw.url.rsplit(":", 1)[1])
    rng = random.Random(SEED)
    cases = [_case(rng) for _ in range(CASES)]
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(data: bytes) -> tuple[bytes, RawResponse | None]:
        async with sem:
            return data, await _send(port, data)

    results = await asyncio.gather(*(one(c) for c in cases))
    statuses: Counter[int] = Counter()
    problems: list[str] = []
    for data, resp in results:
        if resp is None:
            statuses[0] += 1
            continue
        statuses[resp.status] += 1
        if resp.status >= 500 and resp.status not in (502, 503, 504):  # 502-504: a backend's fault
            problems.append(f"{resp.status} for {data[:120]!r}")
        head_only = data.startswith(b"HEAD ")  # a HEAD answer has no body
        if resp.status >= 400 and not head_only and not _api_shaped(resp.body):
            problems.append(f"not API-shaped {resp.status} {resp.body[:120]!r} for {data[:120]!r}")
    assert not problems, "\n".join(problems[:20])
    assert statuses[0] == 0, statuses  # every request got an answer
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > CASES // 2, statuses
    bad_logs = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad_logs, [r.getMessage() for r in bad_logs[:5]]
    assert not [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert await eventually(gw.ledger.is_zero)
