"""``least_outstanding``: fewest in-flight requests, with power-of-two choices.

Equal weights — P2C (Mitzenmacher; Envoy's least-request LB): draw ``choice_count``
(default 2) distinct candidates at random and take the one with the fewest requests in
flight (``snapshot.requests_in_flight``); ties go to the first drawn.

Unequal weights — Envoy's weighted least request, evaluated over every candidate:
    effective_i = w_i / (active_i + 1) ** bias        (bias default 1.0)
and the candidate with the largest effective weight wins (ties: seeded random). With
bias 0 this degrades to "always the heaviest backend", so keep bias > 0.

Params: ``choice_count`` (int ≥ 2), ``bias`` (≥ 0), ``weights`` (as weighted_round_robin),
``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np

from hetroute.policies.base import (
    PolicyContext,
    check_known,
    read_backend_weights,
    read_float,
    read_int,
    seeded_choice,
)
from hetroute.types import ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision


class LeastOutstanding:
    """P2C on in-flight requests; Envoy weighted least request when weights differ."""

    name = "least_outstanding"

    def __init__(
        self, weights: tuple[float, ...], rng: random.Random, *, choice_count: int = 2, bias: float = 1.0
    ):
        self.weights: FloatArray = np.array(weights, dtype=np.float64)
        self.weighted = len(set(weights)) > 1
        self.choice_count = choice_count
        self.bias = bias
        self._rng = rng

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> LeastOutstanding:
        check_known(params, ("choice_count", "bias", "weights", "seed"), cls.name)
        return cls(
            read_backend_weights(params, ctx),
            random.Random(read_int(params, "seed", ctx.seed)),
            choice_count=read_int(params, "choice_count", 2, minimum=2),
            bias=read_float(params, "bias", 1.0, minimum=0.0),
        )

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        active = snapshot.requests_in_flight
        if len(candidates) == 1:
            index = int(candidates[0])
            return RoutingDecision(index=index, reason="only candidate")
        if not self.weighted:
            k = min(self.choice_count, len(candidates))
            drawn = self._rng.sample(range(len(candidates)), k)
            best = min(drawn, key=lambda j: int(active[candidates[j]]))
            index = int(candidates[best])
            return RoutingDecision(index=index, reason=f"P2C: {int(active[index])} in flight")
        eff = self.weights[candidates] / np.power(active[candidates] + 1.0, self.bias)
        top = candidates[eff == eff.max()]
        index = seeded_choice(self._rng, top) if len(top) > 1 else int(top[0])
        return RoutingDecision(index=index, reason=f"weighted least request: w/(active+1)^{self.bias:g}")
