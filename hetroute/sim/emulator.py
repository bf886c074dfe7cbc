"""A real-time HTTP emulator of one vLLM or TGI server, driven by :class:`EngineModel`.

Owns the aiohttp app (:func:`build_emulator_app`), its single background driver task and fault injection.
The driver loops: ``engine.step(now)``, sleep ``duration_s / speedup``, then hand the step's tokens to the
waiting requests. Sleeps are paced against a running deadline on the event loop's timer, so waits shorter
than the poller's ~1 ms resolution (high speedups) do not slow the engine down; the injected clock only
timestamps requests (TTFT, latency histograms, slow start). Request handlers admit requests into the engine,
stream or collect their tokens, and abort them in the engine (freeing KV blocks) when the client disconnects.

Endpoints (both flavours): ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE and non-stream,
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health`` (200, empty), ``GET /metrics``
(real vLLM or TGI names, see :mod:`emulator_metrics`). vLLM only: ``POST /tokenize``
(``{count, max_model_len, tokens}``), ``GET /version``, ``GET /load``. TGI only: ``POST /generate``,
``POST /generate_stream``, ``POST /`` (``stream`` flag), ``GET /info``, ``POST /tokenize`` (TGI shape).

Token counts are deterministic (:mod:`emulator_text`): prompt tokens = ceil(chars / 4) (chat: per message
+4, +3 for the generation prompt); output length honours ``max_tokens``/``max_new_tokens``, with
``ignore_eos`` or ``min_tokens`` forcing the exact length, else a seeded ShareGPT-like draw. Prompt token ids
are deterministic too, so the engine's prefix cache hits a repeated prompt prefix (on unless the engine's
``enable_prefix_caching`` is off).

Faults (:class:`FaultConfig`, all seeded): ``error_rate`` (500/503 JSON), ``crash_after_requests`` (the
next generation request and every later request, in-flight ones included, get their connection dropped),
``hang_rate`` with ``hang_after_tokens`` (never answer, or stall a stream after k tokens),
``slow_start_s`` (every endpoint answers 503 for that many wall seconds), ``fail_mid_stream_after_tokens``
(drop the connection after k tokens). ``speedup`` divides every modelled duration; ``slow_start_s`` and
all reported latencies are wall-clock seconds of the injected clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hetroute.clock import MonotonicClock
from hetroute.errors import ConfigError
from hetroute.sim.emulator_meta import models_body, tgi_info_body, tokenize_body
from hetroute.sim.emulator_metrics import EmulatorMetrics
from hetroute.sim.emulator_protocol import (
    ApiError,
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

VLLM_VERSION = "0.32.0"
IDLE_GATHER_YIELDS = 8  # loop iterations an idle engine waits for companions of the first request
MAX_LAG_S = 0.05  # how far behind schedule the driver may fall before it stops catching up
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class FaultConfig:
    """Injected failures; rates are probabilities per generation request, drawn from the app's seeded RNG.

    - ``error_rate``: answer 500 or 503 (even odds) with the engine's JSON error shape.
    - ``crash_after_requests``: after N generation requests, the next one crashes the server: it and
      every later request (any endpoint), and all requests in flight, get their connection dropped.
    - ``hang_rate``: the request is accepted and never answered (``hang_after_tokens`` None) or its
      stream stalls after ``hang_after_tokens`` tokens (a non-stream request then never completes).
    - ``slow_start_s``: every endpoint answers 503 until that many seconds (injected clock) after start.
    - ``fail_mid_stream_after_tokens``: every request's connection is dropped after k tokens.
    - ``slowdown_factor`` / ``slowdown_after_s``: from that many seconds (injected clock) after start,
      every engine step takes ``slowdown_factor`` times its modelled time (another tenant on the GPU,
      thermal throttling); the simulator's ``Slowdown`` is the same fault.
    """

    error_rate: float = 0.0
    crash_after_requests: int | None = None
    hang_rate: float = 0.0
    hang_after_tokens: int | None = None
    slow_start_s: float = 0.0
    fail_mid_stream_after_tokens: int | None = None
    slowdown_factor: float = 1.0
    slowdown_after_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.slowdown_factor > 0 and math.isfinite(self.slowdown_factor)):
            raise ConfigError(
                "faults.slowdown_factor", f"expected a finite number > 0, got {self.slowdown_factor!r}"
            )
        if self.slowdown_after_s < 0 or not math.isfinite(self.slowdown_after_s):
            raise ConfigError(
                "faults.slowdown_after_s", f"expected a finite number >= 0, got {self.slowdown_after_s!r}"
            )
        for name in ("error_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"faults.{name}", f"expected a probability in [0, 1], got {value!r}")
        if self.slow_start_s < 0 or not math.isfinite(self.slow_start_s):
            raise ConfigError(
                "faults.slow_start_s", f"expected a finite number >= 0, got {self.slow_start_s!r}"
            )
        for name in ("crash_after_requests", "hang_after_tokens", "fail_mid_stream_after_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"faults.{name}", f"expected an integer >= 0 or None, got {value!r}")


def drop_connection(request: web.Request) -> web.StreamResponse:
    """Abort the TCP connection (the client sees a disconnect); returns a response aiohttp can discard."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response()


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
        """Submit ``req`` to the engine (ApiError for faults, limits and over-long prompts)."""
        if self.kind == "tgi" and len(self.lives) >= self.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "RateLimitError", "overloaded")
        if self.faults.error_rate and self.rng.random() < self.faults.error_rate:
            self.metrics.requests_failed += 1
            if self.rng.random() < 0.5:
                raise ApiError(
                    500, "Internal server error (injected fault)", "InternalServerError", "generation"
                )
            raise ApiError(
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

    def _too_long(self, req: GenRequest, cap: int) -> ApiError:
        limit = self.engine.max_model_len
        if self.kind == "tgi":
            return ApiError(
                422,
                f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {limit}. "
                f"Given: {req.prompt_tokens} `inputs` tokens and {cap} `max_new_tokens`",
                "BadRequestError",
            )
        return ApiError(400, str(PromptTooLong(req.prompt_tokens, cap, limit)), "BadRequestError")

    def release(self, live: Live) -> None:
        """Abort an unfinished request in the engine (frees its KV blocks) and count it as aborted."""
        if live.done or self.lives.pop(live.rid, None) is None:
            return
        self.engine.abort(live.rid)
        self.metrics.finished_by_reason["abort"] += 1
        self.metrics.requests_failed += 1

    # -------------------------------------------------------------- handlers

    def error(self, exc: ApiError) -> web.Response:
        return web.json_response(exc.body(self.kind), status=exc.status)

    async def generate(self, request: web.Request, req: GenRequest, prefix: str) -> web.StreamResponse:
        self.accepted += 1
        limit = self.faults.crash_after_requests
        if limit is not None and self.accepted > limit:
            self.crash()
            return drop_connection(request)
        try:
            live = self.admit(req, prefix)
        except ApiError as exc:
            return self.error(exc)
        try:
            return await respond(self, request, req, live)
        finally:
            self.release(live)

    async def openai(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            body = decode_json(await request.read())
            req = parse_openai(body, "chat" if api == "chat" else "completions", self.served_model, self.kind)
        except ApiError as exc:
            return self.error(exc)
        return await self.generate(request, req, "chatcmpl" if api == "chat" else "cmpl")

    async def tgi(self, request: web.Request, stream: bool | None) -> web.StreamResponse:
        try:
            body = decode_json(await request.read())
            req = parse_tgi(body, bool(body.get("stream", False)) if stream is None else stream)
            if stream is None:
                req = dataclasses.replace(req, as_list=True)
        except ApiError as exc:
            exc.status = 422 if exc.status == 400 else exc.status
            return self.error(exc)
        return await self.generate(request, req, "tgi")

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            answer = tokenize_body(self.kind, decode_json(await request.read()), self.engine.max_model_len)
        except ApiError as exc:
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


EMULATOR_KEY = web.AppKey("hetroute_emulator", Emulator)


@web.middleware
async def _fault_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    emu = request.app[EMULATOR_KEY]
    if emu.crashed:
        return drop_connection(request)
    if emu.faults.slow_start_s and emu.clock.now() - emu.started_s < emu.faults.slow_start_s:
        return emu.error(
            ApiError(503, "Server is starting (injected slow start)", "ServiceUnavailableError", "unhealthy")
        )
    return await handler(request)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    emu = app[EMULATOR_KEY]
    emu.started_s = emu.clock.now()
    task = asyncio.create_task(emu.drive(), name="hetroute-emulator-driver")
    yield
    emu.closing.set()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task


def build_emulator_app(
    engine: EngineModel,
    *,
    served_model: str,
    engine_kind: EngineKind,
    speedup: float = 1.0,
    faults: FaultConfig | None = None,
    seed: int = 0,
    clock: Clock | None = None,
    max_concurrent_requests: int = 128,
) -> web.Application:
    """An aiohttp app emulating one vLLM or TGI server backed by ``engine`` (one driver task per app)."""
    emu = Emulator(
        engine,
        served_model,
        engine_kind,
        speedup,
        faults or FaultConfig(),
        seed,
        clock or MonotonicClock(),
        max_concurrent_requests,
    )
    app = web.Application(middlewares=[_fault_middleware])
    app[EMULATOR_KEY] = emu
    app.cleanup_ctx.append(_lifecycle)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def load(request: web.Request) -> web.Response:
        return web.json_response({"server_load": len(emu.lives)})

    async def completions(request: web.Request) -> web.StreamResponse:
        return await emu.openai(request, "completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await emu.openai(request, "chat")

    r = app.router
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat)
    r.add_get("/v1/models", emu.models)
    r.add_get("/health", health)
    r.add_get("/metrics", emu.metrics_text)
    r.add_post("/tokenize", emu.tokenize)
    if engine_kind == "tgi":

        async def generate(request: web.Request) -> web.StreamResponse:
            return await emu.tgi(request, False)

        async def generate_stream(request: web.Request) -> web.StreamResponse:
            return await emu.tgi(request, True)

        async def compat(request: web.Request) -> web.StreamResponse:
            return await emu.tgi(request, None)

        r.add_post("/generate", generate)
        r.add_post("/generate_stream", generate_stream)
        r.add_post("/", compat)
        r.add_get("/info", emu.info)
    else:
        r.add_get("/version", version)
        r.add_get("/load", load)
    return app


@asynccontextmanager
async def run_emulator(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 1.0
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0 = any free port) and yield its base URL (``http://host:port``)."""
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=shutdown_timeout_s, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()


def emulator_of(app: web.Application) -> Emulator:
    """The :class:`Emulator` state of an app built by :func:`build_emulator_app` (for tests and tools)."""
    return app[EMULATOR_KEY]


__all__ = ["FaultConfig", "Emulator", "build_emulator_app", "run_emulator", "emulator_of", "drop_connection"]
