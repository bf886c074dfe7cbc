"""Delivering one emulated request's tokens to its client: SSE streams and non-stream bodies.

Owns :class:`Live` (the per-request state the emulator's driver updates), :func:`respond` and
:class:`StreamHost`, what ``respond`` needs of the emulator (``hetroute.sim.emulator_core.Emulator`` is one;
this module does not import it). A handler
waits on ``Live.changed`` (set by the driver for each token and at the end), polling the transport so a
client that went away is noticed even without handler cancellation; the caller then aborts the request in
the engine. Per-request faults (drop after k tokens, stall after k tokens, crash) are applied here.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web

from hetroute.sim.emulator_protocol import (
    GenRequest,
    openai_chunk,
    openai_response,
    openai_usage_chunk,
    tgi_response,
    tgi_stream_event,
    tgi_token,
)
from hetroute.sim.emulator_text import TextSource

POLL_S = 0.25  # wall seconds between checks that the client is still connected


class Live:
    """One admitted request as the HTTP side sees it."""

    __slots__ = (
        "rid",
        "prompt_tokens",
        "output_tokens",
        "cap_tokens",
        "arrival_s",
        "seed",
        "hang",
        "generated",
        "last_token_s",
        "done",
        "killed",
        "changed",
    )

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        output_tokens: int,
        cap_tokens: int,
        arrival_s: float,
        seed: int,
        hang: bool,
    ) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.cap_tokens = cap_tokens
        self.arrival_s = arrival_s
        self.seed = seed
        self.hang = hang
        self.generated = 0
        self.last_token_s = arrival_s
        self.done = False
        self.killed = False
        self.changed = asyncio.Event()

    @property
    def finish_reason(self) -> str:
        """OpenAI finish reason: ``length`` when the cap was reached, else ``stop``."""
        return "length" if self.output_tokens >= self.cap_tokens else "stop"


class StreamFaults(Protocol):
    """The per-stream faults (``FaultConfig`` fields): drop or stall after that many tokens."""

    @property
    def fail_mid_stream_after_tokens(self) -> int | None: ...

    @property
    def hang_after_tokens(self) -> int | None: ...


class StreamHost(Protocol):
    """What :func:`respond` reads of the emulator, and the one call it makes (``release``)."""

    @property
    def faults(self) -> StreamFaults: ...

    @property
    def closing(self) -> asyncio.Event:
        """Set when the app shuts down: a hung request waits on it."""

    @property
    def created_unix(self) -> int: ...

    @property
    def served_model(self) -> str: ...

    def release(self, live: Live) -> None:
        """Abort ``live`` in the engine if unfinished (frees its KV blocks): a stalled stream lets go."""


def _drop(request: web.Request) -> web.StreamResponse:
    if request.transport is not None:
        request.transport.abort()
    return web.Response()


async def _progress(request: web.Request, live: Live) -> None:
    """Wait for the next token or the end; ConnectionResetError when the client has gone away."""
    live.changed.clear()
    try:
        async with asyncio.timeout(POLL_S):
            await live.changed.wait()
    except TimeoutError:
        pass
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("client disconnected")


def _sse(payload: dict[str, Any], tgi: bool) -> bytes:
    return (b"data:" if tgi else b"data: ") + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def respond(emu: StreamHost, request: web.Request, req: GenRequest, live: Live) -> web.StreamResponse:
    """Answer ``req`` once its tokens arrive; the caller releases the request afterwards."""
    try:
        if live.hang and emu.faults.hang_after_tokens is None:
            await emu.closing.wait()  # accepted, never answered
            return web.Response(status=503)
        if req.stream:
            return await _stream(emu, request, req, live)
        return await _collect(emu, request, req, live)
    except ConnectionResetError:
        return _drop(request)


def _tgi_finish(live: Live) -> str:
    return "length" if live.finish_reason == "length" else "eos_token"


async def _collect(emu: StreamHost, request: web.Request, req: GenRequest, live: Live) -> web.StreamResponse:
    fail_after = emu.faults.fail_mid_stream_after_tokens
    hang_after = emu.faults.hang_after_tokens if live.hang else None
    while not live.done:
        if live.killed or (fail_after is not None and live.generated >= fail_after):
            return _drop(request)
        if hang_after is not None and live.generated >= hang_after:
            emu.release(live)
            await emu.closing.wait()
            return web.Response(status=503)
        await _progress(request, live)
    source = TextSource(live.seed)
    tokens = [source.next_token() for _ in range(live.output_tokens)]
    text = "".join(t for _, t in tokens)
    if req.api == "generate":
        body = tgi_response(req, text, _tgi_finish(live), [tgi_token(i, t) for i, t in tokens], None)
        if req.as_list:
            return web.json_response([body])
    else:
        body = openai_response(
            req, live.rid, emu.created_unix, emu.served_model, text, live.finish_reason, live.output_tokens
        )
    return web.json_response(body)


async def _stream(emu: StreamHost, request: web.Request, req: GenRequest, live: Live) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    fail_after = emu.faults.fail_mid_stream_after_tokens
    hang_after = emu.faults.hang_after_tokens if live.hang else None
    tgi = req.api == "generate"
    model, created = emu.served_model, emu.created_unix
    source = TextSource(live.seed)
    pieces: list[str] = []
    sent = 0
    while True:
        if live.killed or (fail_after is not None and sent >= fail_after):
            return _drop(request)
        while sent < live.generated:
            token_id, text = source.next_token()
            sent += 1
            pieces.append(text)
            last = live.done and sent == live.generated
            if tgi:
                final = "".join(pieces) if last else None
                finish = _tgi_finish(live) if last else None
                event = tgi_stream_event(
                    sent, tgi_token(token_id, text), final, finish, sent, live.prompt_tokens
                )
                await resp.write(_sse(event, True))
            else:
                if sent == 1 and req.api == "chat":
                    await resp.write(
                        _sse(openai_chunk(req, live.rid, created, model, None, None, role=True), False)
                    )
                finish = live.finish_reason if last else None
                await resp.write(_sse(openai_chunk(req, live.rid, created, model, text, finish), False))
            if not last and fail_after is not None and sent >= fail_after:
                return _drop(request)
            if not last and hang_after is not None and sent >= hang_after:
                emu.release(live)
                await emu.closing.wait()
                return resp
        if live.done:
            break
        await _progress(request, live)
    if not tgi:
        if req.include_usage:
            await resp.write(
                _sse(openai_usage_chunk(req, live.rid, created, model, live.output_tokens), False)
            )
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
