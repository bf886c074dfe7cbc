"""Shared pieces of every policy: the construction context, typed parameter readers and
the seeded tie-break.

Parameter readers raise :class:`~hetroute.errors.ConfigError` with the field path
(``policy.params.theta``) so a bad config fails at start-up naming the field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetroute.errors import ConfigError
from hetroute.types import BackendSpec, IntArray, Policy

if TYPE_CHECKING:
    from hetroute.policies.backend_model import BackendModels

PARAMS_PATH = "policy.params"


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy factory may use: the configured backends, a seed for its RNG, and the backends'
    resolved static latency models when the composition root already built them (else the policy
    builds its own: ``BackendModels.from_specs``)."""

    backends: tuple[BackendSpec, ...]
    seed: int = 0
    backend_models: BackendModels | None = None


PolicyFactory = Callable[[Mapping[str, object], PolicyContext], Policy]


def check_known(params: Mapping[str, object], allowed: tuple[str, ...], policy: str) -> None:
    """Reject parameters the policy does not know, naming the first one."""
    for key in params:
        if key not in allowed:
            valid = ", ".join(allowed) if allowed else "none"
            raise ConfigError(
                f"{PARAMS_PATH}.{key}", f"unknown parameter for policy {policy!r} (valid: {valid})"
            )


def read_float(
    params: Mapping[str, object],
    key: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """A finite number parameter within [minimum, maximum]."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"expected a finite number, got {value!r}")
    v = float(value)
    if minimum is not None and v < minimum:
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"must be <= {maximum}, got {v}")
    return v


def read_int(params: Mapping[str, object], key: str, default: int, *, minimum: int | None = None) -> int:
    """An integer parameter >= minimum."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{PARAMS_PATH}.{key}", f"must be >= {minimum}, got {value}")
    return value


def read_backend_weights(
    params: Mapping[str, object], ctx: PolicyContext, key: str = "weights"
) -> tuple[float, ...]:
    """Per-backend weights: ``params[key]`` as {backend name: weight} or a list in backend
    order; missing names take ``BackendSpec.weight``. Every weight must be > 0."""
    raw = params.get(key)
    weights = [b.weight for b in ctx.backends]
    names = [b.name for b in ctx.backends]
    if raw is None:
        pass
    elif isinstance(raw, Mapping):
        for name, w in raw.items():
            if name not in names:
                raise ConfigError(f"{PARAMS_PATH}.{key}.{name}", f"no backend named {name!r}")
            weights[names.index(str(name))] = _positive(w, f"{PARAMS_PATH}.{key}.{name}")
    elif isinstance(raw, list | tuple):
        if len(raw) != len(names):
            raise ConfigError(
                f"{PARAMS_PATH}.{key}", f"expected {len(names)} weights (one per backend), got {len(raw)}"
            )
        weights = [_positive(w, f"{PARAMS_PATH}.{key}[{i}]") for i, w in enumerate(raw)]
    else:
        raise ConfigError(f"{PARAMS_PATH}.{key}", "expected a mapping of backend name to weight, or a list")
    for i, w in enumerate(weights):
        if not w > 0:
            raise ConfigError(f"backends[{i}].weight", f"must be > 0, got {w}")
    return tuple(float(w) for w in weights)


def _positive(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not float(value) > 0:
        raise ConfigError(path, f"expected a number > 0, got {value!r}")
    return float(value)


def seeded_choice(rng: random.Random, candidates: IntArray) -> int:
    """A uniformly random candidate from an injected RNG (the tie-break of last resort)."""
    return int(candidates[rng.randrange(len(candidates))])
