"""The composition root of the gateway: ``build_app(cfg, ...) -> web.Application``.

Owns the wiring (house style §1, §8): it builds the policy, predictor, ledger, router,
health tracker, metrics store, telemetry and forwarder from a resolved :class:`Config`
and exposes them through the typed ``web.AppKey``s of :mod:`hetroute.app_keys` (re-exported here).
Nothing runs at import time and there are no globals: every call builds a fresh, independent app.

Lifecycle (:mod:`hetroute.lifecycle`, ``cleanup_ctx``, reverse order on shutdown): the client sessions
(:class:`~hetroute.proxy.upstream.Upstream`, built here and injected into the forwarder, opened once the
loop runs), then the background tasks (each member backend's probe and scrape, DNS discovery, the
learning loop), which are cancelled and awaited before the sessions close.

``hetroute serve --workers N`` builds one app per worker process with this same function
(``worker=k``); nothing is shared between them but the listening port.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from hetroute.access_log import AccessLog, LineSink
from hetroute.admission.full import Placer
from hetroute.admission.gate import AdmissionGate
from hetroute.app_keys import (
    ADMISSION,
    CLIENT_GUARD,
    CONFIG,
    FORWARDER,
    HEALTH,
    LEARNER,
    LEDGER,
    MEMBERSHIP,
    METRICS,
    PEERS,
    ROUTER,
    SAVE_DIR,
    TELEMETRY,
    UPSTREAM,
)
from hetroute.backends.dns import make_resolver
from hetroute.backends.health import HealthTracker
from hetroute.backends.membership import Membership
from hetroute.backends.scrape import MetricsStore
from hetroute.clock import MonotonicClock
from hetroute.config import ComponentConfig, Config
from hetroute.learning.build import build_live_models
from hetroute.learning.live import LiveModels
from hetroute.learning.state import load_saved
from hetroute.lifecycle import (
    background_tasks,
    client_session,
    close_admission,
    held_records,
    learning_loop,
)
from hetroute.peer_channel import PeerChannel
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
from hetroute.routing.peers import PeerView
from hetroute.routing.router import Router
from hetroute.telemetry import Telemetry
from hetroute.types import BackendSpec, Clock, FloatArray, Policy
from predictors import DEFAULT_PREDICTOR, build_predictor

log = logging.getLogger(__name__)

__all__ = [
    "ADMISSION",
    "CLIENT_GUARD",
    "CONFIG",
    "FORWARDER",
    "HEALTH",
    "LEARNER",
    "LEDGER",
    "MEMBERSHIP",
    "METRICS",
    "PEERS",
    "ROUTER",
    "SAVE_DIR",
    "TELEMETRY",
    "UPSTREAM",
    "build_app",
    "learning_loop",
    "make_runner",
    "start_app",
    "tgi_model_of",
]


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
    ``learning.state_dir`` but only worker 0 writes there, so no two processes write one file. With
    ``peers.addresses`` set, the router exchanges summaries with the other replicas (every worker is a
    replica of its own, with a random replica id, listening on ``peers.listen_port + k``).
    """
    clock = clock or MonotonicClock()
    seed = (cfg.seed if seed is None else seed) + (worker or 0)
    registry = registry if registry is not None else CollectorRegistry()
    telemetry = Telemetry(registry)
    replica = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"  # unique per process
    cluster = _cluster(cfg, seed, clock, telemetry, replica)
    _bind_telemetry(telemetry, cluster)
    forwarder = _forwarder(cfg, cluster, telemetry, clock, seed, access_sink, registry)
    gate = forwarder.admission
    if gate is not None:  # a backend that joins is capacity for the requests waiting now
        cluster.membership.on_join.append(lambda _i, _spec: gate.wake())
        telemetry.bind_queue_limits(gate.placer.sequence_limit)
        _warn_unknown_seqs(cluster.router.backends, cluster.models.max_num_seqs)
    guard = ClientGuard(
        limits_of(cfg.server),
        telemetry=telemetry,
        access_log=forwarder.access_log,
        next_request_id=forwarder.next_request_id,
    )
    t = cfg.timeouts
    gateway = Gateway(
        forwarder=forwarder,
        router=cluster.router,
        health=cluster.health,
        metrics=cluster.metrics,
        telemetry=telemetry,
        max_body_bytes=cfg.server.max_body_bytes,
        admin_token=cfg.admin_token,
        tgi_model=tgi_model_of(cfg, cluster.router.backends),
        info_timeout_s=t.discovery_s,
        backend_models=cluster.models,
        learner=cluster.learner,
        body_timeout_s=cfg.server.body_timeout_s,
        membership=cluster.membership,
        workers=cfg.server.workers,
        drain_timeout_s=cfg.server.shutdown_grace_s,
    )
    app = web.Application(
        client_max_size=cfg.server.max_body_bytes,
        middlewares=[error_middleware(guard, clock, cfg.server.max_body_bytes)],
    )
    app[CLIENT_GUARD] = guard
    app[CONFIG] = cfg
    app[TELEMETRY] = telemetry
    _register(app, cluster, forwarder, worker)
    if cfg.peers.enabled and cfg.peer_key:
        channel = PeerChannel(
            cluster.router,
            cfg.peers,
            cfg.peer_key.encode(),
            make_resolver(cfg.dns),
            worker=worker or 0,
            workers=cfg.server.workers,
            on_result=telemetry.peer_datagram,
        )
        app[PEERS] = channel
        assert cluster.router.peers is not None
        telemetry.bind_peers(cluster.router.peers, clock.now)
    add_routes(app, gateway)
    return app


@dataclass(frozen=True, slots=True)
class _Cluster:
    """The per-backend components of one app, built together (:func:`_cluster`)."""

    models: BackendModels
    learner: LiveModels | None
    health: HealthTracker
    metrics: MetricsStore
    ledger: Ledger
    router: Router
    membership: Membership


def _cluster(cfg: Config, seed: int, clock: Clock, telemetry: Telemetry, replica: str) -> _Cluster:
    """Models, learner, health, scrapes, ledger, router and membership for ``cfg``'s backends;
    ``replica`` names this router among its peers (``peers``)."""
    specs = cfg.specs()
    names = [s.name for s in specs]
    # The backends' static latency models (profile → roofline prior → neutral default) are resolved
    # once, here: the policy, the learner and /admin all read this one copy.
    backend_models = BackendModels.from_specs(specs)

    def policy_for(backends: tuple[BackendSpec, ...], models: BackendModels) -> Policy:
        return build_policy(cfg.policy.type, cfg.policy.params, PolicyContext(backends, seed, models))

    learner: LiveModels | None = None
    if cfg.learning.enabled:
        saved = load_saved(cfg.learning.state_dir, specs) if cfg.learning.state_dir else {}
        learner = build_live_models(backend_models, cfg.learning, saved)
    health = HealthTracker(
        cfg.health, names, clock, on_eject=lambda i: telemetry.ejections.labels(health.names[i]).inc()
    )
    metrics = MetricsStore(len(specs), clock, cfg.scrape.stale_after_s)
    ledger = Ledger(names)
    router = Router(
        specs,
        policy_for(specs, backend_models),
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
        replicas=cfg.server.replicas * cfg.server.workers,
        peers=(
            PeerView(replica, names, cfg.peers.stale_after_s, cfg.peers.follow_s)
            if cfg.peers.enabled
            else None
        ),
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
    return _Cluster(backend_models, learner, health, metrics, ledger, router, membership)


def _warn_unknown_seqs(backends: Sequence[BackendSpec], max_num_seqs: FloatArray) -> None:
    """With the admission queue on: say which backends have no ``max_num_seqs`` (no configuration,
    profile or catalog prior), whose sequence limit the queue then learns from their engines' scrapes
    and can learn too low (docs/admission.md)."""
    unknown = [b.name for b, n in zip(backends, max_num_seqs.tolist(), strict=True) if not math.isfinite(n)]
    if unknown:
        log.warning(
            "admission queue: no max_num_seqs for %s; their sequence limits are learned from the "
            "engines' scrapes and long prompts can make them too low "
            "(hetroute_queue_sequence_limit; set max_num_seqs where you know it, docs/admission.md)",
            ", ".join(unknown),
        )


def _bind_telemetry(telemetry: Telemetry, c: _Cluster) -> None:
    """Per-backend gauges, computed on scrape, that follow the member set."""
    router, ledger = c.router, c.ledger
    telemetry.bind_backends(
        [b.name for b in router.backends],
        c.health.is_available,
        c.metrics.age_s,
        lambda i: int(ledger.requests_in_flight[i]),
    )
    if c.learner is not None:
        telemetry.bind_learner(c.learner)
    if router.prefix is not None:
        telemetry.bind_prefix(router.prefix)
    telemetry.bind_foreign(router.foreign_requests)

    def members_changed(_: int, __: BackendSpec) -> None:
        telemetry.set_members([(i, router.backends[i].name) for i in router.members()])

    c.membership.on_join.append(members_changed)
    c.membership.on_leave.append(members_changed)


def _forwarder(
    cfg: Config,
    c: _Cluster,
    telemetry: Telemetry,
    clock: Clock,
    seed: int,
    access_sink: LineSink | None,
    registry: CollectorRegistry,
) -> Forwarder:
    """The request path: predictor, token estimator, admission gate (when on) and upstream sessions."""
    pred_cfg = cfg.predictor or ComponentConfig(DEFAULT_PREDICTOR)
    t = cfg.timeouts
    adm = cfg.admission
    admission: AdmissionGate | None = None
    if adm.enabled:
        placer = Placer(c.router, adm.full, c.models)
        admission = AdmissionGate(adm, c.router, placer, clock, registry)
    return Forwarder(
        router=c.router,
        health=c.health,
        telemetry=telemetry,
        access_log=AccessLog(access_sink, enabled=cfg.server.access_log),
        estimator=TokenEstimator(cfg.tokens.initial_chars_per_token, cfg.tokens.learn_rate),
        predictor=build_predictor(pred_cfg.type, pred_cfg.params, seed),
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
        upstream=Upstream(t.connect_s),
        admission=admission,
    )


def _register(app: web.Application, c: _Cluster, forwarder: Forwarder, worker: int | None) -> None:
    """The app keys, the lifecycle hooks and the worker tag."""
    cfg = app[CONFIG]
    app[ROUTER] = c.router
    app[LEDGER] = c.ledger
    app[HEALTH] = c.health
    app[METRICS] = c.metrics
    app[MEMBERSHIP] = c.membership
    app[FORWARDER] = forwarder
    app[UPSTREAM] = forwarder.upstream
    if forwarder.admission is not None:
        app[ADMISSION] = forwarder.admission
        app.on_cleanup.append(close_admission)
    if c.learner is not None:
        app[LEARNER] = c.learner
        if cfg.learning.state_dir and not worker:
            app[SAVE_DIR] = cfg.learning.state_dir
    if worker is not None:
        app.on_response_prepare.append(_worker_header(worker))
    app.cleanup_ctx.append(held_records)
    app.cleanup_ctx.append(client_session)
    app.cleanup_ctx.append(background_tasks)


def _worker_header(worker: int) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    value = str(worker)

    async def tag(_: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = value

    return tag


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
