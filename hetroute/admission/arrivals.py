"""The recent arrival rate of requests per model, for the tail test's backlog (admission/full.py).

An exponentially decayed count (time constant τ = ``arrival_window_s``): each arrival adds 1 and
the sum decays as ``e^{-Δt/τ}``, so

    λ_m(t) = (1/τ) · Σ_{arrivals i of model m, t_i <= t} e^{-(t − t_i)/τ}      (requests/s)

is the arrival rate of model m smoothed over about τ seconds. A burst of N requests at once reads
as N/τ at first and decays; a steady stream at rate λ reads λ. State: one (sum, time) pair per
model seen; time comes only from the ``now_s`` given (the injected clock).
"""

from __future__ import annotations

import math


class ArrivalRate:
    """λ_m(t) per model (module docstring); ``window_s`` is τ (> 0)."""

    __slots__ = ("_window_s", "_state")

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._state: dict[str, tuple[float, float]] = {}

    def note(self, model: str, now_s: float) -> None:
        """One request for ``model`` arrived at ``now_s``."""
        self._state[model] = (self._decayed(model, now_s) + 1.0, now_s)

    def rate_per_s(self, model: str, now_s: float) -> float:
        """λ_m(now_s) in requests per second (0 for a model never seen)."""
        return self._decayed(model, now_s) / self._window_s

    def _decayed(self, model: str, now_s: float) -> float:
        total, at_s = self._state.get(model, (0.0, now_s))
        return total * math.exp(-max(0.0, now_s - at_s) / self._window_s)
