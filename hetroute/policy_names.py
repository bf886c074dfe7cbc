"""The valid ``policy.type`` names, known without loading a single policy.

Owns :data:`POLICY_NAMES`, :data:`DEFAULT_POLICY` (the policy behind the ``default`` alias),
:func:`policy_names` and :func:`resolve_policy_name`. Configuration (``hetroute.config``,
``hetroute.tuner.cluster``) validates ``policy.type`` against these names and so does not import
:mod:`hetroute.policies`, whose table builds the policies.

Invariant: :data:`POLICY_NAMES` are exactly the keys of ``hetroute.policies.POLICIES``
(``tests/unit/test_policies_classic.py`` checks it); adding a policy means adding its name here too.
"""

from __future__ import annotations

POLICY_NAMES: tuple[str, ...] = (
    "balanced_minmax",
    "cache_aware",
    "capacity_weighted",
    "least_outstanding",
    "memory_minmax",
    "prefix_scorer",
    "random",
    "round_robin",
    "session_hash",
    "single",
    "weighted_round_robin",
    "workload_minmax",
)
"""Every registered policy, sorted."""

DEFAULT_POLICY = "balanced_minmax"
"""The policy behind the ``default`` alias."""


def policy_names() -> tuple[str, ...]:
    """Every valid ``policy.type``, including the ``default`` alias."""
    return ("default", *sorted(POLICY_NAMES))


def resolve_policy_name(name: str) -> str:
    """Map ``default`` to the real policy name; other names pass through."""
    return DEFAULT_POLICY if name == "default" else name
