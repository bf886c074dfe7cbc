"""HTTP handlers of the gateway: thin adapters from aiohttp requests to the forwarder.

Owns the route table and the handlers for the client APIs (OpenAI ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``; TGI ``/generate``, ``/generate_stream``, ``/info``),
``/health``, ``/ready``, ``/live``, ``/metrics`` and ``/admin/backends``. Invariant: a request
that is malformed, too large, slow, badly encoded, for an unknown model or an unsupported path is
answered here in the API's own error shape and never reaches a backend: handlers raise
:class:`ApiError`, and the error middleware (:mod:`hetroute.proxy.local_errors`) answers, logs and counts it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict

import aiohttp
from aiohttp import web

from hetroute.backends.health import HealthTracker
from hetroute.backends.membership import Membership
from hetroute.backends.scrape import MetricsStore
from hetroute.learning.live import LiveModels
from hetroute.policies.backend_model import BackendModels, describe_models
from hetroute.proxy.admin_auth import bearer_token_matches
from hetroute.proxy.admin_members import MemberAdmin
from hetroute.proxy.api_errors import ApiError
from hetroute.proxy.encodings import body_error, check_content_encoding
from hetroute.proxy.forward import Forwarder
from hetroute.proxy.local_errors import RELAYED, defer_expect
from hetroute.proxy.protocols import (
    ParsedRequest,
    parse_chat,
    parse_completions,
    parse_generate,
    with_model,
)
from hetroute.routing.router import Router
from hetroute.telemetry import Telemetry

OPENAI_POST_PATHS = ("/v1/chat/completions", "/v1/completions")
TGI_POST_PATHS = ("/generate", "/generate_stream", "/")
GET_PATHS = ("/v1/models", "/info", "/health", "/ready", "/live", "/metrics", "/admin/backends")


class Gateway:
    """The handlers, bound to one app's components (no globals)."""

    def __init__(
        self,
        *,
        forwarder: Forwarder,
        router: Router,
        health: HealthTracker,
        metrics: MetricsStore,
        telemetry: Telemetry,
        max_body_bytes: int,
        admin_token: str | None,
        tgi_model: str | None,
        info_timeout_s: float,
        backend_models: BackendModels,
        learner: LiveModels | None = None,
        body_timeout_s: float = 60.0,
        membership: Membership | None = None,
        workers: int = 1,
        drain_timeout_s: float = 30.0,
    ) -> None:
        """``membership`` (None: the backend set is fixed) enables ``POST``/``DELETE /admin/backends``."""
        self.forwarder = forwarder
        self.router = router
        self.health = health
        self.metrics = metrics
        self.telemetry = telemetry
        self.max_body_bytes = max_body_bytes
        self.admin_token = admin_token
        self.tgi_model = tgi_model
        self.info_timeout_s = info_timeout_s
        self.backend_models = backend_models
        self.learner = learner
        self.body_timeout_s = body_timeout_s
        self.membership = membership
        self.members = (
            MemberAdmin(
                membership,
                forwarder.upstream,
                admin_token=admin_token,
                workers=workers,
                discovery_timeout_s=info_timeout_s,
                default_drain_timeout_s=drain_timeout_s,
            )
            if membership is not None
            else None
        )

    async def _body(self, request: web.Request) -> bytes:
        """The decoded body, read within ``body_timeout_s``; ApiError 408/413/415/400 otherwise."""
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            raise ApiError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}")
        check_content_encoding(request)
        try:
            if request.content.is_eof():  # the whole body came with the head: nothing to wait for, and
                return await request.read()  # no timer to arm (one costs µs per request under uvloop)
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes") from exc
        except web.RequestPayloadError as exc:
            raise body_error(exc, self.max_body_bytes) from exc
        except TimeoutError as exc:
            raise ApiError(
                408, f"the request body was not received within {self.body_timeout_s:g} s"
            ) from exc

    async def _handle(
        self, request: web.Request, parse: Callable[[bytes], ParsedRequest]
    ) -> web.StreamResponse:
        """Errors raised here are answered and accounted by the error middleware."""
        raw = await self._body(request)
        try:
            parsed = parse(raw)
        except RecursionError as exc:  # a structure nested too deeply for the re-encoder
            raise ApiError(400, "request body is nested too deeply") from exc
        if parsed.model is None and parsed.api == "openai":
            parsed = self._only_model(parsed)
        if parsed.model is not None:
            model = parsed.model
        elif self.tgi_model is not None:
            model = self.tgi_model
        else:
            raise ApiError(404, "no backend speaks the TGI API")
        request[RELAYED] = True  # from here on the forwarder logs and counts the request
        return await self.forwarder.relay(request, parsed, model)

    def _only_model(self, parsed: ParsedRequest) -> ParsedRequest:
        """An OpenAI request without ``model``: the one model served, as vLLM does when it serves one
        (its first); with several, the client must choose (400 listing them)."""
        served = self.router.models("openai")
        if not served:
            raise ApiError(503, "no backend is in the cluster right now")
        if len(served) != 1:
            listed = ", ".join(served)
            raise ApiError(
                400, f"`model` is required: this router serves several models ({listed})", param="model"
            )
        return with_model(parsed, served[0])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completions)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda raw: parse_generate(raw, stream=False))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda raw: parse_generate(raw, stream=True))

    async def tgi_compat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda raw: parse_generate(raw, stream=None))

    async def models(self, request: web.Request) -> web.Response:
        seen: dict[str, str] = {}
        for i, spec in enumerate(self.router.backends):
            if self.health.is_available(i):
                for m in spec.models:
                    seen.setdefault(m, spec.engine)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "hetroute"} for m in seen]
        return web.json_response({"object": "list", "data": data})

    async def info(self, request: web.Request) -> web.Response:
        """TGI ``/info`` of an available TGI backend serving the TGI model."""
        session = self.forwarder.upstream.session
        if self.tgi_model is None:
            raise ApiError(404, "no backend speaks the TGI API")
        for i in self.router.serving(self.tgi_model, "tgi"):
            if not self.health.is_available(i):
                continue
            spec = self.router.backends[i]
            try:
                timeout = aiohttp.ClientTimeout(total=self.info_timeout_s)
                async with session.get(spec.url + "/info", timeout=timeout) as resp:
                    if resp.status == 200:
                        return web.Response(
                            body=await resp.read(),
                            content_type="application/json",
                            headers={"x-hetroute-backend": spec.name},
                        )
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        raise ApiError(503, f"no healthy backend for model `{self.tgi_model}`")

    async def health_check(self, request: web.Request) -> web.Response:
        available = self.health.available_count()
        status = 200 if available else 503
        return web.json_response(
            {"status": "ok" if available else "no healthy backend", "available_backends": available},
            status=status,
        )

    async def ready_check(self, request: web.Request) -> web.Response:
        """Readiness (a Kubernetes readinessProbe, a load balancer's check): 200 once the backends are
        discovered (the app is built only after that) and at least one is available and has been
        heard from (a passed probe or a successful request); 503 with the counts otherwise."""
        discovered = len(self.router.members())
        healthy = self.health.confirmed_available_count()
        body: dict[str, object] = {
            "status": "ready" if healthy else "not ready",
            "discovered_backends": discovered,
            "healthy_backends": healthy,
        }
        if not healthy:
            body["reason"] = "no backend has passed a health check yet or all are unhealthy"
        return web.json_response(body, status=200 if healthy else 503)

    async def live_check(self, request: web.Request) -> web.Response:
        """Liveness: 200 whenever the event loop answers, whatever the backends' state (so that a
        liveness probe never restarts a router because its backends are down)."""
        return web.json_response({"status": "alive"})

    async def admin_backends(self, request: web.Request) -> web.Response:
        if self.admin_token is not None and not bearer_token_matches(
            request.headers.get("Authorization"), self.admin_token
        ):
            raise ApiError(401, "missing or wrong admin bearer token")
        router = self.router
        last = [self.metrics.last_seen(i) for i in range(len(router.backends))]
        sources = describe_models(self.backend_models, last)
        learner = self.learner
        foreign = router.foreign_requests()
        peer_totals = router.peers.totals(router.clock.now()) if router.peers is not None else None
        out = []
        for i, spec in enumerate(router.backends):
            state = self.membership.state(i) if self.membership is not None else "member"
            if state == "free":
                continue
            metrics = last[i]
            age = self.metrics.age_s(i)
            if spec.profile is not None:
                q = spec.profile.quality
                profile: dict[str, object] = {
                    "path": spec.profile_path,
                    "source": spec.profile.source,
                    "kv_capacity_tokens": spec.profile.kv_capacity_tokens,
                    "kv_capacity_source": spec.profile.kv_capacity_source,
                    "fit_quality": asdict(q) if q is not None else None,
                }
            else:
                profile = {
                    "path": None,
                    "note": f"no latency profile; policy {router.policy.name!r} uses: {sources[i]}",
                }
            out.append(
                {
                    "name": spec.name,
                    "state": state,
                    "url": spec.url,
                    "engine": spec.engine,
                    "models": list(spec.models),
                    "weight": spec.weight,
                    "labels": dict(spec.labels),
                    "gpu": spec.gpu,
                    "tp": spec.tp,
                    "max_model_len": spec.max_model_len,
                    "health": self.health.describe(i),
                    "ledger": router.ledger.backend_load(i),
                    "foreign_requests": round(float(foreign[i]), 2),
                    "peer_requests": None
                    if router.peers is None
                    else (0.0 if peer_totals is None else float(peer_totals[0][i])),
                    "engine_metrics": asdict(metrics) if metrics is not None else None,
                    "engine_metrics_age_s": None if age is None else round(age, 3),
                    "engine_metrics_error": self.metrics.errors[i],
                    "model_sources": sources[i],
                    "profile": profile,
                    "learned_model": learner.describe(i) if learner is not None else None,
                    "prefix_index": None
                    if router.prefix is None
                    else {
                        "chunks": router.prefix.index.chunks(i),
                        "trust": round(float(router.prefix.trust.trust[i]), 4),
                    },
                }
            )
        body = {"policy": router.policy.name, "in_flight": router.ledger.in_flight(), "backends": out}
        return web.Response(text=json.dumps(body, default=str), content_type="application/json")

    async def not_found(self, request: web.Request) -> web.Response:
        known = request.path in OPENAI_POST_PATHS + TGI_POST_PATHS + GET_PATHS
        if known:
            raise ApiError(405, f"method {request.method[:16]} is not allowed on {request.path}")
        raise ApiError(404, f"unsupported path {request.path[:200]}")


def add_routes(app: web.Application, gw: Gateway) -> None:
    expect = defer_expect
    app.router.add_post("/v1/chat/completions", gw.chat, expect_handler=expect)
    app.router.add_post("/v1/completions", gw.completions, expect_handler=expect)
    app.router.add_post("/generate", gw.generate, expect_handler=expect)
    app.router.add_post("/generate_stream", gw.generate_stream, expect_handler=expect)
    app.router.add_post("/", gw.tgi_compat, expect_handler=expect)
    app.router.add_get("/v1/models", gw.models, allow_head=False, expect_handler=expect)
    app.router.add_get("/info", gw.info, allow_head=False, expect_handler=expect)
    app.router.add_get("/health", gw.health_check, allow_head=False, expect_handler=expect)
    app.router.add_get("/ready", gw.ready_check, allow_head=False, expect_handler=expect)
    app.router.add_get("/live", gw.live_check, allow_head=False, expect_handler=expect)
    app.router.add_get("/metrics", gw.telemetry.handle_metrics, allow_head=False, expect_handler=expect)
    app.router.add_get("/admin/backends", gw.admin_backends, allow_head=False, expect_handler=expect)
    if gw.members is not None:
        app.router.add_post("/admin/backends", gw.members.add, expect_handler=expect)
        app.router.add_delete("/admin/backends/{name}", gw.members.remove, expect_handler=expect)
    app.router.add_route("*", "/{tail:.*}", gw.not_found, expect_handler=expect)
