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
from hetroute.policies.backend_model import NEUTRAL_LEARNING_PRIOR, BackendModels


def _kind(latency_source: str) -> str:
    if latency_source.startswith("profile"):
        return "profile"
    if latency_source.startswith("roofline"):
        return "roofline"
    return "neutral"


def build_live_models(
    models: BackendModels, config: LearningConfig, saved: Mapping[int, LatencyProfile] | None = None
) -> LiveModels:
    """Live models for every backend of ``models``, each starting from its best prior."""
    priors = []
    for i, m in enumerate(models.models):
        found = (saved or {}).get(i)
        if found is not None:
            samples = found.sweep.get("live_samples", "?")
            priors.append(
                PriorModel(found.params.as_tuple(), f"saved live model ({samples} samples)", "saved")
            )
        elif _kind(m.latency_source) == "neutral":
            priors.append(PriorModel(NEUTRAL_LEARNING_PRIOR.as_tuple(), m.latency_source, "neutral"))
        else:
            priors.append(PriorModel(m.params.as_tuple(), m.latency_source, _kind(m.latency_source)))
    return LiveModels(
        [b.name for b in models.backends],
        priors,
        [float(v) for v in models.fallback_capacity_tokens],
        [float(v) for v in models.max_num_seqs],
        config,
        initial_params=[
            saved_params.params.as_tuple()
            if (saved_params := (saved or {}).get(i)) is not None
            else m.params.as_tuple()
            for i, m in enumerate(models.models)
        ],
    )
