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
  (by default 0, and only on backends whose ``max_num_seqs`` is unknown).

A backend with nothing in flight is never full, so a request larger than any backend's
capacity is still dispatched (the engine then rejects or queues it, as without the queue).
:meth:`Placer.place` asks the routing policy for its choice at dispatch time (late binding)
and commits it only when that backend is not full.
"""

from __future__ import annotations

import numpy as np

from hetroute.admission.config import ClassConfig, FullConfig
from hetroute.policies.backend_model import BackendModels
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.types import BoolArray, ClusterSnapshot, FloatArray, IntArray, RequestFeatures


def full_mask(
    config: FullConfig,
    models: BackendModels,
    snapshot: ClusterSnapshot,
    idx: IntArray,
    features: RequestFeatures,
    fill_frac: float = 1.0,
) -> BoolArray:
    """For each backend in ``idx``: True when it is full for ``features`` (module docstring), with
    every high-water mark scaled by ``fill_frac`` (the request's class share)."""
    busy = snapshot.requests_in_flight[idx] > 0
    need = float(features.input_tokens + features.predicted_output_tokens)
    cap = models.capacity_tokens(snapshot, idx)
    kv = snapshot.kv_tokens_in_flight[idx] + need > fill_frac * config.kv_high_water_frac * cap
    seqs = (
        snapshot.requests_in_flight[idx] >= fill_frac * config.seqs_high_water_frac * models.max_num_seqs[idx]
    )
    full: BoolArray = kv | seqs
    if config.max_drain_s is not None:
        full = full | (snapshot.workload[idx] >= fill_frac * config.max_drain_s)
    # Engine queue: on every backend with an explicit limit; by default (None) with limit 0 on the
    # backends whose max_num_seqs is unknown (no config, profile or prior), where the sequence test
    # cannot see that the engine is queueing.
    if config.engine_waiting_max is not None:
        limit, where = config.engine_waiting_max, np.ones(idx.size, dtype=np.bool_)
    else:
        limit, where = 0, ~np.isfinite(models.max_num_seqs[idx])
    if where.any():
        waiting = np.array(
            [
                (m := snapshot.metrics[i]) is not None
                and m.num_requests_waiting is not None
                and m.num_requests_waiting > limit
                for i in idx.tolist()
            ],
            dtype=np.bool_,
        )
        full = full | (waiting & where)
    out: BoolArray = busy & full
    return out


class Placer:
    """Routes a request through ``router`` restricted to backends that are not full."""

    def __init__(self, router: Router, config: FullConfig, models: BackendModels | None = None) -> None:
        self.router = router
        self.config = config
        self.models = models if models is not None else BackendModels.from_specs(router.backends)

    def place(self, features: RequestFeatures, waiting: int, klass: ClassConfig) -> Ticket | None:
        """A dispatched ticket, or None when the request must wait.

        ``waiting`` is how many requests wait in the queue (this one included); ``klass`` is the
        request's priority class (its ``fill_frac`` scales the high-water marks). The policy first
        chooses among every available candidate, full or not, exactly as without the queue; if
        its choice has room, that is the dispatch. If the choice is full, the policy chooses again
        among the backends that are not full (the *spill*), and the request goes there only when
        it would finish there before the full backends can work off the backlog:

            spill_margin · lat_s(r) <= waiting / Σ_{f full} 1/T_r^f + lat_c(r)

        (``lat``: the cost model's latency of r joining the backend's batch; ``T_r^f``: its
        amortised time on a saturated f, method.md §5; c the first choice). So under a backlog
        every backend is kept busy, and when the backlog is short a slow backend does not take
        a request that a fast one would finish sooner (the drain tail).

        A class with ``placement: first_token`` instead goes to the backend, among those that are
        not full, with the smallest predicted time to first token (:meth:`_first_token_s`); the
        policy still prices it there. Raises :class:`UnknownModel` / :class:`NoBackendAvailable`
        as ``Router.route`` does.
        """
        router = self.router
        decision, snap = router.decide(features)
        cands = [i for i in router.serving(features.model, features.api) if snap.available[i]]
        idx: IntArray = np.array(cands, dtype=np.int64)
        full = full_mask(self.config, self.models, snap, idx, features, klass.fill_frac)
        if full.all():
            return None
        if klass.placement == "first_token":
            free = idx[~full]
            best = int(free[np.argmin(self._first_token_s(features, snap, free))])
            if best != decision.index:
                decision, snap = router.decide(features, exclude=[i for i in cands if i != best])
            return router.commit(features, decision, snap)
        if not full[cands.index(decision.index)]:
            return router.commit(features, decision, snap)
        spill, snap = router.decide(features, exclude=idx[full].tolist())
        if self._finishes_in_time(features, snap, idx[full], spill.index, decision.index, waiting):
            return router.commit(features, spill, snap)
        return None

    def _first_token_s(self, features: RequestFeatures, snap: ClusterSnapshot, idx: IntArray) -> FloatArray:
        """Predicted TTFT on each backend of ``idx``: the prompts queued before it (``p1 · P_s``),
        its own prefill, and one decode step of the running batch (method.md §3)."""
        models = self.models
        n = snap.requests_in_flight[idx].astype(np.float64)
        context = np.where(n > 0, snap.kv_tokens_in_flight[idx] / np.maximum(n, 1.0), 0.0)
        p = models.params[idx]
        step = p[:, 4] * n * context + p[:, 5] * n + p[:, 6] * context + p[:, 7]
        out: FloatArray = (
            models.prefill_queue_s(idx, snap.prefill_pending_tokens[idx])
            + models.prefill_s(idx, features.input_tokens)
            + np.where(n > 0, np.maximum(step, 0.0), 0.0)
        )
        return out

    def _finishes_in_time(
        self,
        features: RequestFeatures,
        snap: ClusterSnapshot,
        full: IntArray,
        spill: int,
        first: int,
        waiting: int,
    ) -> bool:
        models = self.models
        i, o = features.input_tokens, features.predicted_output_tokens
        amortised = models.amortised_request_s(full, i, o, models.capacity_tokens(snap, full))
        rate = float(np.sum(1.0 / np.maximum(amortised, 1e-9)))
        pair: IntArray = np.array([spill, first], dtype=np.int64)
        n = snap.requests_in_flight[pair].astype(np.float64)
        context = np.where(n > 0, snap.kv_tokens_in_flight[pair] / np.maximum(n, 1.0), 0.0)
        lat = models.request_latency_s(pair, i, o, n + 1.0, context)
        return bool(self.config.spill_margin * lat[0] <= max(waiting, 1) / rate + lat[1])
