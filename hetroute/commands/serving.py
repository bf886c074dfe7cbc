"""What the single-process gateway and each worker of ``hetroute serve --workers N`` share: the
effective-config line, the open-admin warning, the signal event and the serve-then-drain loop
(:mod:`hetroute.commands.serve`, :mod:`hetroute.commands.serve_workers`)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
from collections.abc import Iterable
from typing import Protocol

from aiohttp import web

from hetroute.app import CLIENT_GUARD, CONFIG, FORWARDER
from hetroute.config import Config
from hetroute.proxy.admin_auth import admin_exposure_warning
from hetroute.proxy.drain import drain

log = logging.getLogger("hetroute.serve")

GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two collections of the cyclic GC's youngest generation while serving (CPython's
default: 700). Each collection traverses every young object still alive, which under load are mostly
the in-flight requests' own: with the default, 64 concurrent requests through the gateway cost about
18 µs of collection per request (measured with ``gc.callbacks``), with 10,000 about 4 µs. Cyclic garbage
(rare: requests free their objects by reference counting) lives a little longer."""


def warn_if_admin_exposed(cfg: Config) -> None:
    """Log a WARNING when ``/admin`` is open to anyone who can reach a non-loopback listener."""
    warning = admin_exposure_warning(cfg.server.host, cfg.admin_token)
    if warning is not None:
        log.warning("%s", warning)


def describe(cfg: Config) -> str:
    backends = [
        {
            "name": b.name,
            "url": b.url,
            "engine": b.engine,
            "models": list(b.models or ()),
            "profile": b.profile_path,
        }
        for b in cfg.backends
    ]
    return json.dumps(
        {
            "policy": cfg.policy.type,
            "predictor": cfg.predictor.type if cfg.predictor else "default",
            "backends": backends,
            "listen": f"{cfg.server.host}:{cfg.server.port}",
            "workers": cfg.server.workers,
            "client_limits": {
                k: getattr(cfg.server, k)
                for k in ("header_timeout_s", "body_timeout_s", "keepalive_idle_s", "max_connections")
            },
            "admin_token": "set" if cfg.admin_token else "none",
        }
    )


class Flushable(Protocol):
    def flush(self) -> None: ...


async def _flush_every(stream: Flushable, interval_s: float) -> None:
    """Access-log lines are written to a buffered stdout; push them out periodically."""
    while True:
        await asyncio.sleep(interval_s)
        stream.flush()


def stop_on(signals: Iterable[signal.Signals]) -> asyncio.Event:
    """An event that any of ``signals`` sets, from now on, on the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until(
    stop: asyncio.Event, app: web.Application, runner: web.AppRunner, out: Flushable
) -> None:
    """Serve ``app`` (listening through ``runner``) until ``stop`` is set, then close the listener
    and drain in-flight requests within ``server.shutdown_grace_s`` (+ < 1 s). ``out``, where the
    access log's lines go, is flushed every 0.5 s and at the end."""
    grace_s = app[CONFIG].server.shutdown_grace_s
    # Everything built so far lives as long as the process: keep it out of the cyclic GC's
    # scans, so a full collection does not stall requests for milliseconds.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    flusher = asyncio.create_task(_flush_every(out, 0.5))
    try:
        await stop.wait()
        log.info("shutting down: draining in-flight requests for up to %gs", grace_s)
        await drain(runner, app[FORWARDER], app[CLIENT_GUARD], grace_s)
    finally:
        await runner.cleanup()  # no-op after drain; cuts everything on an error
        flusher.cancel()
        out.flush()


def reload_on_sighup(app: web.Application, config_path: str | None) -> None:
    """From now on, SIGHUP applies the backends of ``config_path`` to ``app``
    (:mod:`hetroute.commands.reload`); without a config file it only logs that there is nothing to
    reload."""
    if config_path is None:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGHUP, log.warning, "SIGHUP: nothing to reload (started with --backend, not --config)"
        )
        return
    from hetroute.commands.reload import Reloader

    reloader = Reloader(app, config_path)
    reloader.remember()
    reloader.on_sighup()
