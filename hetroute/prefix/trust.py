"""Correcting the router's prefix guess with the engines' own prefix-cache hit counters.

vLLM exports cumulative counters of prompt tokens looked up in its prefix cache and of tokens found
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``). Between two scrapes of backend b the
engine's hits Δh_b can be set against the hits the router predicted for the requests it sent there,
Δp_b (the index's matched tokens at dispatch). Their ratio says how far the index over-estimates the
cache (evictions the router did not see, another router replica's traffic, a restarted engine):

    trust_b ← (1 − α) · trust_b + α · clamp(Δh_b / Δp_b, 0, 1)      when Δp_b ≥ MIN_PREDICTED_TOKENS

with α = :data:`TRUST_RATE`. The cost model counts ``trust_b · matched_b`` tokens as cached. ``trust`` stays
1 for engines without the counters (TGI, OpenAI-compatible servers) and starts at 1. A counter that
went down (engine restart) resets the baseline and the index's entries for that backend.

The engine counts a hit when it schedules the request, the router predicts it at dispatch, so hits
lag their predictions by the engine's queueing. Two rules keep that lag from reading as an index that
over-estimates: scrapes whose prediction is still under ``MIN_PREDICTED_TOKENS`` fold into the next
window on *both* sides (hits and predictions accumulate together), and hits beyond a window's
prediction are carried into the next window (at most one window's prediction), where they count
against the predictions they belong to. Without them, a lightly used backend whose index is exact
lost every hit counted in a short window, and a busy one read 0.5 then 1.0 (clamped from 1.5) for
late hits, and so trusted its exact index less than fully.
"""

from __future__ import annotations

import math

import numpy as np

from hetroute.types import EngineMetrics, FloatArray

TRUST_RATE = 0.3
MIN_PREDICTED_TOKENS = 512.0
TRUST_FLOOR = 0.05


class CacheTrust:
    """Per-backend trust in the prefix index, fed by dispatches and scrapes (see module docstring)."""

    __slots__ = ("_trust", "_predicted", "_late_hits", "_last_hits", "_last_metrics", "_view")

    def __init__(self, backends: int) -> None:
        self._trust: FloatArray = np.ones(backends, dtype=np.float64)
        self._predicted = [0.0] * backends
        self._late_hits = [0.0] * backends  # hits beyond the last window's prediction, carried over
        self._last_hits: list[float | None] = [None] * backends
        self._last_metrics: list[EngineMetrics | None] = [None] * backends
        self._view: FloatArray = self._frozen()

    def set_slot(self, backend: int) -> None:
        """Slot ``backend`` holds a new backend, fully trusted and unscraped (one past the last: grow)."""
        if backend == len(self._predicted):
            self._trust = np.append(self._trust, 1.0)
            self._predicted.append(0.0)
            self._late_hits.append(0.0)
            self._last_hits.append(None)
            self._last_metrics.append(None)
        else:
            self._trust[backend] = 1.0
            self._predicted[backend] = 0.0
            self._late_hits[backend] = 0.0
            self._last_hits[backend] = None
            self._last_metrics[backend] = None
        self._view = self._frozen()

    def _frozen(self) -> FloatArray:
        view = self._trust.copy()
        view.flags.writeable = False
        return view

    @property
    def trust(self) -> FloatArray:
        """Read-only trust per backend in [TRUST_FLOOR, 1]."""
        return self._view

    def predicted(self, backend: int, tokens: float) -> None:
        """The router sent ``backend`` a request it expects to hit ``tokens`` cached tokens."""
        self._predicted[backend] += tokens

    def scraped(self, backend: int, metrics: EngineMetrics | None) -> bool:
        """Fold a scrape in; True when the engine's counter went backwards (restart: forget its cache)."""
        if metrics is None or metrics is self._last_metrics[backend]:
            return False
        self._last_metrics[backend] = metrics
        hits = metrics.prefix_cache_hits_total
        if hits is None or not math.isfinite(hits):
            return False
        last = self._last_hits[backend]
        if last is None or hits < last:  # first scrape, or a restart: a new baseline
            self._last_hits[backend] = hits
            self._predicted[backend] = 0.0
            self._late_hits[backend] = 0.0
            return last is not None
        predicted = self._predicted[backend]
        if predicted < MIN_PREDICTED_TOKENS:
            return False  # the window goes on: hits and predictions keep accumulating
        self._last_hits[backend] = hits
        counted = hits - last + self._late_hits[backend]
        ratio = min(counted / predicted, 1.0)
        self._late_hits[backend] = min(max(counted - predicted, 0.0), predicted)
        old = float(self._trust[backend])
        self._trust[backend] = max(TRUST_FLOOR, (1.0 - TRUST_RATE) * old + TRUST_RATE * ratio)
        self._predicted[backend] = 0.0
        self._view = self._frozen()
        return False
