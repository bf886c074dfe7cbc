"""An app's lifecycle (aiohttp ``cleanup_ctx`` and ``on_cleanup``): the flushes of what the metrics
and the access log hold, the upstream sessions, then the background tasks (per-backend probes and
scrapes, DNS discovery, the learning loop, the peer channel's socket and send loop), which are
cancelled and awaited before the sessions close, and the learned models saved at the end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from hetroute.app_keys import (
    ADMISSION,
    CONFIG,
    FORWARDER,
    HEALTH,
    LEARNER,
    MEMBERSHIP,
    METRICS,
    PEERS,
    ROUTER,
    SAVE_DIR,
    TELEMETRY,
    UPSTREAM,
)
from hetroute.backends.dns import DnsDiscovery, dns_loop, make_resolver
from hetroute.backends.tasks import BackendTasks
from hetroute.clock import Sleeper
from hetroute.config import Config
from hetroute.learning.live import LiveModels
from hetroute.learning.state import save_all
from hetroute.routing.router import Router

log = logging.getLogger("hetroute.app")

FLUSH_INTERVAL_S = 0.25
"""How often the metrics and the access log take in the finished requests they hold (at most this
late, plus a scrape's own flush: ``/metrics`` is exact at every exposition)."""


async def client_session(app: web.Application) -> AsyncIterator[None]:
    upstream = app[UPSTREAM]
    upstream.open()
    yield
    await upstream.close()


async def held_records(app: web.Application) -> AsyncIterator[None]:
    """Every ``FLUSH_INTERVAL_S``, and once at the end (after the requests drained), apply what the
    metrics, the access log, the token estimator and the output-length predictor hold of finished
    requests (they batch it: telemetry.py, access_log.py, proxy/held_answers.py)."""
    telemetry, forwarder = app[TELEMETRY], app[FORWARDER]

    def flush() -> None:
        telemetry.flush()
        forwarder.access_log.flush()
        forwarder.answers.flush()

    async def every(interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            flush()

    task = asyncio.create_task(every(FLUSH_INTERVAL_S))
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    flush()


async def close_admission(app: web.Application) -> None:
    app[ADMISSION].close()


async def background_tasks(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    session = app[UPSTREAM].session
    router = app[ROUTER]
    membership = app[MEMBERSHIP]
    per_backend = BackendTasks(app[HEALTH], app[METRICS], session, cfg.scrape)
    for i in router.members():
        per_backend.start(i, router.backends[i])
    membership.on_join.append(per_backend.start)
    membership.on_leave.append(per_backend.stop)
    tasks = []
    if cfg.dns_entries():  # resolved at once, then every dns.interval_s
        resolver = make_resolver(cfg.dns)
        found = [
            DnsDiscovery(e, membership, resolver, session, discovery_timeout_s=cfg.timeouts.discovery_s)
            for e in cfg.dns_entries()
        ]
        tasks.append(asyncio.create_task(dns_loop(found, cfg.dns.interval_s)))
    learner = app.get(LEARNER)
    save_dir = app.get(SAVE_DIR)
    if learner is not None:
        tasks.append(asyncio.create_task(learning_loop(learner, router, cfg, save_dir)))
    peers = app.get(PEERS)
    if peers is not None:  # the other router replicas' summaries (peer_channel.py)
        try:
            await peers.start()
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await per_backend.close()
            raise
        tasks.append(asyncio.create_task(peers.run()))
    yield
    if peers is not None:
        peers.close()
    membership.on_join.remove(per_backend.start)
    membership.on_leave.remove(per_backend.stop)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await per_backend.close()
    if learner is not None and save_dir:
        _save(learner, router, save_dir)


def _save(learner: LiveModels, router: Router, state_dir: str) -> None:
    caps = router.snapshot().kv_capacity_tokens
    try:
        written = save_all(learner, router.backends, [float(c) for c in caps], state_dir)
    except OSError as exc:
        log.warning("could not save the learned models to %s: %s", state_dir, exc)
        return
    log.info("saved %d learned backend model(s) to %s", written, state_dir)


REFIT_SLICE = 4
"""Backends refitted in one event-loop step by :func:`learning_loop` (a few milliseconds each)."""
REFIT_CPU_SHARE = 0.2
"""The most of the process's time :func:`learning_loop` spends refitting, over a pass and the wait
after it."""


async def learning_loop(
    learner: LiveModels,
    router: Router,
    cfg: Config,
    save_dir: str | None,
    sleep: Sleeper = asyncio.sleep,
) -> None:
    """Refit the live models every ``learning.refit_interval_s`` (waited through ``sleep``; off the
    request path: requests only append observations) and save them to ``save_dir`` every
    ``learning.save_interval_s`` (None: never).

    A pass refits the backends with new observations ``REFIT_SLICE`` at a time and lets the event
    loop serve requests between two slices, so a large fleet never holds it for long (a fit takes a
    few milliseconds: 64 busy backends took about 0.15 s at once). When a pass took longer than
    ``REFIT_CPU_SHARE`` of the time since the previous one, the next waits longer, so refitting
    takes at most that share of the process's time however many backends are busy: each backend is
    then refitted less often than every ``refit_interval_s``."""
    every = cfg.learning
    clock = router.clock
    last_save = clock.now()
    wait_s = every.refit_interval_s
    while True:
        await sleep(wait_s)
        learner.set_capacities(router.snapshot().kv_capacity_tokens)
        started = clock.now()
        slices = -(-learner.dirty_backends() // REFIT_SLICE)  # one pass over the backends dirty now
        for k in range(slices):
            if k:
                await asyncio.sleep(0)  # requests first
            learner.refit(clock.now(), limit=REFIT_SLICE)
        spent_s = clock.now() - started
        wait_s = max(every.refit_interval_s, spent_s / REFIT_CPU_SHARE - spent_s)
        if save_dir and clock.now() - last_save >= every.save_interval_s:
            last_save = clock.now()
            _save(learner, router, save_dir)
