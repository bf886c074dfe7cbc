"""The ``learning:`` section of the router config; its annotations are its bounds (``hetroute.fields``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from hetroute.fields import PositiveFloat, Range


@dataclass(frozen=True, slots=True)
class LearningConfig:
    """Live latency learning (docs/learning.md). Defaults are what ``hetroute serve`` runs with.

    - ``enabled``: learn each backend's p1..p8 from its finished requests (default on).
    - ``refit_interval_s``: how often the fits run, off the request path.
    - ``half_life_s``: an observation's weight halves every ``half_life_s`` (the decaying window).
    - ``window``: observations kept per backend.
    - ``prior_strength``: how many observations' worth of pull the prior's decode-curve shape keeps (λ_d;
      its speed moves on less evidence, see ``fit.py``).
    - ``drift_ratio``: a backend whose last 32 requests took, in median, this factor longer (or
      shorter) than the model predicts has drifted: older observations lose their weight.
    - ``state_dir``: where the learned models are saved (every ``save_interval_s`` and at shutdown) and
      loaded from at start (``hetroute serve --state-dir``); None: not persisted.
    """

    enabled: bool = True
    refit_interval_s: PositiveFloat = 1.0
    half_life_s: PositiveFloat = 30.0
    window: Annotated[int, Range(minimum=8)] = 512
    prior_strength: PositiveFloat = 32.0
    drift_ratio: Annotated[float, Range(above=1)] = 1.6
    state_dir: str | None = None
    save_interval_s: PositiveFloat = 60.0
