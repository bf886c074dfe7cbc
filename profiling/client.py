"""One streamed generation request against vLLM, TGI or a plain OpenAI server, timed (method.md §3).

Owns: the request body for each engine kind (how the output length is controlled), the SSE parsing
that finds the first token and the end, and reading the token counts the engine reports.

Invariants: a request is always streamed, so the first token is seen when it is produced; times are
read from the injected clock relative to the batch start; a request cancelled or timed out closes its
response, which makes vLLM abort it upstream (no orphaned work on the engine).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from hetroute.types import Clock, EngineKind

OutputControl = Literal["exact", "max_tokens"]
"""``exact``: the engine is asked for exactly O tokens (vLLM ``min_tokens`` + ``ignore_eos``);
``max_tokens``: only an upper bound can be requested; the measured count is used."""


class RequestFailed(RuntimeError):
    """The engine answered with an error or an unreadable stream."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's timing relative to its batch's start, and the token counts the engine reported."""

    first_token_s: float
    end_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    chunks: int
    finish_reason: str | None


def request_body(
    engine: EngineKind, model: str, prompt: str, output_tokens: int, control: OutputControl
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a streamed request for ``output_tokens`` tokens."""
    if engine == "tgi":
        params: dict[str, Any] = {"max_new_tokens": output_tokens, "details": True, "do_sample": False}
        return "/generate_stream", {"inputs": prompt, "parameters": params}
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if control == "exact":
        body["min_tokens"] = output_tokens
        body["ignore_eos"] = True
    return "/v1/completions", body


def _error_text(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return text[:300] if text else "(empty body)"


def _usage(event: Mapping[str, Any]) -> tuple[int | None, int | None]:
    usage = event.get("usage")
    if isinstance(usage, Mapping):
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return (p if isinstance(p, int) else None, c if isinstance(c, int) else None)
    details = event.get("details")
    if isinstance(details, Mapping):  # TGI's last event
        p, c = details.get("input_length"), details.get("generated_tokens")
        return (p if isinstance(p, int) else None, c if isinstance(c, int) else None)
    return (None, None)


def _is_token_event(event: Mapping[str, Any]) -> bool:
    if "token" in event:  # TGI
        return True
    choices = event.get("choices")
    return isinstance(choices, list) and len(choices) > 0


def _finish_reason(event: Mapping[str, Any]) -> str | None:
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        reason = choices[0].get("finish_reason")
        return str(reason) if reason else None
    details = event.get("details")
    if isinstance(details, Mapping) and details.get("finish_reason"):
        return str(details["finish_reason"])
    return None


async def _post(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any]) -> aiohttp.ClientResponse:
    """``POST`` ``body``; the response once its head arrived. Sent again once when the server closed the
    socket before answering: a pooled keep-alive socket the engine closed as idle just as it was reused
    (the engine never read the request). A dead engine fails the second try as well."""
    try:
        return await session.post(url, json=body)
    except aiohttp.ServerDisconnectedError:
        return await session.post(url, json=body)


async def stream_request(
    session: aiohttp.ClientSession,
    base_url: str,
    path: str,
    body: Mapping[str, Any],
    clock: Clock,
    started_s: float,
) -> RequestRecord:
    """POST ``body`` and read the SSE stream to its end; times are ``clock.now() - started_s``."""
    first: float | None = None
    end: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish: str | None = None
    chunks = 0
    async with await _post(session, base_url.rstrip("/") + path, body) as resp:
        try:
            if resp.status != 200:
                raise RequestFailed(resp.status, _error_text(await resp.read()))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = clock.now() - started_s
                try:
                    event = json.loads(payload)
                except ValueError as exc:
                    raise RequestFailed(0, f"unreadable SSE event {payload[:100]!r}") from exc
                if not isinstance(event, Mapping):
                    continue
                if "error" in event and not _is_token_event(event):
                    raise RequestFailed(0, f"engine error in stream: {event['error']!r}")
                if _is_token_event(event):
                    chunks += 1
                    if first is None:
                        first = now
                    end = now
                    finish = _finish_reason(event) or finish
                p, c = _usage(event)
                prompt_tokens = p if p is not None else prompt_tokens
                completion_tokens = c if c is not None else completion_tokens
        except (asyncio.CancelledError, TimeoutError):
            resp.close()  # drop the connection: the engine aborts the request
            raise
    if first is None or end is None:
        raise RequestFailed(0, "stream ended without any token")
    return RequestRecord(
        first_token_s=first,
        end_s=end,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        chunks=chunks,
        finish_reason=finish,
    )
