"""``prefix_scorer``: llm-d's inference scheduler default profile, re-implemented as a baseline.

Each candidate gets a weighted sum of scores in [0, 1] and the highest total wins (max-score picker,
ties at random), with the weights of llm-d's chart default profile:

- queue-scorer (×2): ``(maxQ − q_i) / (maxQ − minQ)`` over the candidates' waiting requests as last
  scraped from the engine (``num_requests_waiting``); 1 for all when they are equal;
- kv-cache-utilization-scorer (×2): ``1 − kv_usage_i`` (the engine's scraped KV usage);
- prefix-cache-scorer (×3): matched blocks / prompt blocks, from the router's approximate prefix index
  (llm-d's approximate prefix-cache producer: a per-pod LRU of chained block hashes updated after each
  pick; ours chunks text by 256 characters, without the hit-counter correction).

A backend not yet scraped scores as an empty queue and an empty cache. No latency model.

Params: ``queue_weight`` (2), ``kv_weight`` (2), ``prefix_weight`` (3), ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hetroute.fields import NonNegativeFloat
from hetroute.policies.base import PolicyContext, read_params, seeded_choice, seeded_rng
from hetroute.types import ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class PrefixScorerParams:
    """``policy.params`` of ``prefix_scorer``; ``seed`` None: the router's seed."""

    queue_weight: NonNegativeFloat = 2.0
    kv_weight: NonNegativeFloat = 2.0
    prefix_weight: NonNegativeFloat = 3.0
    seed: int | None = None


class PrefixScorer:
    """llm-d-style weighted queue + KV + prefix scoring (see module docstring)."""

    name = "prefix_scorer"

    def __init__(self, rng: random.Random, params: PrefixScorerParams = PrefixScorerParams()) -> None:
        self.params = params
        self._rng = rng

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> PrefixScorer:
        p = read_params(PrefixScorerParams, params, cls.name)
        return cls(seeded_rng(p.seed, ctx), p)

    def scores(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> FloatArray:
        """The weighted total per candidate."""
        waiting: list[float] = []
        usage: list[float] = []
        for i in candidates.tolist():
            m = snapshot.metrics[i]
            waiting.append(m.num_requests_waiting or 0.0 if m is not None else 0.0)
            usage.append(m.kv_usage_frac or 0.0 if m is not None else 0.0)
        q: FloatArray = np.array(waiting, dtype=np.float64)
        span = float(q.max() - q.min())
        queue = (q.max() - q) / span if span > 0 else np.ones_like(q)
        kv = 1.0 - np.clip(np.array(usage, dtype=np.float64), 0.0, 1.0)
        prefix: FloatArray = np.zeros(len(candidates), dtype=np.float64)
        matched = snapshot.prefix_matched_tokens
        if matched is not None and features.prefix_hashes:
            total = len(features.prefix_hashes) * max(features.prefix_chunk_tokens, 1e-9)
            prefix = np.minimum(matched[candidates] / total, 1.0)
        w = self.params
        out: FloatArray = w.queue_weight * queue + w.kv_weight * kv + w.prefix_weight * prefix
        return out

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        total = self.scores(features, snapshot, candidates)
        best = float(total.max())
        top = candidates[total >= best - 1e-12]
        index = seeded_choice(self._rng, top) if len(top) > 1 else int(top[0])
        return RoutingDecision(index=index, reason=f"max score {best:.3f}", scores={"score": best})
