"""``session_hash``: consistent hashing on a session key (vLLM production-stack's session routing).

Each backend owns ``virtual_nodes`` points on a 64-bit ring (BLAKE2b of ``name#k``). A request's key
is its session (header or OpenAI ``user``), else its first prompt chunk's hash (so requests with the
same leading text land together), else its request id; it goes to the first point clockwise from the
key's hash whose backend is a candidate. Adding or removing a backend moves only the keys next to its
points. No load or latency term.

Params: ``virtual_nodes`` (default 100).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from hetroute.fields import PositiveInt
from hetroute.policies.base import PolicyContext, read_params
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class SessionHashParams:
    """``policy.params`` of ``session_hash``: points per backend on the ring."""

    virtual_nodes: PositiveInt = 100


class SessionHash:
    """Consistent hashing on the session key (see module docstring)."""

    name = "session_hash"

    def __init__(self, backend_names: tuple[str, ...], virtual_nodes: int = 100) -> None:
        ring = sorted(
            (_point(f"{name}#{k}"), i) for i, name in enumerate(backend_names) for k in range(virtual_nodes)
        )
        self._points = [p for p, _ in ring]
        self._owners = [i for _, i in ring]

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> SessionHash:
        p = read_params(SessionHashParams, params, cls.name)
        return cls(tuple(b.name for b in ctx.backends), p.virtual_nodes)

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        if features.session:
            key, what = features.session, "session"
        elif features.prefix_hashes:
            key, what = str(features.prefix_hashes[0]), "prompt head"
        else:
            key, what = features.request_id, "request id"
        allowed = set(candidates.tolist())
        start = bisect.bisect_left(self._points, _point(key))
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner in allowed:
                return RoutingDecision(index=owner, reason=f"hash ring on {what}")
        raise RuntimeError("no candidate on the hash ring")  # pragma: no cover - every backend has points
