"""``weighted_round_robin``: smooth weighted round robin (the nginx algorithm).

Algorithm, per request over the candidate set C with weights w_i:
    current_i += w_i for i in C;  pick c = argmax_{i in C} current_i;  current_c -= Σ_{i in C} w_i
Over any window of Σw requests each backend gets exactly w_i of them, interleaved rather
than in bursts. Ties go to the lowest index (deterministic).

Params: ``weights`` — {backend name: weight} or a list in backend order; backends not
named use their configured ``weight`` (default 1). The paper's WRR 4:1 is
``weights: {tp4: 4, tp1: 1}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetroute.policies.base import PolicyContext, read_backend_weights, read_params
from hetroute.types import ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class WeightedRoundRobinParams:
    """``policy.params`` of ``weighted_round_robin``; ``weights`` is checked against the backends."""

    weights: object = None


class WeightedRoundRobin:
    """Smooth weighted round robin with static weights."""

    name = "weighted_round_robin"

    def __init__(self, weights: tuple[float, ...]) -> None:
        self.weights: FloatArray = np.array(weights, dtype=np.float64)
        self._current: FloatArray = np.zeros(len(weights), dtype=np.float64)

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> WeightedRoundRobin:
        return cls(read_backend_weights(read_params(WeightedRoundRobinParams, params, cls.name).weights, ctx))

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        w = self.weights[candidates]
        self._current[candidates] += w
        pick = int(candidates[int(np.argmax(self._current[candidates]))])
        self._current[pick] -= float(w.sum())
        return RoutingDecision(index=pick, reason=f"smooth WRR weight {self.weights[pick]:g}")
