"""The paper's reproduction predictor: a seeded random draw from a normal distribution.

Xiong et al. §5.2 predict every output length as ``numpy.random.normal(μ, σ)`` with μ and σ
taken from a sample of the dataset, ignoring the request (seeds-notes E9). hetroute keeps it
only to reproduce the paper, and fixes what it left open: the draw is rounded, clamped to
``[1, max_tokens]`` (method.md §6) and comes from an injected, seeded generator, so two runs with
the same seed predict the same sequence.

Params: ``mean_tokens`` (μ, default 200: ShareGPT-like output mean, calibration.md),
``std_tokens`` (σ ≥ 0, default 150). ``observe`` does nothing: the paper's predictor does not learn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from hetroute.fields import NonNegativeFloat, Range
from predictors.base import clamp_prediction, read_params

DEFAULT_MEAN_TOKENS = 200.0
DEFAULT_STD_TOKENS = 150.0


@dataclass(frozen=True, slots=True)
class NormalParams:
    """``predictor.params`` of ``normal``: N(μ, σ) in tokens."""

    mean_tokens: Annotated[float, Range(minimum=1)] = DEFAULT_MEAN_TOKENS
    std_tokens: NonNegativeFloat = DEFAULT_STD_TOKENS


class NormalPredictor:
    """Predict ``clamp(round(N(μ, σ)), 1, max_tokens)`` with a seeded generator."""

    name = "normal"

    def __init__(self, mean_tokens: float, std_tokens: float, seed: int) -> None:
        if std_tokens < 0:
            raise ValueError(f"std_tokens must be >= 0, got {std_tokens}")
        self.mean_tokens = mean_tokens
        self.std_tokens = std_tokens
        self._rng = np.random.default_rng(seed)

    @classmethod
    def from_params(cls, params: Mapping[str, object], seed: int) -> NormalPredictor:
        p = read_params(NormalParams, params)
        return cls(p.mean_tokens, p.std_tokens, seed)

    def predict(self, model: str, input_tokens: int, max_tokens: int | None) -> int:
        draw = float(self._rng.normal(self.mean_tokens, self.std_tokens))
        return clamp_prediction(draw, max_tokens)

    def observe(self, model: str, input_tokens: int, output_tokens: int, cut: bool = False) -> None:
        return None
