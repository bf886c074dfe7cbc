"""``random``: a uniformly random candidate from a seeded RNG.

Params: ``seed`` (int, default: the gateway's seed). Reads nothing from the snapshot.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from hetroute.policies.base import PolicyContext, read_params, seeded_choice, seeded_rng
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class RandomParams:
    """``policy.params`` of ``random``; ``seed`` None: the router's seed."""

    seed: int | None = None


class RandomChoice:
    """Uniform random choice with an injected, seeded RNG."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> RandomChoice:
        return cls(seeded_rng(read_params(RandomParams, params, cls.name).seed, ctx))

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        return RoutingDecision(index=seeded_choice(self._rng, candidates), reason="uniform random")
