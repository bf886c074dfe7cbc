"""Discrete-event simulation of a cluster of engines driving the REAL routing code.

Owns the event loop and the per-run accounting; the engines are :class:`EngineModel` instances, the
routing is the gateway's own :class:`Router`, policy, :class:`Ledger` and output-length predictor,
on a :class:`ManualClock` that the loop moves to each event's time.

Event loop (vidur-style, but with no process-global state): a ``heapq`` of
``(time_s, priority, seq, kind, index)`` tuples; each handler returns the new events it causes.
``seq`` is a per-run counter, so two runs in one process are independent and identical inputs give
identical outputs. At equal times step ends are handled before scrapes and arrivals, so a request
finishing at t frees its ledger entry before a request arriving at t is routed.

- **arrival** of request k: predict Õ (the predictor never sees the true length), build
  :class:`RequestFeatures`, ``router.route`` (the ledger records the dispatch), then
  ``engine.submit`` with the TRUE output length. An idle engine starts a step at once.
- **step end** of engine e: apply the step planned at its start: token events update the request's
  first-token time and generated count, finished requests are released (``router.release``, exactly
  once) and fed to ``predictor.observe``. A busy engine then plans its next step; each engine has at
  most one pending step end.
- **scrape** (every ``scrape_interval_s``, default the gateway's ``scrape.interval_s``, from the first
  arrival while work remains): refresh the cached :class:`EngineMetrics` of every engine, as the
  gateway's scraper does; with 0 the router sees live engine state at every decision.

Generated-token counts reach the ledger (``observe_generated``) lazily, just before each routing
decision, for the requests that changed since the last one: the ledger is read only by decisions,
so this is exactly equivalent to updating it per token, and much cheaper.

Throughput is (input + output tokens of completed requests) / makespan, where the makespan runs from
the first arrival to the last completion (method.md §8).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import predictors
from hetroute.clock import ManualClock
from hetroute.config import ScrapeConfig
from hetroute.errors import ConfigError
from hetroute.learning.build import build_live_models
from hetroute.learning.live import LiveModels
from hetroute.learning.settings import LearningConfig
from hetroute.policies import PolicyContext, build_policy
from hetroute.policies.backend_model import BackendModels
from hetroute.prefix.hashing import ROUTER_CHUNK_TOKENS, segment_block_hashes
from hetroute.prefix.settings import PrefixConfig
from hetroute.prefix.state import PrefixState
from hetroute.routing.foreign import DEFAULT_FOREIGN_MODE, ForeignMode
from hetroute.routing.ledger import Ledger, Ticket
from hetroute.routing.router import Router
from hetroute.sim.cluster_file import ClusterSpec, Fleet, build_fleet
from hetroute.sim.engine_model import EngineModel, PromptTooLong, StepOutcome
from hetroute.sim.workload import SimRequest
from hetroute.types import EngineMetrics, FloatArray, IntArray, OutputLengthPredictor, Policy, RequestFeatures

if TYPE_CHECKING:
    from hetroute.simulation.admission_run import SimAdmission

_STEP_END, _SCRAPE, _ARRIVAL, _REFIT = 0, 1, 2, 3  # also the priority at equal times

DEFAULT_PREFIX = PrefixConfig()

GATEWAY_SCRAPE_INTERVAL_S = ScrapeConfig().interval_s
"""The gateway's default ``scrape.interval_s``: by default the simulated router sees metrics as stale as
the real one does."""


@dataclass(frozen=True, slots=True)
class InstanceResult:
    """Per-instance outcome: ``completion_time_s`` is when its last request finished (0 if none)."""

    name: str
    gpu: str
    tp: int
    requests: int
    input_tokens: int
    output_tokens: int
    completion_time_s: float
    busy_s: float
    steps: int
    preemptions: int
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated run. Arrays are per request in workload order; NaN where not completed."""

    policy: str
    predictor: str
    num_requests: int
    completed: int
    rejected: int
    makespan_s: float
    input_tokens: int
    output_tokens: int
    instances: tuple[InstanceResult, ...]
    ttft_s: FloatArray
    e2e_s: FloatArray
    backend_index: IntArray
    events: int
    wall_s: float
    ledger_zero: bool
    extra: Mapping[str, float] = field(default_factory=dict)
    learned: LiveModels | None = None
    """The live models at the end of the run (``learning`` on), for inspection."""
    queue_wait_s: FloatArray | None = None
    """Per request: seconds in the admission queue until dispatch or shed (None without a queue)."""

    @property
    def throughput_tokens_per_s(self) -> float:
        """(input + output tokens) / makespan."""
        return (self.input_tokens + self.output_tokens) / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def percentile(self, which: str, q: float) -> float:
        """The q-th percentile (0..100) of ``ttft_s`` or ``e2e_s`` over completed requests (NaN if none)."""
        values = self.ttft_s if which == "ttft" else self.e2e_s
        done = values[~np.isnan(values)]
        return float(np.percentile(done, q)) if done.size else math.nan


def _metrics_of(engine: EngineModel, flavour: str, now_s: float) -> EngineMetrics:
    """What the gateway's scraper would publish for this engine (TGI exports no KV gauge)."""
    s = engine.stats()
    if flavour == "tgi":
        return EngineMetrics(
            scraped_at_s=now_s,
            num_requests_running=float(s.running),
            num_requests_waiting=float(s.waiting),
            kv_capacity_tokens=engine.kv_capacity_tokens,
            batch_current_max_tokens=float(s.batch_reserved_tokens),
        )
    return EngineMetrics(
        scraped_at_s=now_s,
        num_requests_running=float(s.running),
        num_requests_waiting=float(s.waiting),
        kv_usage_frac=s.kv_usage_frac,
        kv_capacity_tokens=engine.kv_capacity_tokens,
        block_size=engine.block_size,
        num_gpu_blocks=engine.num_gpu_blocks,
        num_preemptions_total=float(s.num_preemptions_total),
        prefix_cache_queries_total=float(s.prefix_cache_queries_total),
        prefix_cache_hits_total=float(s.prefix_cache_hits_total),
    )


_SLOWDOWN = 4
_WAKE = 5  # an admission queue's timer (admission_run.py)


@dataclass(frozen=True, slots=True)
class Slowdown:
    """A fault: from ``after_s`` (modelled seconds, the workload's clock) backend ``backend_index``
    runs every step ``factor`` times slower (another tenant on the GPU, throttling, a reconfigured
    engine). The emulator's ``--slowdown FACTOR --slowdown-after-s T`` is the same fault."""

    backend_index: int
    factor: float
    after_s: float


class _Run:
    """The mutable state of one simulation; built and consumed by :func:`run_simulation`."""

    def __init__(
        self,
        fleet: Fleet,
        workload: Sequence[SimRequest],
        router: Router,
        predictor: OutputLengthPredictor,
        clock: ManualClock,
        scrape_interval_s: float,
        learner: LiveModels | None = None,
        slowdowns: Sequence[Slowdown] = (),
        replicas: Sequence[Router] = (),
    ) -> None:
        """``replicas``: further routers (own ledger, policy, learner and prefix index) that take
        arrivals in turn with ``router``, as router replicas behind a round-robin Service do."""
        self.fleet = fleet
        self.learner = learner
        self.slowdowns = tuple(slowdowns)
        self.engines = [EngineModel(cfg) for cfg in fleet.configs]
        self.workload = workload
        self.router = router
        self.routers: tuple[Router, ...] = (router, *replicas)
        self.predictor = predictor
        self.clock = clock
        self.scrape_interval_s = scrape_interval_s
        n = len(workload)
        self.index_of = {r.request_id: k for k, r in enumerate(workload)}
        if len(self.index_of) != n:
            raise ConfigError("workload", "request ids must be unique")
        self.tickets: list[Ticket | None] = [None] * n
        self.generated = [0] * n
        self.ttft_s = np.full(n, math.nan)
        self.e2e_s = np.full(n, math.nan)
        self.backend_index = np.full(n, -1, dtype=np.int64)
        self.replica_of = np.zeros(n, dtype=np.int64)  # which of ``routers`` routed request k
        self.dirty: set[int] = set()
        self.pending: list[StepOutcome | None] = [None] * len(self.engines)  # planned StepOutcome per engine
        self.busy_s = [0.0] * len(self.engines)
        self.last_finish_s = [0.0] * len(self.engines)
        self.cached: list[EngineMetrics | None] = [None] * len(self.engines)
        self.rejected = 0
        self.arrivals_left = n

    def latest_metrics(self, i: int) -> EngineMetrics | None:
        if self.scrape_interval_s > 0:
            return self.cached[i]
        return _metrics_of(self.engines[i], self.fleet.flavours[i], self.clock.now())

    # ------------------------------------------------------------ handlers (each returns new events)

    def _start_step(self, e: int, now_s: float) -> list[tuple[float, int, int]]:
        engine = self.engines[e]
        outcome = engine.step(now_s)
        # A step that only preempted (no tokens) frees blocks: plan again at once. Bounded: each such step
        # moves at least one request from running to waiting.
        for _ in range(engine.config.max_num_seqs):
            if outcome.scheduled_tokens or not outcome.preempted or not engine.has_work():
                break
            outcome = engine.step(now_s)
        if outcome.scheduled_tokens == 0:
            self.pending[e] = None  # nothing schedulable: idle until the next arrival
            return []
        self.pending[e] = outcome
        self.busy_s[e] += outcome.duration_s
        return [(now_s + outcome.duration_s, _STEP_END, e)]

    def on_arrival(self, k: int, now_s: float) -> list[tuple[float, int, int]]:
        self.arrivals_left -= 1
        features = self.features_of(k)
        self._flush_generated()
        replica = k % len(self.routers)
        self.replica_of[k] = replica
        return self.submit(k, self.routers[replica].route(features), now_s)

    def router_of(self, k: int) -> Router:
        """The router (replica) that routed request k."""
        return self.routers[int(self.replica_of[k])]

    def features_of(self, k: int) -> RequestFeatures:
        """Request k as the router sees it: Õ from the predictor, which never sees the true length."""
        req = self.workload[k]
        model = req.model or self.fleet.default_model
        predicted = self.predictor.predict(model, req.input_tokens, req.max_tokens)
        return RequestFeatures(
            request_id=req.request_id,
            model=model,
            api="openai",
            input_tokens=req.input_tokens,
            max_tokens=req.max_tokens,
            predicted_output_tokens=int(predicted),
            stream=True,
            prefix_hashes=segment_block_hashes(req.segments, ROUTER_CHUNK_TOKENS)
            if req.segments and self.router.prefix is not None  # no index: nothing would read them
            else (),
            prefix_chunk_tokens=float(ROUTER_CHUNK_TOKENS),
            session=req.session,
        )

    def submit(
        self, k: int, ticket: Ticket, now_s: float, *, start: bool = True
    ) -> list[tuple[float, int, int]]:
        """Hand request k, dispatched as ``ticket``, to its engine (with its TRUE output length);
        ``start``: an idle engine starts a step at once (else the caller starts it)."""
        req = self.workload[k]
        e = ticket.backend_index
        self.tickets[k] = ticket
        self.backend_index[k] = e
        engine = self.engines[e]
        try:
            blocks = (
                segment_block_hashes(req.segments, engine.block_size)
                if req.segments and engine.config.enable_prefix_caching
                else ()
            )
            engine.submit(
                req.request_id,
                req.input_tokens,
                req.output_tokens,
                now_s,
                reserve_tokens=req.max_tokens,
                block_hashes=blocks,
            )
        except PromptTooLong:
            self.router_of(k).release(ticket)
            self.rejected += 1
            return []
        if start and self.pending[e] is None:
            return self._start_step(e, now_s)
        return []

    def on_wake(self, now_s: float) -> list[tuple[float, int, int]]:
        """A timer an admission queue asked for (admission_run.py); nothing here."""
        return []

    def refill(self, now_s: float) -> list[tuple[float, int, int]]:
        """Called after a step's completions are released, before the engine plans its next step
        (an admission queue dispatches here, so a freed slot is refilled in the same step)."""
        return []

    def on_step_end(self, e: int, now_s: float) -> list[tuple[float, int, int]]:
        outcome = self.pending[e]
        self.pending[e] = None
        assert outcome is not None
        index_of = self.index_of
        for ev in outcome.emitted:
            k = index_of[ev.request_id]
            self.generated[k] += ev.tokens
            self.dirty.add(k)
            if ev.first:
                ticket = self.tickets[k]
                assert ticket is not None
                self.router_of(k).ledger.first_token(ticket, now_s)
                self.ttft_s[k] = now_s - self.workload[k].arrival_s
        for rid in outcome.finished:
            k = index_of[rid]
            ticket = self.tickets[k]
            assert ticket is not None
            router = self.router_of(k)
            if router.learner is not None:
                router.complete(ticket, self.generated[k], streamed=True)
            router.release(ticket)
            self.dirty.discard(k)
            req = self.workload[k]
            self.e2e_s[k] = now_s - req.arrival_s
            self.last_finish_s[e] = now_s
            self.predictor.observe(req.model or self.fleet.default_model, req.input_tokens, self.generated[k])
        events = self.refill(now_s)
        if self.pending[e] is None and self.engines[e].has_work():
            events += self._start_step(e, now_s)
        return events

    def on_scrape(self, now_s: float) -> list[tuple[float, int, int]]:
        for i, engine in enumerate(self.engines):
            metrics = _metrics_of(engine, self.fleet.flavours[i], now_s)
            self.cached[i] = metrics
            for router in self.routers:
                router.scraped(i, metrics)
        if self.arrivals_left > 0 or any(p is not None for p in self.pending):
            return [(now_s + self.scrape_interval_s, _SCRAPE, 0)]
        return []

    def on_slowdown(self, e: int) -> list[tuple[float, int, int]]:
        """A fault: engine ``e`` runs every later step ``factor`` times slower (``Slowdown``)."""
        for slow in self.slowdowns:
            if slow.backend_index == e:
                self.engines[e].set_slowdown(slow.factor)
        return []

    def on_refit(self, now_s: float) -> list[tuple[float, int, int]]:
        """The gateway's learning loop: refit every ``refit_interval_s`` while work remains."""
        learner = self.learner
        assert learner is not None
        for router in self.routers:
            if router.learner is not None:
                router.learner.set_capacities(router.snapshot().kv_capacity_tokens)
                router.learner.refit(now_s)
        if self.arrivals_left > 0 or any(p is not None for p in self.pending):
            return [(now_s + learner.config.refit_interval_s, _REFIT, 0)]
        return []

    def admission_result(self) -> dict[str, Any]:
        """Extra :class:`SimResult` fields of an admission run (none here)."""
        return {}

    def _flush_generated(self) -> None:
        if not self.dirty:
            return
        for k in self.dirty:
            ticket = self.tickets[k]
            if ticket is not None:
                self.router_of(k).ledger.observe_generated(ticket, self.generated[k])
        self.dirty.clear()

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        heap: list[tuple[float, int, int, int]] = []
        seq = 0
        for k, req in enumerate(self.workload):
            heap.append((req.arrival_s, _ARRIVAL, seq, k))
            seq += 1
        heapq.heapify(heap)
        if self.scrape_interval_s > 0 and self.workload:
            heapq.heappush(heap, (self.workload[0].arrival_s, _SCRAPE, seq, 0))
            seq += 1
        if self.learner is not None and self.workload:
            first = self.workload[0].arrival_s + self.learner.config.refit_interval_s
            heapq.heappush(heap, (first, _REFIT, seq, 0))
            seq += 1
        for slow in self.slowdowns:
            heapq.heappush(heap, (slow.after_s, _SLOWDOWN, seq, slow.backend_index))
            seq += 1
        clock = self.clock
        events = 0
        while heap:
            now_s, kind, _, index = heapq.heappop(heap)
            clock.set(now_s)
            events += 1
            if kind == _STEP_END:
                new = self.on_step_end(index, now_s)
            elif kind == _ARRIVAL:
                new = self.on_arrival(index, now_s)
            elif kind == _SCRAPE:
                new = self.on_scrape(now_s)
            elif kind == _REFIT:
                new = self.on_refit(now_s)
            elif kind == _WAKE:
                new = self.on_wake(now_s)
            else:
                new = self.on_slowdown(index)
            for t, kd, idx in new:
                heapq.heappush(heap, (t, kd, seq, idx))
                seq += 1
        return events


def run_simulation(
    cluster: ClusterSpec | Fleet,
    workload: Sequence[SimRequest],
    policy_name: str | Policy,
    policy_params: Mapping[str, object] | None = None,
    *,
    predictor: str = predictors.DEFAULT_PREDICTOR,
    predictor_params: Mapping[str, object] | None = None,
    seed: int = 0,
    scrape_interval_s: float = GATEWAY_SCRAPE_INTERVAL_S,
    label: str | None = None,
    learning: LearningConfig | None = None,
    slowdowns: Sequence[Slowdown] = (),
    admission: SimAdmission | None = None,
    prefix: PrefixConfig | None = DEFAULT_PREFIX,
    replicas: int = 1,
    foreign: ForeignMode = DEFAULT_FOREIGN_MODE,
) -> SimResult:
    """Simulate ``workload`` (sorted by arrival) on ``cluster`` routed by ``policy_name``.

    ``cluster`` may be a :class:`ClusterSpec` (catalogs are loaded) or a prepared :class:`Fleet`
    (``build_fleet``; reuse it across runs to skip catalog and profile loading). ``learning`` turns on the
    gateway's live latency learning (same code; the refit runs every ``refit_interval_s`` of modelled
    time) and ``slowdowns`` injects slow-down faults. ``policy_name`` is a
    registry name (built with ``policy_params`` by ``build_policy``) or a ready :class:`Policy`
    object (``policy_params`` ignored; it must be fresh, policies keep private state). The policy and
    predictor get ``seed``. ``label`` names the run in the result (default: the policy's name).
    ``admission`` puts the gateway's admission queue in front of the router (admission_run.py).
    ``prefix`` is the router's prefix-cache locality and session affinity (on by default, as in the
    gateway; None turns the router's index off, the engines still cache prefixes).
    ``replicas`` runs that many routers, each with its own ledger, policy, latency learner and prefix
    index, taking arrivals in turn (request k goes to replica k mod ``replicas``); they share the
    engines' scraped metrics and the output-length predictor. ``foreign`` is how each router counts the
    requests the others sent (``hetroute.routing.foreign``).
    """
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas", f"must be an integer >= 1, got {replicas!r}")
    if replicas > 1 and (admission is not None or not isinstance(policy_name, str)):
        raise ConfigError(
            "replicas", "several replicas need a policy name (one fresh policy each) and no admission queue"
        )
    if scrape_interval_s < 0 or not math.isfinite(scrape_interval_s):
        raise ConfigError("scrape_interval_s", f"must be a finite number >= 0, got {scrape_interval_s}")
    fleet = cluster if isinstance(cluster, Fleet) else build_fleet(cluster)
    served = set(fleet.models)
    for req in workload:
        if req.model and req.model not in served:
            raise ConfigError(
                "workload", f"request {req.request_id} asks for {req.model!r}, not served by the cluster"
            )
    if any(b.arrival_s < a.arrival_s for a, b in zip(workload, workload[1:], strict=False)):
        raise ConfigError("workload", "requests must be sorted by arrival_s")
    clock = ManualClock(workload[0].arrival_s if workload else 0.0)
    models = BackendModels.from_specs(fleet.backends)
    for slow in slowdowns:
        if not 0 <= slow.backend_index < len(fleet.backends) or not slow.factor > 0:
            raise ConfigError("slowdowns", f"bad slow-down {slow}")
    pred = predictors.build_predictor(predictor, dict(predictor_params or {}), seed)
    holder: list[_Run] = []

    def replica(r: int) -> Router:
        """Router replica r: its own policy (seed + r), ledger, learner and prefix index."""
        if isinstance(policy_name, str):
            ctx = PolicyContext(fleet.backends, seed + r, models)
            policy = build_policy(policy_name, dict(policy_params or {}), ctx)
        else:
            policy = policy_name
        enabled = learning is not None and learning.enabled
        return Router(
            fleet.backends,
            policy,
            Ledger([b.name for b in fleet.backends]),
            clock,
            latest_metrics=lambda i: holder[0].latest_metrics(i),
            learner=build_live_models(models, learning) if learning is not None and enabled else None,
            prefix=PrefixState(len(fleet.backends), prefix)
            if prefix is not None and prefix.enabled
            else None,
            foreign=foreign,
        )

    router = replica(0)
    policy = router.policy
    learner = router.learner
    if admission is None:
        others = [replica(r) for r in range(1, replicas)]
        run = _Run(fleet, workload, router, pred, clock, scrape_interval_s, learner, slowdowns, others)
    else:
        run = admission.make_run(fleet, workload, router, pred, clock, scrape_interval_s, learner, slowdowns)
    holder.append(run)
    started = time.perf_counter()
    events = run.run()
    wall_s = time.perf_counter() - started
    return _result(run, label or policy.name, pred.name, events, wall_s)


def _result(run: _Run, label: str, predictor: str, events: int, wall_s: float) -> SimResult:
    workload = run.workload
    done = ~np.isnan(run.e2e_s)
    t0 = workload[0].arrival_s if workload else 0.0
    makespan = (
        float(np.nanmax(run.e2e_s + np.array([r.arrival_s for r in workload])) - t0) if done.any() else 0.0
    )
    inputs = np.array([r.input_tokens for r in workload], dtype=np.int64)
    outputs = np.array([r.output_tokens for r in workload], dtype=np.int64)
    instances = []
    for e, engine in enumerate(run.engines):
        mine = done & (run.backend_index == e)
        stats = engine.stats()
        spec = run.fleet.backends[e]
        instances.append(
            InstanceResult(
                name=spec.name,
                gpu=spec.gpu or "",
                tp=spec.tp or 1,
                requests=int(mine.sum()),
                input_tokens=int(inputs[mine].sum()),
                output_tokens=int(outputs[mine].sum()),
                completion_time_s=run.last_finish_s[e] - t0 if mine.any() else 0.0,
                busy_s=run.busy_s[e],
                steps=stats.steps_total,
                preemptions=stats.num_preemptions_total,
                kv_capacity_tokens=engine.kv_capacity_tokens,
            )
        )
    return SimResult(
        policy=label,
        predictor=predictor,
        num_requests=len(workload),
        completed=int(done.sum()),
        rejected=run.rejected,
        makespan_s=makespan,
        input_tokens=int(inputs[done].sum()),
        output_tokens=int(outputs[done].sum()),
        instances=tuple(instances),
        ttft_s=run.ttft_s,
        e2e_s=run.e2e_s,
        backend_index=run.backend_index,
        events=events,
        wall_s=wall_s,
        ledger_zero=all(router.ledger.is_zero() for router in run.routers),
        learned=run.learner,
        **_with_prefix_extra(run, run.admission_result()),
    )


def _with_prefix_extra(run: _Run, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (the admission queue's result fields) with the prefix figures merged into ``extra``."""
    return {**fields, "extra": {**fields.get("extra", {}), **_prefix_extra(run)}}


def _prefix_extra(run: _Run) -> dict[str, float]:
    """Prefix-cache figures of a run: the engines' hits and queries (tokens) and the router's index."""
    stats = [engine.stats() for engine in run.engines]
    out = {
        "prefix_cache_queries_tokens": float(sum(s.prefix_cache_queries_total for s in stats)),
        "prefix_cache_hits_tokens": float(sum(s.prefix_cache_hits_total for s in stats)),
    }
    states = [router.prefix for router in run.routers if router.prefix is not None]
    if states:
        out["prefix_expected_hit_ratio"] = sum(p.expected_hit_tokens_total for p in states) / max(
            sum(p.input_tokens_total for p in states), 1.0
        )
        out["prefix_index_bytes"] = float(sum(p.index.memory_bytes() for p in states))
        out["prefix_index_chunks"] = float(sum(p.index.total_chunks() for p in states))
    return out
