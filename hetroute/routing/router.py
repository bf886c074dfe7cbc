"""The router: the one per-request orchestrator of a routing decision.

``Router.route`` (1) finds the backends that serve the request's model and API,
(2) drops those that are unavailable or excluded (already tried), (3) builds an immutable
:class:`~hetroute.types.ClusterSnapshot`, (4) asks the policy, and (5) records the dispatch
in the ledger. It holds no per-request state of its own: the returned
:class:`~hetroute.routing.ledger.Ticket` must be released with :meth:`Router.release`
exactly once, in a ``finally``.

The same class serves the gateway (real clock, health and scraped metrics) and the
simulator (``ManualClock``, engine state as metrics), so the simulator predicts what the
gateway does.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence

import numpy as np

from hetroute.errors import NoBackendAvailable, UnknownModel
from hetroute.learning.live import LiveModels
from hetroute.learning.observation import Observation
from hetroute.prefix.state import PrefixState
from hetroute.routing.foreign import DEFAULT_FOREIGN_MODE, ForeignLoad, ForeignMode
from hetroute.routing.ledger import GENERATED_ROW, INPUT_ROW, Ledger, Ticket
from hetroute.routing.peer_mirror import OwnHistory
from hetroute.routing.peers import PeerSummary, PeerView
from hetroute.types import (
    Api,
    BackendSpec,
    BoolArray,
    Clock,
    ClusterSnapshot,
    EngineMetrics,
    FloatArray,
    IntArray,
    Policy,
    RequestFeatures,
    RoutingDecision,
    engine_speaks,
)

OUTBOX_MAX = 4096
"""Completions held for the next peer summary at most (the oldest are dropped): bounded even if no
summary is sent for a while."""

MIN_TOKEN_GAP_S = 1e-4
"""A stream whose tokens after the first arrived faster than this per token was delivered in one burst
(an engine or proxy buffering the stream): its time to first token is not the engine's, so the latency
learner takes only its end-to-end time."""

AvailabilityFn = Callable[[int], bool]
MetricsFn = Callable[[int], "EngineMetrics | None"]
DecisionObserver = Callable[[str, str, float], None]


def _always(_: int) -> bool:
    return True


def _no_metrics(_: int) -> EngineMetrics | None:
    return None


class Router:
    """Chooses a backend per request with a pluggable policy and records it in the ledger."""

    def __init__(
        self,
        backends: Sequence[BackendSpec],
        policy: Policy,
        ledger: Ledger,
        clock: Clock,
        *,
        is_available: AvailabilityFn | None = None,
        latest_metrics: MetricsFn | None = None,
        on_decision: DecisionObserver | None = None,
        timer: Callable[[], float] = time.perf_counter,
        learner: LiveModels | None = None,
        prefix: PrefixState | None = None,
        foreign: ForeignMode = DEFAULT_FOREIGN_MODE,
        available_all: Callable[[], tuple[bool, ...]] | None = None,
        latest_metrics_all: Callable[[], tuple[EngineMetrics | None, ...]] | None = None,
        replicas: int = 1,
        peers: PeerView | None = None,
    ) -> None:
        """``available_all`` / ``latest_metrics_all``, when given, must equal ``is_available`` /
        ``latest_metrics`` over every backend in one call (the gateway's health tracker and metrics
        store provide them: one call per decision instead of one per backend). ``peers``: the other
        router replicas' summaries (:mod:`hetroute.routing.peers`), when replicas exchange them."""
        if ledger.backend_names != tuple(b.name for b in backends):
            raise ValueError("the ledger's backends differ from the router's")
        self.backends: tuple[BackendSpec, ...] = tuple(backends)
        self.policy = policy
        self.ledger = ledger
        self.clock = clock
        self._is_available = is_available or _always
        self._latest_metrics = latest_metrics or _no_metrics
        self._available_all = available_all
        self._latest_metrics_all = latest_metrics_all
        self._on_decision = on_decision
        self._timer = timer
        self.learner = learner
        self.prefix = prefix
        self.retired: frozenset[int] = frozenset()
        """Slots whose backend left the cluster (draining, or free for the next backend added): never
        routed to, not listed (live backend changes, :mod:`hetroute.backends.membership`)."""
        self.foreign = ForeignLoad(len(self.backends), foreign, peers=max(replicas - 1, 0))
        self.peers = peers
        self._own_history = OwnHistory(peers.follow_s) if peers is not None and peers.follow_s > 0 else None
        """This router's ledger after its recent dispatches and releases, mirrored onto each peer since
        its summary (peer_mirror.py)."""
        self._outbox: deque[tuple[str, Observation]] = deque(maxlen=OUTBOX_MAX)
        """Observations of this router's completions since its last summary (with ``peers`` only)."""
        self._peer_seq = 0
        self._changes = 0  # dispatches + releases, for summary_due
        self._changes_published = 0
        self._published_at_s = -math.inf
        self._decide_started = 0.0  # timer reading at the start of the last decide()
        self.before_decide: Callable[[], None] | None = None
        """Called at the start of every :meth:`decide`, before the snapshot: the peer channel's ``poll``
        (take the summaries waiting in its socket and send this router's when one is due), so that the
        replicas exchange summaries while a burst keeps every event loop busy (peer_channel.py)."""
        self._backends_changed()

    def _backends_changed(self) -> None:
        """Derive the per-backend constants from ``backends`` and drop every cache built on them."""
        self._serving: dict[tuple[str, Api], tuple[int, ...]] = {}
        self._context: dict[str, int | None] = {}
        self._profile_caps: FloatArray = np.array(
            [
                float(b.profile.kv_capacity_tokens) if b.profile is not None else math.nan
                for b in self.backends
            ],
            dtype=np.float64,
        )
        self._config_caps: FloatArray = np.array(
            [
                float(b.kv_capacity_tokens) if b.kv_capacity_tokens is not None else math.nan
                for b in self.backends
            ],
            dtype=np.float64,
        )
        self._range = range(len(self.backends))
        # Read-only arrays shared by successive snapshots while their inputs are unchanged.
        self._caps_key: tuple[EngineMetrics | None, ...] | None = None
        self._caps: FloatArray = self._profile_caps
        self._available_key: tuple[bool, ...] | None = None
        self._available: BoolArray = np.zeros(0, dtype=np.bool_)
        self._cand_cache: tuple[tuple[int, ...], tuple[bool, ...], frozenset[int], IntArray] | None = None
        if self._own_history is not None:  # afresh, from the ledger as it stands
            self._own_history.clear()
            self._own_history.mark(self.clock.now(), *self.ledger.snapshot_arrays())

    def set_slot(self, index: int, spec: BackendSpec) -> None:
        """Put backend ``spec`` in slot ``index``: one past the last (the cluster grows) or a retired slot
        with nothing in flight. Resets the slot's ledger, foreign-load and prefix state; the caller
        (:class:`~hetroute.backends.membership.Membership`) resets health, metrics, models and policy."""
        if index != len(self.backends) and index not in self.retired:
            raise ValueError(f"slot {index} is in use by backend {self.backends[index].name!r}")
        self.ledger.set_slot(index, spec.name)  # raises while anything is still in flight there
        self.foreign.set_slot(index)
        if self.prefix is not None:
            self.prefix.set_slot(index)
        backends = list(self.backends)
        if index == len(backends):
            backends.append(spec)
        else:
            backends[index] = spec
        self.backends = tuple(backends)
        self.retired = self.retired - {index}
        self._backends_changed()
        if self.peers is not None:
            self.peers.set_backends([b.name for b in self.backends])

    def retire(self, index: int) -> None:
        """Stop routing to slot ``index`` at once; its in-flight requests run to their end."""
        self.retired = self.retired | {index}
        self._backends_changed()

    def members(self) -> tuple[int, ...]:
        """The slots of the backends in the cluster (not retired), in slot order."""
        return tuple(i for i in self._range if i not in self.retired)

    def serving(self, model: str, api: Api) -> tuple[int, ...]:
        """Indices of the backends that serve ``model`` through ``api`` (cached)."""
        key = (model, api)
        found = self._serving.get(key)
        if found is None:
            retired = self.retired
            found = tuple(i for i, b in enumerate(self.backends) if i not in retired and b.serves(model, api))
            self._serving[key] = found
        return found

    def context_tokens(self, model: str) -> int | None:
        """The context window (prompt and output tokens) a request for ``model`` gets: the largest
        ``max_model_len`` among the backends serving it, so that no backend's window is cut short;
        None when one of them does not say, or none serves it (cached until the backends change)."""
        if model in self._context:
            return self._context[model]
        retired = self.retired
        serving = (b for i, b in enumerate(self.backends) if i not in retired and model in b.models)
        windows = [b.max_model_len for b in serving]
        known = [w for w in windows if w is not None]
        found = max(known) if known and len(known) == len(windows) else None
        self._context[model] = found
        return found

    def models(self, api: Api | None = None) -> tuple[str, ...]:
        """Every model some backend serves (through ``api`` when given), in config order."""
        seen: dict[str, None] = {}
        for i, b in enumerate(self.backends):
            if i in self.retired:
                continue
            if api is None or engine_speaks(b.engine, api):
                for m in b.models:
                    seen.setdefault(m, None)
        return tuple(seen)

    def snapshot(self) -> ClusterSnapshot:
        """An immutable copy of the cluster state now (ledger, health, engine metrics)."""
        return self._snapshot()[0]

    def _snapshot(self, features: RequestFeatures | None = None) -> tuple[ClusterSnapshot, tuple[bool, ...]]:
        """The snapshot (with the prefix and session facts of ``features`` when given) and its
        availability as a tuple (cheaper to index than the array)."""
        backends = self._range
        if self._latest_metrics_all is not None:
            metrics = self._latest_metrics_all()
        else:
            latest = self._latest_metrics
            metrics = tuple([latest(i) for i in backends])
        prefix = self.prefix
        if metrics is not self._caps_key and metrics != self._caps_key:  # the same scrapes: no rebuild
            self._caps_key, self._caps = metrics, self._capacities(metrics)
            if prefix is not None:
                prefix.set_capacities(self._caps)
                prefix.scraped(metrics)
        if self._available_all is not None:
            available = self._available_all()
        else:
            is_available = self._is_available
            available = tuple([is_available(i) for i in backends])
        if available is not self._available_key and available != self._available_key:
            flags: BoolArray = np.array(available, dtype=np.bool_)
            flags.flags.writeable = False
            self._available_key, self._available = available, flags
        requests, floats = self.ledger.snapshot_arrays()
        now = self.clock.now()
        totals = self.peers.totals(now) if self.peers is not None else None
        if totals is not None:  # the other replicas' own summaries (peers.py) replace the estimate
            totals = self._mirrored(now, totals)
            requests, floats = _plus(requests, floats, totals)
        else:
            foreign = self.foreign.counts(metrics, requests)
            if foreign is not None:  # other routers' requests, from the engines' scrapes (foreign.py)
                requests, floats = self.foreign.added(foreign, requests, floats)
        learner = self.learner
        matched = None
        session_backend = -1
        if prefix is not None and features is not None:
            matched = prefix.matched_tokens(features, now)
            session_backend = prefix.session_backend(features, now)
        snap = ClusterSnapshot(
            now_s=now,
            backends=self.backends,
            metrics=metrics,
            requests_in_flight=requests,
            input_tokens_in_flight=floats[0],
            remaining_predicted_tokens=floats[1],
            generated_tokens_in_flight=floats[2],
            predicted_output_tokens_in_flight=floats[3],
            workload=floats[4],
            prefill_pending_tokens=floats[5],
            available=self._available,
            kv_capacity_tokens=self._caps,
            latency_params=learner.params if learner is not None else None,
            model_samples=learner.samples if learner is not None else None,
            prefix_matched_tokens=matched,
            prefix_trust=prefix.trust.trust if matched is not None and prefix is not None else None,
            session_backend=session_backend,
        )
        return snap, available

    def _mirrored(self, now: float, totals: tuple[FloatArray, FloatArray]) -> tuple[FloatArray, FloatArray]:
        """The peers' ``totals`` plus the change each is assumed to have made since its summary (this
        router's own over the same span, peer_mirror.py), clamped at 0; ``totals`` as they are when
        mirroring is off."""
        history = self._own_history
        if history is None or self.peers is None:
            return totals
        mirrored = history.mirrored(now, self.peers.received_at(now))
        if mirrored is None:
            return totals
        return np.maximum(totals[0] + mirrored[0], 0.0), np.maximum(totals[1] + mirrored[1], 0.0)

    def foreign_requests(self) -> FloatArray:
        """Requests per backend this router counts as sent by others, under the latest scrapes (none
        while a peer's summary is current: the summaries replace the estimate)."""
        if self.peers is not None and self.peers.totals(self.clock.now()) is not None:
            return np.zeros(len(self.backends), dtype=np.float64)  # the peers' summaries replace it
        metrics = tuple([self._latest_metrics(i) for i in self._range])
        counts = self.foreign.counts(metrics, self.ledger.requests_in_flight)
        return counts if counts is not None else np.zeros(len(self.backends), dtype=np.float64)

    def scraped(self, i: int, metrics: EngineMetrics) -> None:
        """Backend ``i``'s scrape ``metrics`` was just published: set the engine's request count
        against this router's own at this instant, and its peers' (:class:`ForeignLoad`)."""
        own = float(self.ledger.requests_in_flight[i])
        if self.peers is not None:
            totals = self.peers.totals(self.clock.now())
            if totals is not None:
                own += float(totals[0][i])
        self.foreign.scraped(i, metrics, own)

    def publish(self) -> PeerSummary:
        """This router's summary for its peers now: its ledger per backend and the observations of its
        completions since the last summary (which it hands over). Needs ``peers``."""
        peers = self.peers
        if peers is None:
            raise RuntimeError("publish needs a PeerView (replicas exchanging summaries)")
        now = self.clock.now()
        self._peer_seq += 1
        self._changes_published, self._published_at_s = self._changes, now
        requests, floats = self.ledger.snapshot_arrays()
        live = list(self.members())
        observations = tuple(self._outbox)
        self._outbox.clear()
        return PeerSummary(
            replica=peers.replica,
            seq=self._peer_seq,
            sent_at_s=now,
            backends=tuple(self.backends[i].name for i in live),
            requests=requests[live].astype(np.float64),
            rows=floats[:, live],
            observations=observations,
        )

    def receive(self, summary: PeerSummary) -> int:
        """A peer's ``summary`` arrived: hold its in-flight load and learn from its completions.
        Returns how many of its observations the learner took. Needs ``peers``."""
        peers = self.peers
        if peers is None:
            raise RuntimeError("receive needs a PeerView (replicas exchanging summaries)")
        observations = peers.receive(summary, self.clock.now())
        learner = self.learner
        if learner is None:
            return 0
        for obs in observations:
            learner.observe(obs)
        return len(observations)

    def _capacities(self, metrics: tuple[EngineMetrics | None, ...]) -> FloatArray:
        """KV capacity: the profile, then the engine's own report, then the config (types.py)."""
        caps = self._profile_caps.copy()
        for i, m in enumerate(metrics):
            if math.isnan(caps[i]):
                if m is not None and m.kv_capacity_tokens is not None:
                    caps[i] = float(m.kv_capacity_tokens)
                else:
                    caps[i] = self._config_caps[i]
        caps.flags.writeable = False
        return caps

    def route(self, features: RequestFeatures, exclude: Collection[int] = ()) -> Ticket:
        """Choose a backend for ``features`` and record the dispatch.

        Raises :class:`UnknownModel` when no backend serves the model through the API and
        :class:`NoBackendAvailable` when every serving backend is unavailable or excluded.
        """
        decision, snap = self.decide(features, exclude)
        return self.commit(features, decision, snap)

    def decide(
        self, features: RequestFeatures, exclude: Collection[int] = ()
    ) -> tuple[RoutingDecision, ClusterSnapshot]:
        """The policy's choice for ``features`` now and the snapshot it saw; nothing is recorded
        (the admission queue commits it only when the chosen backend is not full).

        Raises like :meth:`route`.
        """
        serving = self.serving(features.model, features.api)
        if not serving:
            raise UnknownModel(features.model)
        self._decide_started = self._timer()
        if self.before_decide is not None:
            self.before_decide()
        snap, available = self._snapshot(features)
        cand_set, candidates = self._candidates(serving, available, exclude)
        if not cand_set:
            raise NoBackendAvailable(features.model)
        policy = self.policy
        decision = policy.choose(features, snap, candidates)
        if decision.index not in cand_set:
            raise RuntimeError(
                f"policy {policy.name!r} chose backend index {decision.index}, not a candidate "
                f"{sorted(cand_set)}"
            )
        return decision, snap

    def _candidates(
        self, serving: tuple[int, ...], available: tuple[bool, ...], exclude: Collection[int]
    ) -> tuple[frozenset[int], IntArray]:
        """The available ``serving`` backends not in ``exclude``, as a set and a read-only array; reused
        while the serving set and availability are unchanged and nothing is excluded (the common case:
        a first attempt)."""
        if not exclude:
            cached = self._cand_cache
            if cached is not None and cached[0] is serving and cached[1] == available:
                return cached[2], cached[3]
        found = [i for i in serving if available[i] and i not in exclude]
        array: IntArray = np.array(found, dtype=np.int64)
        array.flags.writeable = False
        result = (frozenset(found), array)
        if not exclude:
            self._cand_cache = (serving, available, *result)
        return result

    def commit(self, features: RequestFeatures, decision: RoutingDecision, snap: ClusterSnapshot) -> Ticket:
        """Record ``decision`` (from :meth:`decide`, which saw ``snap``) as a dispatch in the ledger and
        the prefix index; the decision observer gets the time since that :meth:`decide` began."""
        now_s = snap.now_s
        prefill_tokens: int | None = None
        if self.prefix is not None:
            cached = self.prefix.dispatched(features, decision.index, snap.prefix_matched_tokens, now_s)
            prefill_tokens = features.input_tokens - round(cached)
        ticket = self.ledger.dispatch(
            request_id=features.request_id,
            backend_index=decision.index,
            input_tokens=features.input_tokens,
            predicted_output_tokens=features.predicted_output_tokens,
            workload_cost=decision.workload_cost,
            now_s=now_s,
            policy=self.policy.name,
            reason=decision.reason,
            prefill_tokens=prefill_tokens,
        )
        self.foreign.dispatched(
            decision.index, features.input_tokens, features.predicted_output_tokens, decision.workload_cost
        )
        self._changes += 1
        if self._own_history is not None:
            self._own_history.mark(now_s, *self.ledger.snapshot_arrays())
        if self._on_decision is not None:
            self._on_decision(self.policy.name, ticket.backend_name, self._timer() - self._decide_started)
        return ticket

    def first_token(self, ticket: Ticket, now_s: float) -> None:
        """The first token of ``ticket``'s answer arrived at ``now_s`` (idempotent; see the ledger). With
        peers, the load the ticket records for the learner includes theirs."""
        marked = ticket.first_token_at_s is None and not ticket.released
        self.ledger.first_token(ticket, now_s)
        if marked:
            requests, context = self._peer_load(ticket.backend_index, now_s)
            ticket.in_flight_at_first += requests
            ticket.context_at_first += context

    def _peer_load(self, i: int, now_s: float) -> tuple[float, float]:
        """The current peers' requests in flight on backend ``i`` and their context tokens (input +
        generated) there; (0, 0) without peers."""
        totals = self.peers.totals(now_s) if self.peers is not None else None
        if totals is None:
            return 0.0, 0.0
        return float(totals[0][i]), float(totals[1][INPUT_ROW, i] + totals[1][GENERATED_ROW, i])

    def observe_generated(self, ticket: Ticket, generated_tokens: int) -> None:
        """``ticket``'s answer has streamed ``generated_tokens`` tokens so far (cumulative)."""
        self.ledger.observe_generated(ticket, generated_tokens)

    def complete(
        self, ticket: Ticket, output_tokens: int, *, input_tokens: int | None = None, streamed: bool = True
    ) -> None:
        """Record a successful answer before its release: exact output count, and the latency learner.

        ``streamed`` says whether the first token was seen apart from the end (a non-streaming answer
        arrives whole, so its time to first token is unknown). ``input_tokens`` is the engine's own
        count when it reported one. A ticket already released is ignored.
        """
        if ticket.released:
            return
        ledger = self.ledger
        ledger.observe_generated(ticket, output_tokens)
        learner = self.learner
        if learner is None or output_tokens < 1:
            return
        now = self.clock.now()
        i = ticket.backend_index
        first = ticket.first_token_at_s
        ttft: float | None = None
        if streamed and first is not None:
            burst = output_tokens >= 2 and now - first < MIN_TOKEN_GAP_S * (output_tokens - 1)
            # A stream that came in one burst (buffered upstream) is learned from its e2e only.
            ttft = None if burst else first - ticket.dispatched_at_s
        metrics = self._latest_metrics(i)
        peer_requests, peer_context = self._peer_load(i, now)  # the engine's batch holds theirs too
        in_flight_end = float(ledger.requests_in_flight[i]) + peer_requests
        context_end = (
            float(ledger.input_tokens_in_flight[i] + ledger.generated_tokens_in_flight[i]) + peer_context
        )
        obs = Observation(
            backend_index=i,
            finished_at_s=now,
            input_tokens=input_tokens if input_tokens is not None else ticket.input_tokens,
            output_tokens=output_tokens,
            ttft_s=ttft,
            e2e_s=now - ticket.dispatched_at_s,
            pending_tokens_ahead=ticket.pending_tokens_ahead,
            in_flight_at_first=ticket.in_flight_at_first,
            context_at_first=ticket.context_at_first,
            in_flight_at_end=in_flight_end,
            context_at_end=context_end,
            engine_running=metrics.num_requests_running if metrics is not None else None,
            cached_tokens=float(ticket.input_tokens - ticket.prefill_tokens),
        )
        learner.observe(obs)
        if self.peers is not None:
            self._outbox.append((self.backends[i].name, obs))

    def release(self, ticket: Ticket) -> bool:
        """Release a ticket's accounting; effective exactly once."""
        now = self.clock.now()
        released = self.ledger.release(ticket, now)
        if released:
            self._changes += 1
            if self._own_history is not None:
                self._own_history.mark(now, *self.ledger.snapshot_arrays())
        return released

    def summary_due(self, heartbeat_s: float) -> bool:
        """Whether a peer summary should go out now: this router dispatched or released a request since
        its last summary, or ``heartbeat_s`` passed (the peers keep it current)."""
        return self._changes != self._changes_published or (
            self.clock.now() - self._published_at_s >= heartbeat_s
        )


def _plus(
    requests: IntArray, floats: FloatArray, totals: tuple[FloatArray, FloatArray]
) -> tuple[IntArray, FloatArray]:
    """The ledger's snapshot arrays with the peers' ``totals`` added (read-only copies)."""
    out_requests: IntArray = requests + np.rint(totals[0]).astype(requests.dtype)
    out_requests.flags.writeable = False
    out_floats: FloatArray = floats + totals[1]
    out_floats.flags.writeable = False
    return out_requests, out_floats
