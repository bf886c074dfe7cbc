"""Shared pieces of the output-length predictors: clamping and config-param readers.

Invariants every predictor keeps (``hetroute.types.OutputLengthPredictor``):

- ``predict`` returns an ``int`` in ``[1, max_tokens]`` when ``max_tokens`` is given, and ``>= 1``
  otherwise (:func:`clamp_prediction`);
- ``observe`` ignores impossible observations (negative counts) instead of raising, because it runs
  in the proxy's ``finally`` path where an exception would mask the real outcome.

Param readers raise :class:`hetroute.errors.ConfigError` naming ``predictor.params.<field>``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from hetroute.errors import ConfigError

PARAMS_PATH = "predictor.params"


def clamp_prediction(value: float, max_tokens: int | None) -> int:
    """Round ``value`` to an integer in ``[1, max_tokens]`` (``[1, ∞)`` without a limit)."""
    if not math.isfinite(value):
        value = 1.0
    out = max(1, int(round(value)))
    if max_tokens is not None and max_tokens >= 1:
        out = min(out, max_tokens)
    return out


def check_known(params: Mapping[str, object], known: Collection[str]) -> None:
    """Reject parameters a predictor does not define (typos must not pass silently)."""
    for key in params:
        if key not in known:
            expected = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"{PARAMS_PATH}.{key}", f"unknown parameter (expected one of: {expected})")


def read_float(
    params: Mapping[str, object],
    key: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_min: bool = False,
    exclusive_max: bool = False,
) -> float:
    """A finite number from ``params[key]`` (``default`` when absent), range-checked."""
    raw = params.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(float(raw)):
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"expected a finite number, got {raw!r}")
    value = float(raw)
    if minimum is not None and (value < minimum or (exclusive_min and value == minimum)):
        op = ">" if exclusive_min else ">="
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"must be {op} {minimum}, got {value!r}")
    if maximum is not None and (value > maximum or (exclusive_max and value == maximum)):
        op = "<" if exclusive_max else "<="
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"must be {op} {maximum}, got {value!r}")
    return value


def read_int(params: Mapping[str, object], key: str, default: int, *, minimum: int = 1) -> int:
    """An integer ``>= minimum`` from ``params[key]`` (``default`` when absent)."""
    raw = params.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"expected an integer, got {raw!r}")
    if raw < minimum:
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"must be >= {minimum}, got {raw!r}")
    return raw


def read_bool(params: Mapping[str, object], key: str, default: bool) -> bool:
    """A boolean from ``params[key]`` (``default`` when absent)."""
    raw = params.get(key, default)
    if not isinstance(raw, bool):
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"expected true or false, got {raw!r}")
    return raw


def read_edges(params: Mapping[str, object], key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A strictly increasing list of positive integers (input-length bucket edges)."""
    raw = params.get(key, list(default))
    if not isinstance(raw, list | tuple) or not raw:
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"expected a non-empty list of integers, got {raw!r}")
    edges: list[int] = []
    for i, item in enumerate(raw):
        if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
            raise ConfigError(f"{PARAMS_PATH}.{key}[{i}]", f"expected a positive integer, got {item!r}")
        if edges and item <= edges[-1]:
            raise ConfigError(f"{PARAMS_PATH}.{key}[{i}]", "edges must be strictly increasing")
        edges.append(item)
    return tuple(edges)
