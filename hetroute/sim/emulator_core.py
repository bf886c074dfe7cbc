"""One emulated vLLM or TGI server's state: the engine, its driver loop, admission and request handlers.

Owns :class:`Emulator` (:mod:`hetroute.sim.emulator` wires it into an aiohttp app). The driver loops:
``engine.step(now)``, sleep ``duration_s / speedup``, then hand the step's tokens to the waiting requests.
Sleeps are paced against a running deadline on the event loop's timer, so waits shorter than the poller's
~1 ms resolution (high speedups) do not slow the engine down; the injected clock only timestamps requests
(TTFT, latency histograms, slow start). Request handlers admit requests into the engine, stream or collect
their tokens, and abort them in the engine (freeing KV blocks) when the client disconnects.

Token counts are deterministic (:mod:`emulator_text`): prompt tokens = ceil(chars / 4) (chat: per message
+4, +3 for the generation prompt); output length honours ``max_tokens``/``max_new_tokens``, with
``ignore_eos`` or ``min_tokens`` forcing the exact length, else a seeded ShareGPT-like draw. Prompt token ids
are deterministic too, so the engine's prefix cache hits a repeated prompt prefix (on unless the engine's
``enable_prefix_caching`` is off).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hetroute.errors import ConfigError
from hetroute.sim.emulator_faults import FaultConfig, drop_connection
from hetroute.sim.emulator_meta import models_body, tgi_info_body, tokenize_body
from hetroute.sim.emulator_metrics import EmulatorMetrics
from hetroute.sim.emulator_protocol import (
    EngineApiError,
    EngineKind,
    GenRequest,
    decode_json,
    parse_openai,
    parse_tgi,
)
from hetroute.sim.emulator_stream import Live, respond
from hetroute.sim.emulator_text import draw_output_tokens
from hetroute.sim.engine_model import EngineModel, PromptTooLong
from hetroute.types import Clock

IDLE_GATHER_YIELDS = 8  # loop iterations an idle engine waits for companions of the first request
MAX_LAG_S = 0.05  # how far behind schedule the driver may fall before it stops catching up


class Emulator:
    """Per-app state: the engine, live requests, metrics, fault state and the driver loop."""

    def __init__(
        self,
        engine: EngineModel,
        served_model: str,
        engine_kind: EngineKind,
        speedup: float,
        faults: FaultConfig,
        seed: int,
        clock: Clock,
        max_concurrent_requests: int,
    ) -> None:
        if speedup <= 0 or not math.isfinite(speedup):
            raise ConfigError("speedup", f"expected a positive number, got {speedup!r}")
        if engine_kind not in ("vllm", "tgi"):
            raise ConfigError("engine_kind", f"expected one of vllm|tgi, got {engine_kind!r}")
        self.engine = engine
        self.served_model = served_model
        self.kind: EngineKind = engine_kind
        self.speedup = speedup
        self.faults = faults
        self.clock = clock
        self.rng = random.Random(seed)
        self.max_concurrent_requests = max_concurrent_requests
        self.metrics = EmulatorMetrics(engine, engine_kind, served_model)
        self.lives: dict[str, Live] = {}
        self.wake = asyncio.Event()
        self.closing = asyncio.Event()
        self.accepted = 0
        self.crashed = False
        self.started_s = clock.now()
        self.created_unix = int(time.time())

    # -------------------------------------------------------------- driver

    async def drive(self) -> None:
        """Step the engine forever; each step's outcome is applied after its (scaled) duration."""
        engine, clock = self.engine, self.clock
        loop = asyncio.get_running_loop()
        # Pacing uses the event loop's own timer: step ends are scheduled on a running deadline, so a sleep
        # that overshoots (the poller rounds up to ~1 ms) is made up by shorter or skipped later sleeps, and
        # no step ends before its deadline.
        deadline = loop.time()
        while True:
            if not engine.has_work():
                self.wake.clear()
                await self.wake.wait()
                # Requests sent together (a profiler's batch) reach the server over a few loop iterations;
                # yielding a few times (no wall time) lets them start in the same first step.
                deadline = loop.time()
                for _ in range(IDLE_GATHER_YIELDS):
                    await asyncio.sleep(0)
                continue
            slow = self.faults.slowdown_factor
            if (
                slow != engine.slowdown_factor
                and clock.now() - self.started_s >= self.faults.slowdown_after_s
            ):
                engine.set_slowdown(slow)
            outcome = engine.step(clock.now())
            if outcome.scheduled_tokens == 0:
                if outcome.preempted:  # preemption freed blocks: plan again at once
                    await asyncio.sleep(0)
                    continue
                # nothing runnable: wait for a submission or an abort
                self.wake.clear()
                await self.wake.wait()
                deadline = loop.time()
                continue
            deadline = max(deadline + outcome.duration_s / self.speedup, loop.time() - MAX_LAG_S)
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            now = clock.now()
            metrics = self.metrics
            for event in outcome.emitted:
                live = self.lives.get(event.request_id)
                if live is None:
                    continue  # aborted while the step ran
                live.generated += event.tokens
                if event.first:
                    metrics.observe("ttft_s", now - live.arrival_s)
                else:
                    metrics.observe("itl_s", now - live.last_token_s)
                live.last_token_s = now
                live.changed.set()
            for rid in outcome.finished:
                finished = self.lives.pop(rid, None)
                if finished is None:
                    continue
                finished.done = True
                finished.changed.set()
                metrics.finished_by_reason[finished.finish_reason] += 1
                metrics.observe("e2e_s", now - finished.arrival_s)
                metrics.observe("output_tokens", finished.output_tokens)

    # -------------------------------------------------------------- admission

    def crash(self) -> None:
        self.crashed = True
        for live in list(self.lives.values()):
            self.release(live)
            live.killed = True
            live.changed.set()

    def admit(self, req: GenRequest, prefix: str) -> Live:
        """Submit ``req`` to the engine (EngineApiError for faults, limits and over-long prompts)."""
        if self.kind == "tgi" and len(self.lives) >= self.max_concurrent_requests:
            raise EngineApiError(429, "Model is overloaded", "RateLimitError", "overloaded")
        if self.faults.error_rate and self.rng.random() < self.faults.error_rate:
            self.metrics.requests_failed += 1
            if self.rng.random() < 0.5:
                raise EngineApiError(
                    500, "Internal server error (injected fault)", "InternalServerError", "generation"
                )
            raise EngineApiError(
                503, "Service unavailable (injected fault)", "ServiceUnavailableError", "overloaded"
            )
        engine = self.engine
        cap = req.max_tokens if req.max_tokens is not None else engine.max_model_len - req.prompt_tokens
        if cap < 1 or req.prompt_tokens + cap > engine.max_model_len:
            self.metrics.requests_failed += 1
            raise self._too_long(req, max(cap, 1))
        output = draw_output_tokens(self.rng, cap, req.min_tokens, req.ignore_eos)
        rid = f"{prefix}-{self.rng.getrandbits(128):032x}"
        now = self.clock.now()
        hashes = req.block_hashes(engine.block_size) if engine.config.enable_prefix_caching else ()
        try:
            engine.submit(rid, req.prompt_tokens, output, now, reserve_tokens=cap, block_hashes=hashes)
        except PromptTooLong as exc:
            self.metrics.requests_failed += 1
            raise self._too_long(req, cap) from exc
        hang = self.faults.hang_rate > 0 and self.rng.random() < self.faults.hang_rate
        live = Live(rid, req.prompt_tokens, output, cap, now, self.rng.getrandbits(32), hang)
        self.lives[rid] = live
        self.metrics.requests_total += 1
        self.metrics.observe("prompt_tokens", req.prompt_tokens)
        self.wake.set()
        return live

    def _too_long(self, req: GenRequest, cap: int) -> EngineApiError:
        limit = self.engine.max_model_len
        if self.kind == "tgi":
            return EngineApiError(
                422,
                f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {limit}. "
                f"Given: {req.prompt_tokens} `inputs` tokens and {cap} `max_new_tokens`",
                "BadRequestError",
            )
        return EngineApiError(400, str(PromptTooLong(req.prompt_tokens, cap, limit)), "BadRequestError")

    def release(self, live: Live) -> None:
        """Abort an unfinished request in the engine (frees its KV blocks) and count it as aborted."""
        if live.done or self.lives.pop(live.rid, None) is None:
            return
        self.engine.abort(live.rid)
        self.metrics.finished_by_reason["abort"] += 1
        self.metrics.requests_failed += 1

    # -------------------------------------------------------------- handlers

    def error(self, exc: EngineApiError) -> web.Response:
        return web.json_response(exc.body(self.kind), status=exc.status)

    async def generate(self, request: web.Request, req: GenRequest, prefix: str) -> web.StreamResponse:
        self.accepted += 1
        limit = self.faults.crash_after_requests
        if limit is not None and self.accepted > limit:
            self.crash()
            return drop_connection(request)
        try:
            live = self.admit(req, prefix)
        except EngineApiError as exc:
            return self.error(exc)
        try:
            return await respond(self, request, req, live)
        finally:
            self.release(live)

    async def openai(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            body = decode_json(await request.read())
            req = parse_openai(body, "chat" if api == "chat" else "completions", self.served_model, self.kind)
        except EngineApiError as exc:
            return self.error(exc)
        return await self.generate(request, req, "chatcmpl" if api == "chat" else "cmpl")

    async def tgi(self, request: web.Request, stream: bool | None) -> web.StreamResponse:
        try:
            body = decode_json(await request.read())
            req = parse_tgi(body, bool(body.get("stream", False)) if stream is None else stream)
            if stream is None:
                req = dataclasses.replace(req, as_list=True)
        except EngineApiError as exc:
            exc.status = 422 if exc.status == 400 else exc.status
            return self.error(exc)
        return await self.generate(request, req, "tgi")

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            answer = tokenize_body(self.kind, decode_json(await request.read()), self.engine.max_model_len)
        except EngineApiError as exc:
            return self.error(exc)
        return web.json_response(answer)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            models_body(
                self.kind,
                self.served_model,
                self.created_unix,
                self.engine.max_model_len,
                self.engine.config.model.hf_id or self.engine.config.model.name,
            )
        )

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(tgi_info_body(self.engine, self.served_model, self.max_concurrent_requests))

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
