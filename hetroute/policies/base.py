"""Shared pieces of every policy: the construction context, the params reader and the seeded tie-break.

Each policy declares its parameters as a frozen dataclass (bounds in its annotations) and reads it with
:func:`read_params`, through the one validation layer :mod:`hetroute.fields`, so a bad config fails at
start-up with :class:`~hetroute.errors.ConfigError` naming the field (``policy.params.theta``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hetroute.errors import ConfigError
from hetroute.fields import POSITIVE, as_number, read_dataclass
from hetroute.types import BackendSpec, IntArray, Policy

if TYPE_CHECKING:
    from hetroute.policies.backend_model import BackendModels

PARAMS_PATH = "policy.params"
P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy factory may use: the configured backends, a seed for its RNG, and the backends'
    resolved static latency models when the composition root already built them (else the policy
    builds its own: ``BackendModels.from_specs``)."""

    backends: tuple[BackendSpec, ...]
    seed: int = 0
    backend_models: BackendModels | None = None


PolicyFactory = Callable[[Mapping[str, object], PolicyContext], Policy]


def read_params(
    cls: type[P],
    params: Mapping[str, object],
    policy: str,
    *,
    base: P | None = None,
    exclude: Collection[str] = (),
) -> P:
    """A policy's frozen params dataclass ``cls`` read from ``policy.params`` (``fields.read_dataclass``):
    its fields are the valid parameters; ``base`` (else the dataclass defaults) gives the defaults."""
    return read_dataclass(
        cls, params, PARAMS_PATH, base=base, exclude=exclude, what=f"parameter for policy {policy!r}"
    )


def seeded_rng(seed: int | None, ctx: PolicyContext) -> random.Random:
    """The policy's RNG: its own ``seed`` parameter, else the router's seed."""
    return random.Random(ctx.seed if seed is None else seed)


def read_backend_weights(raw: object, ctx: PolicyContext, key: str = "weights") -> tuple[float, ...]:
    """Per-backend weights from the parameter ``key`` (its value ``raw``): {backend name: weight} or a list
    in backend order; missing names take ``BackendSpec.weight``. Every weight must be > 0."""
    weights = [b.weight for b in ctx.backends]
    names = [b.name for b in ctx.backends]
    if raw is None:
        pass
    elif isinstance(raw, Mapping):
        for name, w in raw.items():
            if name not in names:
                raise ConfigError(f"{PARAMS_PATH}.{key}.{name}", f"no backend named {name!r}")
            weights[names.index(str(name))] = as_number(w, f"{PARAMS_PATH}.{key}.{name}", POSITIVE)
    elif isinstance(raw, list | tuple):
        if len(raw) != len(names):
            raise ConfigError(
                f"{PARAMS_PATH}.{key}", f"expected {len(names)} weights (one per backend), got {len(raw)}"
            )
        weights = [as_number(w, f"{PARAMS_PATH}.{key}[{i}]", POSITIVE) for i, w in enumerate(raw)]
    else:
        raise ConfigError(f"{PARAMS_PATH}.{key}", "expected a mapping of backend name to weight, or a list")
    for i, w in enumerate(weights):
        if not w > 0:
            raise ConfigError(f"backends[{i}].weight", f"must be > 0, got {w}")
    return tuple(float(w) for w in weights)


def seeded_choice(rng: random.Random, candidates: IntArray) -> int:
    """A uniformly random candidate from an injected RNG (the tie-break of last resort)."""
    return int(candidates[rng.randrange(len(candidates))])
