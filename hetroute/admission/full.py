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
- **engine queue** (optional, ``engine_waiting_max``): the last scrape reports more waiting
  requests than that.

A backend with nothing in flight is never full, so a request larger than any backend's
capacity is still dispatched (the engine then rejects or queues it, as without the queue).
:meth:`Placer.place` asks the routing policy for its choice at dispatch time (late binding)
and commits it only when that backend is not full.
"""

from __future__ import annotations

import numpy as np

from hetroute.admission.config import FullConfig
from hetroute.policies.backend_model import BackendModels
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.types import BoolArray, ClusterSnapshot, IntArray, RequestFeatures


def full_mask(
    config: FullConfig,
    models: BackendModels,
    snapshot: ClusterSnapshot,
    idx: IntArray,
    features: RequestFeatures,
) -> BoolArray:
    """For each backend in ``idx``: True when it is full for ``features`` (module docstring)."""
    busy = snapshot.requests_in_flight[idx] > 0
    need = float(features.input_tokens + features.predicted_output_tokens)
    cap = models.capacity_tokens(snapshot, idx)
    kv = snapshot.kv_tokens_in_flight[idx] + need > config.kv_high_water_frac * cap
    seqs = snapshot.requests_in_flight[idx] >= config.seqs_high_water_frac * models.max_num_seqs[idx]
    full: BoolArray = kv | seqs
    if config.engine_waiting_max is not None:
        limit = config.engine_waiting_max
        waiting = np.array(
            [
                (m := snapshot.metrics[i]) is not None
                and m.num_requests_waiting is not None
                and m.num_requests_waiting > limit
                for i in idx.tolist()
            ],
            dtype=np.bool_,
        )
        full = full | waiting
    out: BoolArray = busy & full
    return out


class Placer:
    """Routes a request through ``router`` restricted to backends that are not full."""

    def __init__(self, router: Router, config: FullConfig, models: BackendModels | None = None) -> None:
        self.router = router
        self.config = config
        self.models = models if models is not None else BackendModels.from_specs(router.backends)

    def place(self, features: RequestFeatures) -> Ticket | None:
        """A dispatched ticket, or None when the policy's choice is full (the request waits).

        The policy chooses among every available candidate, full or not, exactly as without the
        queue; the queue only delays the dispatch until its choice has room. So a request is
        never sent to a slow backend merely because it freed a slot first when the policy
        predicts it finishes sooner by waiting for a faster one (the drain tail at the end of a
        burst). Raises :class:`UnknownModel` / :class:`NoBackendAvailable` as ``Router.route``.
        """
        router = self.router
        decision, snap = router.decide(features)
        idx: IntArray = np.array([decision.index], dtype=np.int64)
        if full_mask(self.config, self.models, snap, idx, features)[0]:
            return None
        return router.commit(features, decision, snap.now_s)
