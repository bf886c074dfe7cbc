"""Shared pieces of the output-length predictors: clamping and the params reader.

Invariants every predictor keeps (``hetroute.types.OutputLengthPredictor``):

- ``predict`` returns an ``int`` in ``[1, max_tokens]`` when ``max_tokens`` is given, and ``>= 1``
  otherwise (:func:`clamp_prediction`);
- ``observe`` ignores impossible observations (negative counts) instead of raising, because it runs
  in the proxy's ``finally`` path where an exception would mask the real outcome.

Each predictor declares its parameters as a frozen dataclass (bounds in its annotations) read by
:func:`read_params` through :mod:`hetroute.fields`: :class:`hetroute.errors.ConfigError` names
``predictor.params.<field>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

from hetroute.errors import ConfigError
from hetroute.fields import AT_LEAST_ONE, as_int, as_list, read_dataclass

PARAMS_PATH = "predictor.params"
P = TypeVar("P")


def clamp_prediction(value: float, max_tokens: int | None) -> int:
    """Round ``value`` to an integer in ``[1, max_tokens]`` (``[1, ∞)`` without a limit)."""
    if not math.isfinite(value):
        value = 1.0
    out = max(1, int(round(value)))
    if max_tokens is not None and max_tokens >= 1:
        out = min(out, max_tokens)
    return out


def read_params(cls: type[P], params: Mapping[str, object]) -> P:
    """A predictor's frozen params dataclass ``cls`` read from ``predictor.params``
    (:func:`hetroute.fields.read_dataclass`): its fields are the valid parameters, with their defaults."""
    return read_dataclass(cls, params, PARAMS_PATH, what="parameter")


def read_edges(value: object, path: str) -> tuple[int, ...]:
    """A strictly increasing, non-empty list of positive integers (input-length bucket edges)."""
    edges: list[int] = []
    for i, item in enumerate(as_list(value, path, "integers")):
        edge = as_int(item, f"{path}[{i}]", AT_LEAST_ONE)
        if edges and edge <= edges[-1]:
            raise ConfigError(f"{path}[{i}]", "edges must be strictly increasing")
        edges.append(edge)
    return tuple(edges)
