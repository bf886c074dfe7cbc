"""``random``: a uniformly random candidate from a seeded RNG.

Params: ``seed`` (int, default: the gateway's seed). Reads nothing from the snapshot.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from hetroute.policies.base import PolicyContext, check_known, read_int, seeded_choice
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision


class RandomChoice:
    """Uniform random choice with an injected, seeded RNG."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> RandomChoice:
        check_known(params, ("seed",), cls.name)
        return cls(random.Random(read_int(params, "seed", ctx.seed)))

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        return RoutingDecision(index=seeded_choice(self._rng, candidates), reason="uniform random")
