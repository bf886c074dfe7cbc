"""Construction of the live models from what the router already resolved (composition helper).

The prior of each backend, best source first: a live model saved by an earlier run (``--state-dir``;
it started from the same prior and moved only where traffic showed otherwise), the backend's profile
file, the catalog's roofline prior, the neutral default (``policies.backend_model``). Until a backend's
first fit the policies see its static model (for the neutral default ``NEUTRAL_PARAMS``, which routes
best while nothing is known); the fit starts from the prior above (for the neutral default
``NEUTRAL_LEARNING_PRIOR``).
"""

from __future__ import annotations

from collections.abc import Mapping

from hetroute.latency import LatencyProfile
from hetroute.learning.live import LiveModels, PriorModel
from hetroute.learning.settings import LearningConfig
from hetroute.policies.backend_model import NEUTRAL_LEARNING_PRIOR, BackendModel, BackendModels


def _kind(latency_source: str) -> str:
    if latency_source.startswith("profile"):
        return "profile"
    if latency_source.startswith("roofline"):
        return "roofline"
    return "neutral"


def prior_of(
    model: BackendModel, saved: LatencyProfile | None = None
) -> tuple[PriorModel, tuple[float, ...]]:
    """One backend's prior (best source first, see the module docstring) and the p1..p8 published
    until its first fit."""
    if saved is not None:
        samples = saved.sweep.get("live_samples", "?")
        params = saved.params.as_tuple()
        return PriorModel(params, f"saved live model ({samples} samples)", "saved"), params
    kind = _kind(model.latency_source)
    start = model.params.as_tuple()
    if kind == "neutral":
        return PriorModel(NEUTRAL_LEARNING_PRIOR.as_tuple(), model.latency_source, "neutral"), start
    return PriorModel(start, model.latency_source, kind), start


def build_live_models(
    models: BackendModels, config: LearningConfig, saved: Mapping[int, LatencyProfile] | None = None
) -> LiveModels:
    """Live models for every backend of ``models``, each starting from its best prior."""
    found = [prior_of(m, (saved or {}).get(i)) for i, m in enumerate(models.models)]
    return LiveModels(
        [b.name for b in models.backends],
        [prior for prior, _ in found],
        [float(v) for v in models.fallback_capacity_tokens],
        [float(v) for v in models.max_num_seqs],
        config,
        initial_params=[start for _, start in found],
    )
