"""Routing policies: an explicit table keyed by the config's ``policy.type`` string.

Every policy is a pure decision over an immutable snapshot (``hetroute.types.Policy``),
in its own module, built by ``from_config(params, ctx)``. ``default`` is an alias for
:data:`DEFAULT_POLICY`, the policy hetroute uses when none is configured. The names alone (what
config validation needs) live in :mod:`hetroute.policy_names`, which loads no policy.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetroute.errors import ConfigError
from hetroute.policies import balanced_minmax, capacity_weighted, memory_minmax, single, workload_minmax
from hetroute.policies.base import PolicyContext, PolicyFactory
from hetroute.policies.cache_aware import CacheAware
from hetroute.policies.least_outstanding import LeastOutstanding
from hetroute.policies.prefix_scorer import PrefixScorer
from hetroute.policies.random_choice import RandomChoice
from hetroute.policies.round_robin import RoundRobin
from hetroute.policies.session_hash import SessionHash
from hetroute.policies.weighted_round_robin import WeightedRoundRobin
from hetroute.policy_names import DEFAULT_POLICY, policy_names, resolve_policy_name
from hetroute.types import Policy

POLICIES: dict[str, PolicyFactory] = {
    "round_robin": RoundRobin.from_config,
    "random": RandomChoice.from_config,
    "weighted_round_robin": WeightedRoundRobin.from_config,
    "least_outstanding": LeastOutstanding.from_config,
    "workload_minmax": workload_minmax.from_config,
    "memory_minmax": memory_minmax.from_config,
    "single": single.Single.from_config,
    "capacity_weighted": capacity_weighted.CapacityWeighted.from_config,
    "balanced_minmax": balanced_minmax.from_config,
    "cache_aware": CacheAware.from_config,
    "prefix_scorer": PrefixScorer.from_config,
    "session_hash": SessionHash.from_config,
}

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "PolicyContext",
    "build_policy",
    "policy_names",
    "resolve_policy_name",
]


def build_policy(name: str, params: Mapping[str, object], ctx: PolicyContext) -> Policy:
    """Build the policy ``name`` (or the ``default`` alias) with its validated params.

    Raises ConfigError naming ``policy.type`` for an unknown name (listing the valid ones)
    and ``policy.params.<field>`` for a bad parameter.
    """
    real = resolve_policy_name(name)
    factory = POLICIES.get(real)
    if factory is None:
        raise ConfigError("policy.type", f"unknown policy {name!r}; valid: {', '.join(policy_names())}")
    return factory(params, ctx)
