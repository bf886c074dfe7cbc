"""When is a backend "full", and late binding: place a request only on a backend that is not.

Owns the "full" test of the admission queue (docs/admission.md). A backend ``s`` is full for a
request r (input ``I``, predicted output ``Õ``) when it has something in flight and any of:

- **KV**: ``kv_s + I + Õ > kv_high_water_frac · cap_s``, where ``kv_s`` is the ledger's KV
  estimate of its in-flight requests (Σ I + generated + remaining Õ; observed tokens replace
  predicted ones as streams run) and ``cap_s`` the cost model's KV capacity (profile → engine
  ``vllm:cache_config_info`` → config → roofline prior → median of the others; see
  ``hetroute.policies.backend_model``). At the default 1.0 a backend takes a request only while
  every in-flight request can still grow to its predicted length without preemption: the
  engine's batch is kept just full and its own waiting queue near empty;
- **sequences**: in-flight requests ``>= seqs_high_water_frac · max_num_seqs_s`` (when known);
- **engine queue**: the last scrape reports more waiting requests than ``engine_waiting_max``
  (by default 0, and only on backends whose ``max_num_seqs`` is unknown) and the in-flight count
  now still exceeds the engine's running count at that scrape by more than that
  (:func:`_engine_queued`).

A backend with nothing in flight is never full, so a request larger than any backend's
capacity is still dispatched (the engine then rejects or queues it, as without the queue).
:meth:`Placer.place` asks the routing policy for its choice at dispatch time (late binding)
and commits it only when that backend is neither full nor, under a backlog, too slow for the
request (the tail test, in its docstring).
"""

from __future__ import annotations

import math

import numpy as np

from hetroute.admission.arrivals import ArrivalRate
from hetroute.admission.config import ClassConfig, FullConfig
from hetroute.policies.backend_model import BackendModels
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.types import BoolArray, ClusterSnapshot, EngineMetrics, FloatArray, IntArray, RequestFeatures


def full_mask(
    config: FullConfig,
    models: BackendModels,
    snapshot: ClusterSnapshot,
    idx: IntArray,
    features: RequestFeatures,
    fill_frac: float = 1.0,
    seqs_limit: FloatArray | None = None,
) -> BoolArray:
    """For each backend in ``idx``: True when it is full for ``features`` (module docstring), with
    every high-water mark scaled by ``fill_frac`` (the request's class share). ``seqs_limit``
    (aligned with ``idx``) replaces the models' ``max_num_seqs`` (:class:`ObservedSeqs`)."""
    busy = snapshot.requests_in_flight[idx] > 0
    out_frac = config.kv_output_frac
    need = features.input_tokens + out_frac * features.predicted_output_tokens
    held = (
        snapshot.input_tokens_in_flight[idx]
        + snapshot.generated_tokens_in_flight[idx]
        + out_frac * snapshot.remaining_predicted_tokens[idx]
    )
    cap = models.capacity_tokens(snapshot, idx)
    kv = held + need > fill_frac * config.kv_high_water_frac * cap
    max_seqs = models.max_num_seqs[idx] if seqs_limit is None else seqs_limit
    seqs = snapshot.requests_in_flight[idx] >= fill_frac * config.seqs_high_water_frac * max_seqs
    full: BoolArray = kv | seqs
    if config.max_drain_s is not None:
        full = full | (snapshot.workload[idx] >= fill_frac * config.max_drain_s)
    # Engine queue: on every backend with an explicit limit; by default (None) with limit 0 on the
    # backends whose sequence limit is unknown (no config, profile or prior, nothing observed yet),
    # where the sequence test cannot see that the engine is queueing.
    if config.engine_waiting_max is not None:
        limit, where = config.engine_waiting_max, np.ones(idx.size, dtype=np.bool_)
    else:
        limit, where = 0, ~np.isfinite(max_seqs)
    if where.any():
        in_flight = snapshot.requests_in_flight[idx].tolist()
        waiting = np.array(
            [
                _engine_queued(snapshot.metrics[i], n, limit)
                for i, n in zip(idx.tolist(), in_flight, strict=True)
            ],
            dtype=np.bool_,
        )
        full = full | (waiting & where)
    out: BoolArray = busy & full
    return out


KV_BOUND_FRAC = 0.9
"""KV usage at or above which an engine's waiting requests are put down to its KV cache, not to
its sequence limit (vLLM admits while its free blocks allow, so a cache-bound queue shows ~90-100 %)."""


def _engine_queued(metrics: EngineMetrics | None, in_flight: float, limit: int) -> bool:
    """The engine-queue test of one backend: its last scrape reported more than ``limit`` waiting
    requests, and the router's in-flight count now still exceeds what the engine was running then
    by more than ``limit``. Requests that finished since the scrape let the engine start waiting
    ones, so the backend counts as full again only while the estimated queue
    ``in_flight(now) − running(t_scrape)`` is beyond the limit, not for a whole scrape interval
    (which left the batch draining until the next scrape). Without a running count: the scrape
    alone."""
    if metrics is None or metrics.num_requests_waiting is None or metrics.num_requests_waiting <= limit:
        return False
    running = metrics.num_requests_running
    return running is None or in_flight - running > limit


ALIKE_FRAC = 0.1
"""Backends whose margin-priced latency is within this fraction of the best one's are alike for the
tail test: it keeps a request off a backend clearly slower, and leaves the choice among alike
backends (a few prompt tokens queued more or less) to the policy."""

LIMIT_GROWTH = 0.125
"""How much an observed sequence limit grows when the engine shows it could run more (1/8)."""


class ObservedSeqs:
    """Each backend's sequence limit as its engine shows it, for backends whose ``max_num_seqs`` no
    config, profile or prior gives.

    An engine that reports waiting requests could not start them. If its KV cache was not the bound
    (usage below :data:`KV_BOUND_FRAC`, or not reported) and two scrapes in a row show the same
    running count R with requests waiting, R is its sequence limit (``max_num_seqs``), and the limit
    used is R + 1. One scrape is not enough: right after a burst of dispatches an engine shows
    requests waiting that it starts at its next steps (vLLM admits new prompts up to a per-step token
    budget), and a limit learned from that moment held a backend at 110 of its 256 sequences for a
    whole run. When the KV cache was the bound, the KV test is the one that applies and the scrape
    teaches nothing (a limit learned then would lock the backend at the batch a few long prompts
    allowed). A limit grows by :data:`LIMIT_GROWTH` of itself (at least 1) whenever two scrapes in a
    row show the engine running at least R with nothing waiting: it ran all the router allowed and
    could have run more, so the router lets more through until the engine queues again (dropping
    the limit at once instead flooded the slow backends of the mixed fleet: 91.1 % of the capacity
    bound at rate ∞ with nothing known, against 97.4 % growing it; simulator, 20,000 requests).
    Keyed by backend name and URL (a backend replaced at the same name starts afresh); a scrape is
    read once (by its ``scraped_at_s``)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], float] = {}
        self._read_at: dict[tuple[str, str], float] = {}
        self._last: dict[tuple[str, str], tuple[bool, float]] = {}
        """The previous scrape read per backend: (requests waiting, running count); absent when it
        taught nothing (KV-bound, or neither queued nor at the limit)."""

    def limits(
        self, router: Router, models: BackendModels, snapshot: ClusterSnapshot, idx: IntArray
    ) -> FloatArray:
        """Per backend of ``idx``: the static ``max_num_seqs`` where known, else the observed limit
        (∞ while no two scrapes in a row have shown the same queue)."""
        static = models.max_num_seqs[idx]
        if np.isfinite(static).all():  # every limit configured: nothing to observe (the usual case)
            return static
        out: FloatArray = static.copy()
        for k, i in enumerate(idx.tolist()):
            if np.isfinite(static[k]):
                continue
            spec = router.backends[i]
            name = (spec.name, spec.url)
            m = snapshot.metrics[i]
            if m is not None and self._read_at.get(name) != m.scraped_at_s:
                self._read_at[name] = m.scraped_at_s
                self._read(name, m)
            seen = self._seen.get(name)
            out[k] = math.inf if seen is None else seen + 1.0
        return out

    def _read(self, name: tuple[str, str], m: EngineMetrics) -> None:
        """Update backend ``name``'s limit from one new scrape (see the class docstring)."""
        running, waiting = m.num_requests_running, m.num_requests_waiting
        kv_bound = m.kv_usage_frac is not None and m.kv_usage_frac >= KV_BOUND_FRAC
        last = self._last.pop(name, None)
        seen = self._seen.get(name)
        if running and waiting and not kv_bound:
            if last == (True, running):
                self._seen[name] = running
            self._last[name] = (True, running)
        elif running and not waiting and seen is not None and running >= seen:
            if last is not None and not last[0]:
                self._seen[name] = seen + max(1.0, math.ceil(seen * LIMIT_GROWTH))
            else:
                self._last[name] = (False, running)

    def learned(self, name: str, url: str) -> float | None:
        """The limit used for backend (``name``, ``url``) as of the scrapes read so far (R + 1), or None
        while none is learned. Read-only: it reads no scrape."""
        seen = self._seen.get((name, url))
        return None if seen is None else seen + 1.0


class Placer:
    """Routes a request through ``router`` restricted to backends that are not full."""

    def __init__(self, router: Router, config: FullConfig, models: BackendModels | None = None) -> None:
        self.router = router
        self.config = config
        self.models = models if models is not None else BackendModels.from_specs(router.backends)
        self.observed_seqs = ObservedSeqs()
        self.arrivals = ArrivalRate(config.arrival_window_s)

    def sequence_limit(self, i: int) -> float:
        """The sequence limit of backend slot ``i`` in the fullness test (which scales it by
        ``seqs_high_water_frac`` and the class's ``fill_frac``): its ``max_num_seqs`` (configuration,
        profile or prior) where known, else the one learned from its engine's scrapes
        (:class:`ObservedSeqs`), NaN while there is none (``hetroute_queue_sequence_limit``)."""
        static = self.models.max_num_seqs
        if i < static.size and math.isfinite(float(static[i])):
            return float(static[i])
        backends = self.router.backends
        if i >= len(backends):
            return math.nan
        learned = self.observed_seqs.learned(backends[i].name, backends[i].url)
        return math.nan if learned is None else learned

    def arrived(self, features: RequestFeatures, now_s: float) -> None:
        """Count one arrival (every request that reaches admission, queued or not) in the arrival
        rate the tail test's backlog uses."""
        self.arrivals.note(features.model, now_s)

    def place(self, features: RequestFeatures, waiting: int, klass: ClassConfig) -> Ticket | None:
        """A dispatched ticket, or None when the request must wait.

        ``waiting`` is how many requests wait in the queue (this one included); ``klass`` is the
        request's priority class (its ``fill_frac`` scales the high-water marks). The policy first
        chooses among every available candidate, full or not, exactly as without the queue; if
        its choice is neither full nor too slow, that is the dispatch. Otherwise the policy
        chooses again among the backends that are neither (the *spill*); when there is none the
        request waits. While a backlog exists (``waiting > 1`` or some backend full) a backend s
        is **too slow** for r when

            lat_s(r; Õ_m) > H_s + (1 + ALIKE_FRAC) · min_b lat_b(r; Õ_m),   Õ_m = min(m · Õ, max_tokens)
            H_s = waiting / (Σ_{b ≠ s} 1/T_r^b − λ)         (∞ when the denominator is ≤ 0)

        (``lat``: the cost model's latency of r joining the backend's batch, with the prompts
        queued ahead of it; ``T_r^b``: r's amortised time on a saturated b, method.md §5;
        m = ``spill_margin``; λ: the recent arrival rate of r's model, :class:`ArrivalRate`):
        r would take longer on s, if its answer ran m times its prediction, than the rest of the
        fleet stays busy with the backlog (H_s) plus its time where it runs soonest. Every
        backend is priced at the same pessimistic length, since a long answer on a slow backend
        is what ends a run late, but never beyond ``max_tokens``: a request whose limit proves it
        short may go to a slow backend late. λ counts the requests still coming: while arrivals
        keep up with the rest of the fleet (a client that sends a new request per answer) the
        backlog never drains and every backend is used. So under a backlog every backend is kept
        busy, and when the backlog is short a slow backend does not take a request that a
        faster one would finish sooner (the drain tail), whether the policy chose it or the
        policy's choice was full.

        A class with ``placement: first_token`` instead goes to the backend, among those that are
        not full, with the smallest predicted time to first token (:meth:`_first_token_s`); the
        policy still prices it there. Raises :class:`UnknownModel` / :class:`NoBackendAvailable`
        as ``Router.route`` does.
        """
        router = self.router
        decision, snap = router.decide(features)
        cands = [i for i in router.serving(features.model, features.api) if snap.available[i]]
        idx: IntArray = np.array(cands, dtype=np.int64)
        limits = self.observed_seqs.limits(router, self.models, snap, idx)
        full = full_mask(self.config, self.models, snap, idx, features, klass.fill_frac, limits)
        if full.all():
            return None
        if klass.placement == "first_token":
            free = idx[~full]
            best = int(free[np.argmin(self._first_token_s(features, snap, free))])
            if best != decision.index:
                decision, snap = router.decide(features, exclude=[i for i in cands if i != best])
            return router.commit(features, decision, snap)
        blocked = full
        if waiting > 1 or full.any():  # a backlog: the tail test (nothing to wait for otherwise)
            blocked = full | self._too_slow(features, snap, idx, waiting, limits)
        if blocked.all():
            return None
        if not blocked[cands.index(decision.index)]:
            return router.commit(features, decision, snap)
        spill, snap = router.decide(features, exclude=idx[blocked].tolist())
        return router.commit(features, spill, snap)

    def _first_token_s(self, features: RequestFeatures, snap: ClusterSnapshot, idx: IntArray) -> FloatArray:
        """Predicted TTFT on each backend of ``idx``: the prompts queued before it (``p1 · P_s``),
        its own prefill, and one decode step of the running batch (method.md §3)."""
        models = self.models
        learned = snap.latency_params
        n, context = _batch_and_context(snap, idx)
        p = models.rows(idx, learned)
        step = p[:, 4] * n * context + p[:, 5] * n + p[:, 6] * context + p[:, 7]
        out: FloatArray = (
            models.prefill_queue_s(idx, snap.prefill_pending_tokens[idx], learned)
            + models.prefill_s(idx, features.input_tokens, learned)
            + np.where(n > 0, np.maximum(step, 0.0), 0.0)
        )
        return out

    def _too_slow(
        self, features: RequestFeatures, snap: ClusterSnapshot, idx: IntArray, waiting: int, seqs: FloatArray
    ) -> BoolArray:
        """The tail test of :meth:`place` per backend of ``idx`` (``seqs``: their sequence limits):
        True where r, priced at ``Õ_m = min(m · Õ, max_tokens)`` everywhere, would take longer
        there than the rest of the fleet stays busy with the backlog plus its time where it runs
        soonest."""
        models = self.models
        learned = snap.latency_params  # the live-learned model where the router learns (else None)
        i, o = features.input_tokens, features.predicted_output_tokens
        capacity = models.capacity_tokens(snap, idx)
        amortised = models.amortised_request_s(idx, i, o, capacity, learned, max_num_seqs=seqs)
        per_s = 1.0 / np.maximum(amortised, 1e-9)
        net_rate = float(np.sum(per_s)) - per_s - self.arrivals.rate_per_s(features.model, snap.now_s)
        if not (net_rate > 0.0).any():  # arrivals keep up with every backend's rest of the fleet
            return np.zeros(idx.size, dtype=np.bool_)
        horizon = np.where(net_rate > 0.0, max(waiting, 1) / np.maximum(net_rate, 1e-12), np.inf)
        o_spill = self.config.spill_margin * o
        if features.max_tokens is not None:
            o_spill = min(o_spill, float(features.max_tokens))  # it cannot generate more than that
        priced = self._joining_s(features, snap, idx, o_spill)
        out: BoolArray = priced > horizon + (1.0 + ALIKE_FRAC) * float(np.min(priced))
        return out

    def _joining_s(
        self, features: RequestFeatures, snap: ClusterSnapshot, idx: IntArray, o: float
    ) -> FloatArray:
        """Per backend of ``idx``: the prompts queued there, then r's latency joining its batch with
        ``o`` output tokens (:meth:`BackendModels.request_latency_s`)."""
        models, learned = self.models, snap.latency_params
        n, context = _batch_and_context(snap, idx)
        queue = models.prefill_queue_s(idx, snap.prefill_pending_tokens[idx], learned)
        out: FloatArray = queue + models.request_latency_s(
            idx, features.input_tokens, o, n + 1.0, context, learned
        )
        return out


def _batch_and_context(snap: ClusterSnapshot, idx: IntArray) -> tuple[FloatArray, FloatArray]:
    """Per backend of ``idx``: the requests in flight and their mean KV length (0 when idle)."""
    n = snap.requests_in_flight[idx].astype(np.float64)
    context: FloatArray = np.where(n > 0, snap.kv_tokens_in_flight[idx] / np.maximum(n, 1.0), 0.0)
    return n, context
