"""Every ``hetroute_*`` Prometheus metric, on an injected ``CollectorRegistry`` (house style §15).

Owns the metric definitions and the ``GET /metrics`` exposition. Nothing is registered on
the process-global default registry, so each app (and each test) has its own metrics.
Label children used on the hot path are cached per label tuple so a request does a dict
lookup instead of ``labels()`` validation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from hetroute.deferred import run_soon
from hetroute.learning.live import LiveModels
from hetroute.prefix.state import PrefixState
from hetroute.routing.peers import PeerView
from hetroute.types import FloatArray

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_DECISION_BUCKETS_S = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)
TELEMETRY_BATCH = 64
"""Finished requests (and decisions) held before they are applied to the metrics together."""


class RequestOutcome(NamedTuple):
    """What the metrics record of a finished client request (``Telemetry.observe_request``)."""

    backend: str
    model: str
    api: str
    status: int
    policy: str
    duration_s: float
    ttft_s: float | None
    itl_s: float | None
    prompt_tokens: int
    completion_tokens: int


class _FlushFirst:
    """A collector without metrics, registered before all others: collecting the registry (which goes
    through its collectors in registration order) first applies what :class:`Telemetry` holds."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def collect(self) -> list[Metric]:
        self._flush()
        return []

    def describe(self) -> list[Metric]:
        return []


class Telemetry:
    """The app's metrics. ``registry`` is owned by the caller (``build_app``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # First in the registry: any collection (``/metrics``, a test's) applies the held records first.
        registry.register(_FlushFirst(self.flush))
        self._held_requests: list[RequestOutcome] = []
        self._held_decisions: list[tuple[str, float]] = []
        r = registry
        self.requests = Counter(
            "hetroute_requests",
            "Finished client requests.",
            ["backend", "model", "api", "status", "policy"],
            registry=r,
        )
        self.in_flight = Gauge(
            "hetroute_requests_in_flight",
            "Dispatched and not yet released requests (the ledger).",
            ["backend"],
            registry=r,
        )
        self.retries = Counter(
            "hetroute_retries",
            "Fail-overs to another backend before the first byte.",
            ["backend", "reason"],
            registry=r,
        )
        self.ejections = Counter("hetroute_ejections", "Outlier ejections.", ["backend"], registry=r)
        self.available = Gauge(
            "hetroute_backend_available", "1 when healthy and not ejected.", ["backend"], registry=r
        )
        self.metrics_age = Gauge(
            "hetroute_backend_metrics_age_seconds",
            "Age of the latest engine scrape (-1: none).",
            ["backend"],
            registry=r,
        )
        self.ttft = Histogram(
            "hetroute_ttft_seconds", "Router-side time to the first byte of a stream.", ["backend", "model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "hetroute_inter_token_latency_seconds", "Mean gap between stream events, per request.",
            ["backend"], buckets=_ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "hetroute_request_duration_seconds", "End-to-end duration at the router.", ["backend", "api"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.decision = Histogram(
            "hetroute_routing_decision_seconds", "Time spent in Router.route per policy.", ["policy"],
            buckets=_DECISION_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "hetroute_tokens",
            "Prompt and completion tokens (usage, or estimate).",
            ["backend", "kind"],
            registry=r,
        )
        self.client_closed = Counter(
            "hetroute_client_connections_closed",
            "Client connections the gateway closed or refused (idle, header_timeout, body_timeout, "
            "too_many_connections).",
            ["reason"],
            registry=r,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._members: tuple[tuple[int, str], ...] = ()
        self._backend_gauges: list[tuple[Gauge, Callable[[int], float]]] = []

    def bind_backends(
        self,
        names: Sequence[str],
        available: Callable[[int], bool],
        age_s: Callable[[int], float | None],
        in_flight: Callable[[int], int],
    ) -> None:
        """Export per-backend gauges computed on scrape (no bookkeeping on the hot path), for the
        backends ``names`` (slot = position) until :meth:`set_members` changes them."""
        self._members = tuple(enumerate(names))

        def _age(i: int) -> float:
            age = age_s(i)
            return -1.0 if age is None else age

        self._per_backend(self.available, lambda i: float(available(i)))
        self._per_backend(self.in_flight, lambda i: float(in_flight(i)))
        self._per_backend(self.metrics_age, _age)

    def _per_backend(self, gauge: Gauge, value: Callable[[int], float]) -> None:
        """Export ``value(slot)`` as ``gauge{backend=name}`` for every member, now and after changes."""
        self._backend_gauges.append((gauge, value))
        for i, name in self._members:
            gauge.labels(name).set_function(partial(value, i))

    def set_members(self, members: Sequence[tuple[int, str]]) -> None:
        """The cluster's backends changed (live backend changes): per-backend gauges now export
        ``(slot, name)`` of ``members``; a backend that left loses its series."""
        old = {name for _, name in self._members}
        self._members = tuple(members)
        for gauge, value in self._backend_gauges:
            for name in old:
                gauge.remove(name)
            for i, name in self._members:
                gauge.labels(name).set_function(partial(value, i))

    def bind_learner(self, learner: LiveModels) -> None:
        """Export the live models' quality per backend, computed on scrape:
        ``hetroute_model_e2e_error_ratio`` (EWMA of |predicted / observed e2e − 1| over requests the
        model had not seen; NaN before the first), ``hetroute_model_samples`` (observations since the
        last drift) and ``hetroute_model_drifts`` (drifts detected)."""
        r = self.registry
        error = Gauge(
            "hetroute_model_e2e_error_ratio",
            "Live latency model: EWMA of |predicted/observed e2e - 1| on requests not yet fitted.",
            ["backend"],
            registry=r,
        )
        samples = Gauge(
            "hetroute_model_samples",
            "Live latency model: observations since the last drift.",
            ["backend"],
            registry=r,
        )
        drifts = Gauge(
            "hetroute_model_drifts", "Live latency model: drifts detected.", ["backend"], registry=r
        )
        self._per_backend(error, learner.e2e_error)
        self._per_backend(samples, lambda i: float(learner.samples[i]))
        self._per_backend(drifts, lambda i: float(learner.drifts(i)))

    def bind_queue_limits(self, sequence_limit: Callable[[int], float]) -> None:
        """Export ``hetroute_queue_sequence_limit`` per backend, computed on scrape: the sequence limit
        of the admission queue's fullness test (its ``max_num_seqs`` where known, else learned from the
        engine's scrapes; NaN while neither; before ``seqs_high_water_frac`` and a class's
        ``fill_frac``; docs/admission.md)."""
        gauge = Gauge(
            "hetroute_queue_sequence_limit",
            "Admission queue: a backend's sequence limit (max_num_seqs, else learned from scrapes).",
            ["backend"],
            registry=self.registry,
        )
        self._per_backend(gauge, sequence_limit)

    def bind_foreign(self, foreign_requests: Callable[[], FloatArray]) -> None:
        """Export ``hetroute_foreign_requests`` per backend, computed on scrape: the requests the router
        counts there on behalf of others (other replicas, direct clients; ``scrape.foreign_load``)."""
        gauge = Gauge(
            "hetroute_foreign_requests",
            "Requests counted on the backend on behalf of other routers or clients (from engine scrapes).",
            ["backend"],
            registry=self.registry,
        )
        self._per_backend(gauge, lambda i: float(foreign_requests()[i]))

    def bind_prefix(self, prefix: PrefixState) -> None:
        """Export the prefix index, computed on scrape: ``hetroute_prefix_index_chunks`` (chunks assumed
        cached, per backend), ``hetroute_prefix_trust`` (the hit-counter correction, per backend),
        ``hetroute_prefix_index_bytes`` (approximate memory) and ``hetroute_prefix_expected_hit_ratio``
        (Σ cached tokens expected at dispatch / Σ prompt tokens dispatched)."""
        r = self.registry
        chunks = Gauge(
            "hetroute_prefix_index_chunks", "Prefix index: chunks assumed cached.", ["backend"], registry=r
        )
        trust = Gauge(
            "hetroute_prefix_trust",
            "Prefix index: engine hits / router-predicted hits (EWMA, 0.05..1).",
            ["backend"],
            registry=r,
        )
        self._per_backend(chunks, lambda i: float(prefix.index.chunks(i)))
        self._per_backend(trust, lambda i: float(prefix.trust.trust[i]))
        Gauge(
            "hetroute_prefix_index_bytes", "Prefix index: approximate memory in bytes.", registry=r
        ).set_function(lambda: float(prefix.index.memory_bytes()))
        Gauge(
            "hetroute_prefix_expected_hit_ratio",
            "Prefix index: cached prompt tokens expected at dispatch / prompt tokens dispatched.",
            registry=r,
        ).set_function(lambda: prefix.expected_hit_tokens_total / max(prefix.input_tokens_total, 1.0))

    def bind_peers(self, peers: PeerView, now: Callable[[], float]) -> None:
        """Export the replica exchange, computed on scrape: ``hetroute_peer_replicas`` (other replicas
        whose summary is current) and ``hetroute_peer_requests`` per backend (their requests in flight
        there); :meth:`peer_datagram` counts ``hetroute_peer_datagrams_total`` by result."""
        r = self.registry
        self._peer_datagrams = Counter(
            "hetroute_peer_datagrams",
            "Peer summaries received (accepted, unauthenticated, malformed) and sends that failed.",
            ["result"],
            registry=r,
        )
        Gauge(
            "hetroute_peer_replicas", "Other router replicas whose summary is current.", registry=r
        ).set_function(lambda: float(peers.peers(now())))
        gauge = Gauge(
            "hetroute_peer_requests",
            "Requests the other router replicas have in flight on the backend (their summaries).",
            ["backend"],
            registry=r,
        )

        def requests(i: int) -> float:
            totals = peers.totals(now())
            return 0.0 if totals is None else float(totals[0][i])

        self._per_backend(gauge, requests)

    def peer_datagram(self, result: str) -> None:
        """One peer datagram's outcome (``bind_peers`` first)."""
        self._child(self._peer_datagrams, (result,)).inc()

    def on_decision(self, policy: str, backend: str, elapsed_s: float) -> None:
        """One routing decision took ``elapsed_s`` (held, like :meth:`observe_request`)."""
        held = self._held_decisions
        held.append((policy, elapsed_s))
        if len(held) == TELEMETRY_BATCH:  # once per batch, after the current event-loop step
            run_soon(self.flush)

    def retry(self, backend: str, reason: str) -> None:
        self._child(self.retries, (backend, reason)).inc()

    def _child(self, metric: Counter | Histogram, labels: tuple[str, ...]) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_request(self, outcome: RequestOutcome) -> None:
        """A finished client request. Held and applied to the metrics in order, in batches: once
        ``TELEMETRY_BATCH`` are held (after the current event-loop step,
        :func:`~hetroute.deferred.run_soon`), before every exposition (so ``/metrics`` is always exact)
        and whenever :meth:`flush` is called."""
        held = self._held_requests
        held.append(outcome)
        if len(held) == TELEMETRY_BATCH:  # once per batch, after the current event-loop step
            run_soon(self.flush)

    def flush(self) -> None:
        """Apply the held requests and decisions to the metrics.

        A batch is applied per label set: each counter child is incremented once by the batch's
        total (exact: the increments are integers), and each histogram child observes the batch's
        values in the order they were held, so every child ends exactly as if they were applied
        one at a time."""
        if self._held_requests:
            held, self._held_requests = self._held_requests, []
            self._apply_requests(held)
        if self._held_decisions:
            decisions, self._held_decisions = self._held_decisions, []
            by_policy: dict[tuple[str, ...], list[float]] = {}
            for policy, elapsed_s in decisions:
                by_policy.setdefault((policy,), []).append(elapsed_s)
            self._observe_all(self.decision, by_policy)

    def _apply_requests(self, held: list[RequestOutcome]) -> None:
        requests: dict[tuple[str, ...], int] = {}
        tokens: dict[tuple[str, ...], int] = {}
        durations: dict[tuple[str, ...], list[float]] = {}
        ttfts: dict[tuple[str, ...], list[float]] = {}
        itls: dict[tuple[str, ...], list[float]] = {}
        key: tuple[str, ...]
        for o in held:
            backend = o.backend
            key = (backend, o.model, o.api, str(o.status), o.policy)
            requests[key] = requests.get(key, 0) + 1
            durations.setdefault((backend, o.api), []).append(o.duration_s)
            if o.ttft_s is not None:
                ttfts.setdefault((backend, o.model), []).append(o.ttft_s)
            if o.itl_s is not None:
                itls.setdefault((backend,), []).append(o.itl_s)
            if o.prompt_tokens:
                key = (backend, "prompt")
                tokens[key] = tokens.get(key, 0) + o.prompt_tokens
            if o.completion_tokens:
                key = (backend, "completion")
                tokens[key] = tokens.get(key, 0) + o.completion_tokens
        child = self._child
        for key, count in requests.items():
            child(self.requests, key).inc(count)
        self._observe_all(self.duration, durations)
        self._observe_all(self.ttft, ttfts)
        self._observe_all(self.itl, itls)
        for key, count in tokens.items():
            child(self.tokens, key).inc(count)

    def _observe_all(self, metric: Histogram, values: dict[tuple[str, ...], list[float]]) -> None:
        for labels, observed in values.items():
            observe = self._child(metric, labels).observe
            for value in observed:
                observe(value)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
