"""What the router knows about cache locality: the prefix index, its trust, and session affinity.

:class:`PrefixState` is the router's one handle on them. Per decision it answers, for the request's
chunk hashes, how many tokens each backend is estimated to hold (``matched_tokens``) and which backend
the request's session last went to; after the dispatch it records the request's chunks on the chosen
backend (``dispatched``); scrapes feed the engines' hit counters to :class:`CacheTrust`.

Estimated cached tokens of request r on backend b (the cost model's input, docs/prefix.md):

    matched_b = min(chunks_b(r) · c_r, I_r − 1)     (c_r: tokens per chunk; vLLM recomputes ≥ 1 token)
    cached_b  = trust_b · matched_b
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetroute.prefix.hashing import ROUTER_CHUNK_TOKENS
from hetroute.prefix.index import PrefixIndex
from hetroute.prefix.sessions import SessionTable
from hetroute.prefix.settings import PrefixConfig
from hetroute.prefix.trust import CacheTrust
from hetroute.types import EngineMetrics, FloatArray, RequestFeatures


class PrefixState:
    """The router's cache-locality state for ``backends`` backends (see module docstring)."""

    __slots__ = (
        "config",
        "index",
        "trust",
        "sessions",
        "_caps",
        "input_tokens_total",
        "expected_hit_tokens_total",
    )

    def __init__(self, backends: int, config: PrefixConfig) -> None:
        self.config = config
        self.index = PrefixIndex([math.nan] * backends, ttl_s=config.ttl_s, max_chunks=config.max_chunks)
        self.trust = CacheTrust(backends)
        self.sessions = SessionTable(config.max_sessions, config.session_ttl_s)
        self._caps: tuple[float, ...] = ()
        self.input_tokens_total = 0.0
        """Σ prompt tokens of dispatched requests (the denominator of the router's hit-rate estimate)."""
        self.expected_hit_tokens_total = 0.0
        """Σ cached tokens the router expected at dispatch (trust-weighted)."""

    def set_capacities(self, kv_capacity_tokens: FloatArray) -> None:
        """Bound each backend's index to its KV capacity (tokens; NaN = unknown → the global bound)."""
        caps = tuple(float(c) for c in kv_capacity_tokens)
        if caps == self._caps:
            return
        self._caps = caps
        for b, cap in enumerate(caps):
            self.index.set_capacity(b, cap / ROUTER_CHUNK_TOKENS if math.isfinite(cap) else math.nan)

    def set_slot(self, backend: int) -> None:
        """Slot ``backend`` holds a new backend: nothing cached, fully trusted, no sessions (one past the
        last: grow). Capacities are set again at the next snapshot."""
        self.index.set_slot(backend)
        self.trust.set_slot(backend)
        self.sessions.forget_backend(backend)
        self._caps = ()

    def scraped(self, metrics: Sequence[EngineMetrics | None]) -> None:
        """Fold the latest scrapes into the trust (an engine restart forgets that backend's entries)."""
        for b, m in enumerate(metrics):
            if self.trust.scraped(b, m):
                self.index.forget_backend(b)

    def matched_tokens(self, features: RequestFeatures, now_s: float) -> FloatArray | None:
        """Tokens of ``features``' prompt each backend is estimated to hold (before trust); None when
        the request has no full chunk or no backend holds any of it."""
        if not features.prefix_hashes:
            return None
        cap = max(float(features.input_tokens) - 1.0, 0.0)
        out = self.index.matched_tokens(features.prefix_hashes, now_s, features.prefix_chunk_tokens, cap)
        if out is None:
            return None  # nothing cached anywhere: the decision is the one without the prefix term
        out.flags.writeable = False
        return out

    def session_backend(self, features: RequestFeatures, now_s: float) -> int:
        """The backend the request's session last went to, or -1."""
        return self.sessions.backend_of(features.session, now_s)

    def dispatched(
        self, features: RequestFeatures, backend: int, matched: FloatArray | None, now_s: float
    ) -> float:
        """Record the dispatch; returns the cached tokens expected on ``backend`` (trust-weighted)."""
        self.sessions.record(features.session, backend, now_s)
        self.input_tokens_total += features.input_tokens
        if not features.prefix_hashes:
            return 0.0
        expected = 0.0
        if matched is not None:
            raw = float(matched[backend])
            self.trust.predicted(backend, raw)
            expected = raw * float(self.trust.trust[backend])
        self.index.insert(backend, features.prefix_hashes, now_s)
        self.expected_hit_tokens_total += expected
        return expected
