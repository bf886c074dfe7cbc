"""One simulation run: the event loop over a fleet of engine models and the gateway's routers.

Owns :class:`Run` (the mutable state of one run and its loop), the event kinds and :class:`Slowdown`
(a fault). :func:`hetroute.simulation.simulator.run_simulation` builds the routers and the run;
:class:`hetroute.simulation.admission_run.AdmittedRun` is a run with the admission queue in front.
The engines are :class:`EngineModel` instances; the routing is whatever :class:`Router` (with its
policy, :class:`Ledger` and learner) the caller built, on a :class:`ManualClock` that the loop moves
to each event's time.

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
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetroute.clock import ManualClock
from hetroute.errors import ConfigError
from hetroute.learning.live import LiveModels
from hetroute.output_limits import output_cut, output_limit
from hetroute.prefix.hashing import ROUTER_CHUNK_TOKENS, segment_block_hashes
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.sim.cluster_file import Fleet
from hetroute.sim.engine_model import EngineModel, PromptTooLong, StepOutcome
from hetroute.sim.workload import SimRequest
from hetroute.types import EngineMetrics, OutputLengthPredictor, RequestFeatures

_STEP_END, _SCRAPE, _ARRIVAL, _REFIT = 0, 1, 2, 3  # also the priority at equal times


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
WAKE = 5
"""An admission queue's timer (admission_run.py): the one event kind a subclass schedules."""
_ADMIT = 6  # an arrival the client held back (``client_connections``) goes out now
_PEER = 7  # the replicas exchange their summaries (``peer_interval_s``)


@dataclass(frozen=True, slots=True)
class Slowdown:
    """A fault: from ``after_s`` (modelled seconds, the workload's clock) backend ``backend_index``
    runs every step ``factor`` times slower (another tenant on the GPU, throttling, a reconfigured
    engine). The emulator's ``--slowdown FACTOR --slowdown-after-s T`` is the same fault."""

    backend_index: int
    factor: float
    after_s: float


class Run:
    """The mutable state of one simulation; built and consumed by ``run_simulation``."""

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
        self.client_connections = 0
        """At most this many requests open at the client at once (0: no limit): an arrival beyond it
        waits in the client until an answer (or a refusal) frees a connection, as a benchmark client
        with a connection pool sends (``benchmarks/admission_gateway.py --client-connections``)."""
        self.open_requests = 0
        self.held: deque[int] = deque()
        self.peer_interval_s = 0.0
        """With several routers that hold a ``PeerView``: every this many seconds each whose summary is
        due publishes it and the others receive it at once (0: no exchange)."""
        self.peer_heartbeat_s = math.inf
        """A summary goes out after this long even without a dispatch or release."""

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
        limit = output_limit(req.max_tokens, self.router.context_tokens(model), req.input_tokens)
        predicted = self.predictor.predict(model, req.input_tokens, limit)
        return RequestFeatures(
            request_id=req.request_id,
            model=model,
            api="openai",
            input_tokens=req.input_tokens,
            max_tokens=req.max_tokens,
            predicted_output_tokens=int(predicted),
            stream=req.stream,
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
            self.open_requests -= 1
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
        workload = self.workload
        for ev in outcome.emitted:
            k = index_of[ev.request_id]
            self.generated[k] += ev.tokens
            streamed = workload[k].stream  # a non-streaming answer shows the gateway nothing before its end
            if streamed:
                self.dirty.add(k)
            if ev.first:
                if streamed:
                    ticket = self.tickets[k]
                    assert ticket is not None
                    self.router_of(k).first_token(ticket, now_s)
                self.ttft_s[k] = now_s - workload[k].arrival_s
        for rid in outcome.finished:
            self.open_requests -= 1
            k = index_of[rid]
            ticket = self.tickets[k]
            assert ticket is not None
            router = self.router_of(k)
            req = workload[k]
            if not req.stream:
                router.first_token(ticket, now_s)  # as the gateway marks a whole answer
            if router.learner is not None:
                router.complete(ticket, self.generated[k], streamed=req.stream)
            router.release(ticket)
            self.dirty.discard(k)
            self.e2e_s[k] = now_s - req.arrival_s
            self.last_finish_s[e] = now_s
            generated = self.generated[k]
            window = self.fleet.backends[e].max_model_len
            cut = output_cut(window, req.input_tokens, generated)
            self.predictor.observe(req.model or self.fleet.default_model, req.input_tokens, generated, cut)
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

    def on_peer(self, now_s: float) -> list[tuple[float, int, int]]:
        """Every replica whose summary is due (a dispatch or release since its last one, or the
        heartbeat) sends it to the others, as ``PeerChannel.run`` does; no transit time."""
        self._flush_generated()
        heartbeat = self.peer_heartbeat_s
        summaries = [router.publish() for router in self.routers if router.summary_due(heartbeat)]
        for router in self.routers:
            for summary in summaries:
                router.receive(summary)  # its own summary is ignored
        if self.arrivals_left > 0 or any(p is not None for p in self.pending):
            return [(now_s + self.peer_interval_s, _PEER, 0)]
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
        if self.peer_interval_s > 0 and len(self.routers) > 1 and self.workload:
            # The replicas were up before the traffic: their first summaries (heartbeats) are current.
            heapq.heappush(heap, (self.workload[0].arrival_s - self.peer_interval_s, _PEER, seq, 0))
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
                if self.client_connections and self.open_requests >= self.client_connections:
                    self.held.append(index)
                    new = []
                else:
                    self.open_requests += 1
                    new = self.on_arrival(index, now_s)
            elif kind == _ADMIT:
                new = self.on_arrival(index, now_s)
            elif kind == _SCRAPE:
                new = self.on_scrape(now_s)
            elif kind == _REFIT:
                new = self.on_refit(now_s)
            elif kind == WAKE:
                new = self.on_wake(now_s)
            elif kind == _PEER:
                new = self.on_peer(now_s)
            else:
                new = self.on_slowdown(index)
            for t, kd, idx in new:
                heapq.heappush(heap, (t, kd, seq, idx))
                seq += 1
            held = self.held
            while held and self.open_requests < self.client_connections:
                self.open_requests += 1
                heapq.heappush(heap, (now_s, _ADMIT, seq, held.popleft()))
                seq += 1
        return events
