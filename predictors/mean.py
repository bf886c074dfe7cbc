"""A deterministic mean predictor: the dataset mean, optionally learned per model.

Prediction for model m (seeds-notes E9, method.md §6):

    Õ = clamp(mean_m, 1, max_tokens),   mean_m = Σ observed_m / n_m   once n_m ≥ min_samples,
                                         mean_tokens (the configured prior) before that.

With ``learn: false`` it always answers ``mean_tokens`` (the paper's μ without the random draw).
State: one running sum and count per model, updated by ``observe`` (completed requests'
``usage.completion_tokens``). Params: ``mean_tokens`` (default 200), ``learn`` (default true),
``min_samples`` (default 10).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

from hetroute.fields import PositiveInt, Range
from predictors.base import clamp_prediction, read_params

DEFAULT_MEAN_TOKENS = 200.0


@dataclass(frozen=True, slots=True)
class MeanParams:
    """``predictor.params`` of ``mean``."""

    mean_tokens: Annotated[float, Range(minimum=1)] = DEFAULT_MEAN_TOKENS
    learn: bool = True
    min_samples: PositiveInt = 10


class MeanPredictor:
    """Answer the (learned) mean output length of the model, clamped to ``max_tokens``."""

    name = "mean"

    def __init__(self, mean_tokens: float, *, learn: bool = True, min_samples: int = 10) -> None:
        if mean_tokens < 1:
            raise ValueError(f"mean_tokens must be >= 1, got {mean_tokens}")
        self.mean_tokens = mean_tokens
        self.learn = learn
        self.min_samples = max(1, min_samples)
        self._sum: dict[str, float] = {}
        self._count: dict[str, int] = {}

    @classmethod
    def from_params(cls, params: Mapping[str, object], seed: int) -> MeanPredictor:
        p = read_params(MeanParams, params)
        return cls(p.mean_tokens, learn=p.learn, min_samples=p.min_samples)

    def current_mean(self, model: str) -> float:
        """The mean this predictor answers for ``model`` before clamping."""
        n = self._count.get(model, 0)
        if not self.learn or n < self.min_samples:
            return self.mean_tokens
        return self._sum[model] / n

    def predict(self, model: str, input_tokens: int, max_tokens: int | None) -> int:
        return clamp_prediction(self.current_mean(model), max_tokens)

    def observe(self, model: str, input_tokens: int, output_tokens: int, cut: bool = False) -> None:
        """Add the output to the model's mean; an output ``cut`` by the full context window only when it
        is at least the current mean (the true length, at least as long, is then above it too)."""
        if not self.learn or output_tokens < 0:
            return
        if cut and output_tokens < self.current_mean(model):
            return
        self._sum[model] = self._sum.get(model, 0.0) + float(output_tokens)
        self._count[model] = self._count.get(model, 0) + 1
