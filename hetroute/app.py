"""The composition root of the gateway: ``build_app(cfg, ...) -> web.Application``.

Owns the wiring (house style §1, §8): it builds the policy, predictor, ledger, router,
health tracker, metrics store, telemetry and forwarder from a resolved :class:`Config`
and exposes them through typed ``web.AppKey``s. Nothing runs at import time and there
are no globals: every call builds a fresh, independent app.

Lifecycle (``cleanup_ctx``, reverse order on shutdown): the client sessions
(:class:`~hetroute.proxy.upstream.Upstream`, built here and injected into the forwarder, opened once the
loop runs), then the background tasks (active probes, one scraper per backend), which are cancelled and
awaited before the sessions close.

``hetroute serve --workers N`` builds one app per worker process with this same function
(``worker=k``); nothing is shared between them but the listening port.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from hetroute.access_log import AccessLog, LineSink
from hetroute.admission.full import Placer
from hetroute.admission.gate import AdmissionGate
from hetroute.backends.dns import DnsDiscovery, dns_loop, make_resolver
from hetroute.backends.health import HealthTracker
from hetroute.backends.membership import Membership
from hetroute.backends.scrape import MetricsStore
from hetroute.backends.tasks import BackendTasks
from hetroute.clock import MonotonicClock, Sleeper
from hetroute.config import ComponentConfig, Config
from hetroute.learning.build import build_live_models
from hetroute.learning.live import LiveModels
from hetroute.learning.state import load_saved, save_all
from hetroute.policies import PolicyContext, build_policy
from hetroute.policies.backend_model import BackendModels
from hetroute.prefix.state import PrefixState
from hetroute.proxy.api_errors import WORKER_HEADER
from hetroute.proxy.client_limits import ClientGuard, limits_of
from hetroute.proxy.connection import LINGERING_S, GuardedRunner
from hetroute.proxy.forward import Forwarder, ForwardSettings
from hetroute.proxy.local_errors import error_middleware
from hetroute.proxy.protocols import TokenEstimator
from hetroute.proxy.server import Gateway, add_routes
from hetroute.proxy.upstream import Upstream
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.telemetry import Telemetry
from hetroute.types import BackendSpec, Clock, Policy
from predictors import DEFAULT_PREDICTOR, build_predictor

CONFIG = web.AppKey("config", Config)
ROUTER = web.AppKey("router", Router)
LEDGER = web.AppKey("ledger", Ledger)
HEALTH = web.AppKey("health", HealthTracker)
METRICS = web.AppKey("metrics", MetricsStore)
TELEMETRY = web.AppKey("telemetry", Telemetry)
FORWARDER = web.AppKey("forwarder", Forwarder)
UPSTREAM = web.AppKey("upstream", Upstream)
ADMISSION = web.AppKey("admission", AdmissionGate)
MEMBERSHIP = web.AppKey("membership", Membership)
LEARNER = web.AppKey("learner", LiveModels)
CLIENT_GUARD = web.AppKey("client_guard", ClientGuard)
SAVE_DIR = web.AppKey("save_dir", str)
"""Where this app writes its learned models (absent: it writes none)."""

log = logging.getLogger(__name__)

RUNNER_SHUTDOWN_S = 0.2
"""aiohttp's own wait for handlers at ``runner.cleanup()``. The grace period is served before,
by :func:`hetroute.proxy.drain.drain`; a bare ``cleanup()`` (tests, demo) cuts what still runs."""


def tgi_model_of(cfg: Config, specs: tuple[BackendSpec, ...]) -> str | None:
    """The model TGI requests (which carry no model) are routed as: ``default_model`` when a
    TGI backend serves it, else the first model of the first TGI backend."""
    tgi = [s for s in specs if s.engine == "tgi"]
    if not tgi:
        return None
    if cfg.default_model is not None and any(cfg.default_model in s.models for s in tgi):
        return cfg.default_model
    return tgi[0].models[0]


def build_app(
    cfg: Config,
    *,
    clock: Clock | None = None,
    seed: int | None = None,
    registry: CollectorRegistry | None = None,
    access_sink: LineSink | None = None,
    worker: int | None = None,
) -> web.Application:
    """A ready-to-run gateway for ``cfg`` (whose backends must be resolved by discovery).

    ``access_sink`` receives each access-log line (default: the ``hetroute.access`` logger).
    ``worker`` is this process's index among the ``server.workers`` processes of ``hetroute serve
    --workers`` (None: the only process). Worker k draws its random choices from ``seed + k``
    (policy tie-breaks, predictor, request-id prefix), so the workers' choices differ; every response
    it prepares carries ``x-hetroute-worker: k``; and all workers load saved models from
    ``learning.state_dir`` but only worker 0 writes there, so no two processes write one file.
    """
    clock = clock or MonotonicClock()
    seed = (cfg.seed if seed is None else seed) + (worker or 0)
    registry = registry if registry is not None else CollectorRegistry()
    specs = cfg.specs()
    names = [s.name for s in specs]

    # The backends' static latency models (profile → roofline prior → neutral default) are resolved
    # once, here: the policy, the learner and /admin all read this one copy.
    backend_models = BackendModels.from_specs(specs)

    def policy_for(backends: tuple[BackendSpec, ...], models: BackendModels) -> Policy:
        return build_policy(cfg.policy.type, cfg.policy.params, PolicyContext(backends, seed, models))

    policy = policy_for(specs, backend_models)
    learner: LiveModels | None = None
    if cfg.learning.enabled:
        saved = load_saved(cfg.learning.state_dir, specs) if cfg.learning.state_dir else {}
        learner = build_live_models(backend_models, cfg.learning, saved)
    pred_cfg = cfg.predictor or ComponentConfig(DEFAULT_PREDICTOR)
    predictor = build_predictor(pred_cfg.type, pred_cfg.params, seed)
    telemetry = Telemetry(registry)
    health = HealthTracker(
        cfg.health, names, clock, on_eject=lambda i: telemetry.ejections.labels(names[i]).inc()
    )
    metrics = MetricsStore(len(specs), clock, cfg.scrape.stale_after_s)
    ledger = Ledger(names)
    router = Router(
        specs,
        policy,
        ledger,
        clock,
        is_available=health.is_available,
        latest_metrics=metrics.latest,
        available_all=health.available_all,
        latest_metrics_all=metrics.latest_all,
        on_decision=telemetry.on_decision,
        learner=learner,
        prefix=PrefixState(len(specs), cfg.prefix) if cfg.prefix.enabled else None,
        foreign=cfg.scrape.foreign_load,
    )
    metrics.on_publish = router.scraped
    membership = Membership(
        router=router,
        health=health,
        metrics=metrics,
        backend_models=backend_models,
        build_policy=policy_for,
        learner=learner,
    )
    telemetry.bind_backends(
        names, health.is_available, metrics.age_s, lambda i: int(ledger.requests_in_flight[i])
    )
    if learner is not None:
        telemetry.bind_learner(learner)
    if router.prefix is not None:
        telemetry.bind_prefix(router.prefix)
    telemetry.bind_foreign(router.foreign_requests)

    def members_changed(_: int, __: BackendSpec) -> None:
        telemetry.set_members([(i, router.backends[i].name) for i in router.members()])

    membership.on_join.append(members_changed)
    membership.on_leave.append(members_changed)
    estimator = TokenEstimator(cfg.tokens.initial_chars_per_token, cfg.tokens.learn_rate)
    t = cfg.timeouts
    adm = cfg.admission
    admission: AdmissionGate | None = None
    if adm.enabled:
        admission = AdmissionGate(adm, router, Placer(router, adm.full, backend_models), clock, registry)
    upstream = Upstream(t.connect_s)
    forwarder = Forwarder(
        router=router,
        health=health,
        telemetry=telemetry,
        access_log=AccessLog(access_sink, enabled=cfg.server.access_log),
        estimator=estimator,
        predictor=predictor,
        clock=clock,
        settings=ForwardSettings(
            t.connect_s,
            t.first_byte_s,
            t.idle_s,
            cfg.retries.max_attempts,
            request_s=t.request_s,
            retry_request_timeouts=cfg.retries.retry_request_timeouts,
        ),
        id_prefix=f"{random.Random(seed).getrandbits(32):08x}",
        upstream=upstream,
        admission=admission,
    )
    guard = ClientGuard(
        limits_of(cfg.server),
        telemetry=telemetry,
        access_log=forwarder.access_log,
        next_request_id=forwarder.next_request_id,
    )
    gateway = Gateway(
        forwarder=forwarder,
        router=router,
        health=health,
        metrics=metrics,
        telemetry=telemetry,
        max_body_bytes=cfg.server.max_body_bytes,
        admin_token=cfg.admin_token,
        tgi_model=tgi_model_of(cfg, specs),
        info_timeout_s=t.discovery_s,
        backend_models=backend_models,
        learner=learner,
        body_timeout_s=cfg.server.body_timeout_s,
        membership=membership,
        workers=cfg.server.workers,
        drain_timeout_s=cfg.server.shutdown_grace_s,
    )

    app = web.Application(
        client_max_size=cfg.server.max_body_bytes,
        middlewares=[error_middleware(guard, clock, cfg.server.max_body_bytes)],
    )
    app[CLIENT_GUARD] = guard
    app[CONFIG] = cfg
    app[ROUTER] = router
    app[LEDGER] = ledger
    app[HEALTH] = health
    app[METRICS] = metrics
    app[MEMBERSHIP] = membership
    app[TELEMETRY] = telemetry
    app[FORWARDER] = forwarder
    app[UPSTREAM] = upstream
    if admission is not None:
        app[ADMISSION] = admission
        app.on_cleanup.append(_close_admission)
    if learner is not None:
        app[LEARNER] = learner
        if cfg.learning.state_dir and not worker:
            app[SAVE_DIR] = cfg.learning.state_dir
    if worker is not None:
        app.on_response_prepare.append(_worker_header(worker))
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_background_tasks)
    add_routes(app, gateway)
    return app


def _worker_header(worker: int) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    value = str(worker)

    async def tag(_: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = value

    return tag


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    upstream = app[UPSTREAM]
    upstream.open()
    yield
    await upstream.close()


async def _close_admission(app: web.Application) -> None:
    app[ADMISSION].close()


async def _background_tasks(app: web.Application) -> AsyncIterator[None]:
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
    yield
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


async def learning_loop(
    learner: LiveModels,
    router: Router,
    cfg: Config,
    save_dir: str | None,
    sleep: Sleeper = asyncio.sleep,
) -> None:
    """Refit the live models every ``learning.refit_interval_s`` (waited through ``sleep``; off the
    request path: requests only append observations) and save them to ``save_dir`` every
    ``learning.save_interval_s`` (None: never)."""
    every = cfg.learning
    clock = router.clock
    last_save = clock.now()
    while True:
        await sleep(every.refit_interval_s)
        learner.set_capacities(router.snapshot().kv_capacity_tokens)
        learner.refit(clock.now())
        if save_dir and clock.now() - last_save >= every.save_interval_s:
            last_save = clock.now()
            _save(learner, router, save_dir)


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner every entry point uses: handlers are cancelled when their client goes away
    (so the upstream request is aborted at once) and connections have client deadlines
    (:mod:`hetroute.proxy.connection`). Graceful shutdown is :func:`hetroute.proxy.drain.drain`."""
    server = app[CONFIG].server
    return GuardedRunner(
        app,
        guard=app[CLIENT_GUARD],
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=RUNNER_SHUTDOWN_S,
        # aiohttp's own idle close is only a backstop: the guard closes idle connections first
        keepalive_timeout=2 * server.keepalive_idle_s + 1.0,
        lingering_time=LINGERING_S,
    )


async def start_app(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, reuse_port: bool = False
) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``host:port`` (0: any free port); returns the runner and the bound port.
    When it cannot listen (the port is taken), the app is cleaned up and the OSError raised.

    ``reuse_port``: bind with ``SO_REUSEPORT``, so that several processes (``hetroute serve
    --workers``) listen on one port and the kernel spreads new connections across them (Linux)."""
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()  # the app's sessions and background tasks started at setup
        raise
    bound = runner.addresses[0][1]
    return runner, int(bound)
