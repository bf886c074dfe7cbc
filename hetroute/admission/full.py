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
:meth:`Placer.place` asks the routing policy to choose among the candidates that are not full
(the policy's own cost model decides where, at dispatch time), or answers None when all are.
"""

from __future__ import annotations

import numpy as np

from hetroute.admission.config import FullConfig
from hetroute.errors import NoBackendAvailable, UnknownModel
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
        """A dispatched ticket, or None when every available candidate is full.

        Raises :class:`UnknownModel` / :class:`NoBackendAvailable` as ``Router.route`` does.
        """
        router = self.router
        serving = router.serving(features.model, features.api)
        if not serving:
            raise UnknownModel(features.model)
        snap = router.snapshot()
        cands = [i for i in serving if snap.available[i]]
        if not cands:
            raise NoBackendAvailable(features.model)
        idx: IntArray = np.array(cands, dtype=np.int64)
        full = full_mask(self.config, self.models, snap, idx, features)
        if full.all():
            return None
        return router.route(features, exclude=idx[full].tolist())
