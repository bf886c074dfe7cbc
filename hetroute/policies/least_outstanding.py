"""``least_outstanding``: Envoy's weighted least request load balancer.

Envoy's rule (docs: intro/arch_overview/upstream/load_balancing/load_balancers, "Weighted least
request") depends on whether the hosts' weights are equal; here "the hosts" are the request's
candidates (the available backends serving its model: Envoy's cluster).

Equal weights — P2C (Mitzenmacher): draw ``choice_count`` (default 2) distinct candidates at
random and take the one with the fewest requests in flight (``snapshot.requests_in_flight``);
ties go to the first drawn.

Unequal weights — a weighted round robin schedule whose weights are recomputed from the load
at every pick:
    effective_i = w_i / (active_i + 1) ** bias        (bias default 1.0)
scheduled by smooth weighted round robin (as ``weighted_round_robin``) over the candidates:
    current_i += effective_i for i in C;  pick c = argmax current_i;  current_c -= Σ_{i in C} effective_i
(ties: the lowest index). It is not an argmax of ``effective``: every candidate keeps a share in
proportion to its effective weight, so a loaded backend gets fewer requests but never none. With
no load the shares are exactly the weights (3:1 weights give 3 of every 4 picks); with bias 0 the
load is ignored and this is plain smooth WRR. Envoy implements the schedule with an
earliest-deadline-first scheduler; the smooth form reads every candidate's load at each pick and
handles per-request candidate sets. Either way each backend's share follows its effective weight.

Params: ``choice_count`` (int ≥ 2), ``bias`` (≥ 0, Envoy's ``active_request_bias``), ``weights``
(as weighted_round_robin), ``seed`` (the P2C draws; the weighted schedule is deterministic).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from hetroute.fields import NON_NEGATIVE, Range
from hetroute.policies.base import PolicyContext, read_backend_weights, read_params, seeded_rng
from hetroute.types import ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class LeastOutstandingParams:
    """``policy.params`` of ``least_outstanding``; ``weights`` is checked against the backends
    (:func:`read_backend_weights`), ``seed`` None: the router's seed."""

    choice_count: Annotated[int, Range(minimum=2)] = 2
    bias: Annotated[float, NON_NEGATIVE] = 1.0
    weights: object = None
    seed: int | None = None


class LeastOutstanding:
    """P2C on in-flight requests; with unequal weights, smooth WRR over ``w / (active+1)^bias``."""

    name = "least_outstanding"

    def __init__(
        self, weights: tuple[float, ...], rng: random.Random, *, choice_count: int = 2, bias: float = 1.0
    ):
        self.weights: FloatArray = np.array(weights, dtype=np.float64)
        self.choice_count = choice_count
        self.bias = bias
        self._rng = rng
        self._current: FloatArray = np.zeros(len(weights), dtype=np.float64)

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> LeastOutstanding:
        p = read_params(LeastOutstandingParams, params, cls.name)
        return cls(
            read_backend_weights(p.weights, ctx),
            seeded_rng(p.seed, ctx),
            choice_count=p.choice_count,
            bias=p.bias,
        )

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        active = snapshot.requests_in_flight
        if len(candidates) == 1:
            index = int(candidates[0])
            return RoutingDecision(index=index, reason="only candidate")
        w = self.weights[candidates]
        if np.all(w == w[0]):
            k = min(self.choice_count, len(candidates))
            drawn = self._rng.sample(range(len(candidates)), k)
            best = min(drawn, key=lambda j: int(active[candidates[j]]))
            index = int(candidates[best])
            return RoutingDecision(index=index, reason=f"P2C: {int(active[index])} in flight")
        eff = w / np.power(active[candidates] + 1.0, self.bias)
        self._current[candidates] += eff
        index = int(candidates[int(np.argmax(self._current[candidates]))])
        self._current[index] -= float(eff.sum())
        reason = f"weighted least request: WRR on w/(active+1)^{self.bias:g}, {int(active[index])} in flight"
        return RoutingDecision(index=index, reason=reason)
