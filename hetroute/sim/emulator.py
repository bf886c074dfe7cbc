"""A real-time HTTP emulator of one vLLM or TGI server, driven by :class:`EngineModel`.

Owns the aiohttp app (:func:`build_emulator_app`: routes, the fault middleware, the lifecycle that runs
the single background driver task) and serving it (:func:`run_emulator`). The per-app state, the driver
loop and the request handlers are :class:`hetroute.sim.emulator_core.Emulator`.

Endpoints (both flavours): ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE and non-stream,
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health`` (200, empty), ``GET /metrics``
(real vLLM or TGI names, see :mod:`emulator_metrics`). vLLM only: ``POST /tokenize``
(``{count, max_model_len, tokens}``), ``GET /version``, ``GET /load``. TGI only: ``POST /generate``,
``POST /generate_stream``, ``POST /`` (``stream`` flag), ``GET /info``, ``POST /tokenize`` (TGI shape).

Faults are :class:`hetroute.sim.emulator_faults.FaultConfig` (all seeded). ``speedup`` divides every
modelled duration; ``slow_start_s`` and all reported latencies are wall-clock seconds of the injected clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

from aiohttp import web

from hetroute.clock import MonotonicClock
from hetroute.latency import EMULATOR_MARK
from hetroute.sim.emulator_core import Emulator
from hetroute.sim.emulator_faults import FaultConfig, drop_connection
from hetroute.sim.emulator_protocol import EngineApiError, EngineKind
from hetroute.sim.engine_model import EngineModel
from hetroute.types import Clock

VLLM_VERSION = "0.32.0"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

EMULATOR_KEY = web.AppKey("hetroute_emulator", Emulator)


@web.middleware
async def _fault_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    emu = request.app[EMULATOR_KEY]
    if emu.crashed:
        return drop_connection(request)
    if emu.faults.slow_start_s and emu.clock.now() - emu.started_s < emu.faults.slow_start_s:
        return emu.error(
            EngineApiError(
                503, "Server is starting (injected slow start)", "ServiceUnavailableError", "unhealthy"
            )
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
        return web.json_response({"version": VLLM_VERSION, EMULATOR_MARK: True})

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


__all__ = ["build_emulator_app", "run_emulator", "emulator_of"]
