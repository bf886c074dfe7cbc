"""Output-length predictors (method.md §6), chosen by name in config.

``PREDICTORS`` is the explicit registry keyed by the YAML ``predictor.type`` string; each entry
builds a fresh predictor from its params and a seed. ``build_predictor`` validates the name and
the params and raises :class:`hetroute.errors.ConfigError` naming ``predictor.type`` or
``predictor.params.<field>``. ``"default"`` is an alias for :data:`DEFAULT_PREDICTOR`.

- ``normal``: the paper's seeded random draw from N(μ, σ) (reproduction mode only);
- ``mean``: the dataset mean, learned per model from completed requests;
- ``online``: a quantile of recent outputs per (model, input-length bucket) (the default).

Every prediction is an integer in ``[1, max_tokens]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hetroute.errors import ConfigError
from hetroute.types import OutputLengthPredictor
from predictors.mean import MeanPredictor
from predictors.normal import NormalPredictor
from predictors.online import OnlineQuantilePredictor

PredictorFactory = Callable[[Mapping[str, object], int], OutputLengthPredictor]

PREDICTORS: dict[str, PredictorFactory] = {
    "normal": NormalPredictor.from_params,
    "mean": MeanPredictor.from_params,
    "online": OnlineQuantilePredictor.from_params,
}

DEFAULT_PREDICTOR = "online"
"""Used when the config names no predictor (or names ``default``)."""

__all__ = [
    "DEFAULT_PREDICTOR",
    "PREDICTORS",
    "MeanPredictor",
    "NormalPredictor",
    "OnlineQuantilePredictor",
    "PredictorFactory",
    "build_predictor",
]


def build_predictor(name: str, params: Mapping[str, object], seed: int) -> OutputLengthPredictor:
    """A new predictor ``name`` configured by ``params``; ConfigError naming the bad field."""
    resolved = DEFAULT_PREDICTOR if name == "default" else name
    factory = PREDICTORS.get(resolved)
    if factory is None:
        expected = ", ".join(["default", *sorted(PREDICTORS)])
        raise ConfigError("predictor.type", f"unknown predictor {name!r} (expected one of: {expected})")
    return factory(params, seed)  # each factory reads its params through hetroute.fields
