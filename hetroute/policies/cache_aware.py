"""``cache_aware``: SGLang model gateway's cache-aware policy, re-implemented as a baseline.

Per request (SGLang router, ``cache_aware``; its CLI defaults):

- load_i = requests in flight on candidate i (router-tracked).
- If the candidates are imbalanced, ``max_load − min_load > balance_abs_threshold`` (64) **and**
  ``max_load > balance_rel_threshold · min_load`` (1.5), route to the least-loaded candidate.
- Else match_rate_i = matched prompt tokens on i / prompt tokens, from the router's prefix index
  (SGLang walks an approximate radix tree of request text; ours is the same idea in 256-character
  chunks, without the engines' hit-counter correction). If the best match rate exceeds
  ``cache_threshold`` (0.3), route there (ties: least loaded); else to the least-loaded candidate
  (SGLang's newer load-aware fallback; the original took the worker with the smallest tree).

The prompt is then recorded on the chosen backend by the router, as SGLang inserts it into that
worker's tree. No latency model: every backend is treated as equally fast.

Params: ``cache_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``, ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from hetroute.fields import NON_NEGATIVE, UNIT, Range
from hetroute.policies.base import PolicyContext, read_params, seeded_choice, seeded_rng
from hetroute.types import ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64.0
BALANCE_REL_THRESHOLD = 1.5


@dataclass(frozen=True, slots=True)
class CacheAwareParams:
    """``policy.params`` of ``cache_aware``; ``seed`` None: the router's seed."""

    cache_threshold: Annotated[float, UNIT] = CACHE_THRESHOLD
    balance_abs_threshold: Annotated[float, NON_NEGATIVE] = BALANCE_ABS_THRESHOLD
    balance_rel_threshold: Annotated[float, Range(minimum=1)] = BALANCE_REL_THRESHOLD
    seed: int | None = None


class CacheAware:
    """SGLang's cache-aware routing (see module docstring)."""

    name = "cache_aware"

    def __init__(self, rng: random.Random, params: CacheAwareParams = CacheAwareParams()) -> None:
        self.params = params
        self._rng = rng

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> CacheAware:
        p = read_params(CacheAwareParams, params, cls.name)
        return cls(seeded_rng(p.seed, ctx), p)

    def _least_loaded(self, candidates: IntArray, load: FloatArray) -> int:
        low = candidates[load == load.min()]
        return seeded_choice(self._rng, low) if len(low) > 1 else int(low[0])

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        load: FloatArray = snapshot.requests_in_flight[candidates].astype(np.float64)
        hi, lo = float(load.max()), float(load.min())
        if hi - lo > self.params.balance_abs_threshold and hi > self.params.balance_rel_threshold * lo:
            index = self._least_loaded(candidates, load)
            return RoutingDecision(index=index, reason=f"imbalanced ({hi:.0f} vs {lo:.0f}): least loaded")
        matched = snapshot.prefix_matched_tokens
        if matched is not None:
            rate = matched[candidates] / max(float(features.input_tokens), 1.0)
            best = float(rate.max())
            if best > self.params.cache_threshold:
                top = rate == best
                index = self._least_loaded(candidates[top], load[top])
                return RoutingDecision(index=index, reason=f"cache hit: match rate {best:.2f}")
        index = self._least_loaded(candidates, load)
        return RoutingDecision(index=index, reason="no cache match: least loaded")
