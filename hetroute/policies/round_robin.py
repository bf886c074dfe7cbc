"""``round_robin``: cycle through the candidates in a stable order.

Algorithm: keep one counter; choose ``candidates[counter mod len(candidates)]`` and
increment. Candidates arrive in config order, so with a stable candidate set every
backend gets every n-th request. Reads nothing from the snapshot. Params: none.
This counter is the only state a classic policy keeps (house style §8).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetroute.policies.base import PolicyContext, read_params
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    """``policy.params`` of ``round_robin``: none."""


class RoundRobin:
    """Deterministic round robin over the candidate set."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> RoundRobin:
        read_params(RoundRobinParams, params, cls.name)
        return cls()

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        index = int(candidates[self._counter % len(candidates)])
        self._counter += 1
        return RoutingDecision(index=index, reason="round robin")
