"""Table-driven tests of the classic policies on built snapshots."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hetroute.errors import ConfigError
from hetroute.policies import DEFAULT_POLICY, PolicyContext, build_policy, policy_names
from tests.unit.snapshots import features, snapshot, spec

ALL = np.array([0, 1, 2], dtype=np.int64)


def test_round_robin_cycles_candidates() -> None:
    bs = (spec("a"), spec("b"), spec("c"))
    p = build_policy("round_robin", {}, PolicyContext(bs))
    snap = snapshot(bs)
    assert [p.choose(features(), snap, ALL).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert {p.choose(features(), snap, np.array([2])).index for _ in range(3)} == {2}


@pytest.mark.parametrize(
    ("weights", "expected"),
    [({"a": 4, "b": 1}, [0, 0, 1, 0, 0]), ({"a": 1, "b": 1}, [0, 1, 0, 1, 0]), ([2, 3], [1, 0, 1, 0, 1])],
)
def test_smooth_wrr_sequence(weights: object, expected: list[int]) -> None:
    bs = (spec("a"), spec("b"))
    p = build_policy("weighted_round_robin", {"weights": weights}, PolicyContext(bs))
    snap = snapshot(bs)
    assert [p.choose(features(), snap, np.array([0, 1])).index for _ in range(5)] == expected


def test_wrr_uses_backend_weight_by_default() -> None:
    bs = (spec("a", weight=3), spec("b", weight=1))
    p = build_policy("weighted_round_robin", {}, PolicyContext(bs))
    counts = Counter(p.choose(features(), snapshot(bs), np.array([0, 1])).index for _ in range(400))
    assert counts == {0: 300, 1: 100}


def test_random_is_seeded_and_covers_candidates() -> None:
    bs = (spec("a"), spec("b"), spec("c"))
    seq1 = [
        build_policy("random", {"seed": 3}, PolicyContext(bs)).choose(features(), snapshot(bs), ALL).index
        for _ in range(1)
    ]
    p1 = build_policy("random", {"seed": 3}, PolicyContext(bs))
    p2 = build_policy("random", {"seed": 3}, PolicyContext(bs))
    a = [p1.choose(features(), snapshot(bs), ALL).index for _ in range(50)]
    b = [p2.choose(features(), snapshot(bs), ALL).index for _ in range(50)]
    assert a == b and set(a) == {0, 1, 2} and seq1[0] == a[0]


def test_p2c_never_picks_the_busiest_of_three_when_two_are_drawn() -> None:
    bs = (spec("a"), spec("b"), spec("c"))
    p = build_policy("least_outstanding", {"seed": 1}, PolicyContext(bs))
    snap = snapshot(bs, in_flight=[9, 0, 5])
    picks = Counter(p.choose(features(), snap, ALL).index for _ in range(300))
    assert picks[0] == 0  # the busiest only wins if drawn against itself, impossible with distinct draws
    assert picks[1] > picks[2]


def test_weighted_least_request_formula() -> None:
    bs = (spec("big", weight=4), spec("small", weight=1))
    p = build_policy("least_outstanding", {}, PolicyContext(bs))
    # effective = w/(active+1): big 4/(3+1)=1.0 vs small 1/(0+1)=1.0 -> tie; big 4/(4+1)=0.8 < 1 -> small
    assert p.choose(features(), snapshot(bs, in_flight=[4, 0]), np.array([0, 1])).index == 1
    assert p.choose(features(), snapshot(bs, in_flight=[2, 0]), np.array([0, 1])).index == 0


def test_unknown_policy_and_bad_params_name_the_field() -> None:
    bs = (spec("a"),)
    with pytest.raises(ConfigError, match="policy.type: unknown policy 'nope'; valid: default"):
        build_policy("nope", {}, PolicyContext(bs))
    with pytest.raises(ConfigError, match=r"policy.params.bias: must be >= 0"):
        build_policy("least_outstanding", {"bias": -1}, PolicyContext(bs))
    with pytest.raises(ConfigError, match=r"policy.params.weights.zz: no backend named"):
        build_policy("weighted_round_robin", {"weights": {"zz": 1}}, PolicyContext(bs))
    with pytest.raises(ConfigError, match=r"policy.params.colour: unknown parameter"):
        build_policy("round_robin", {"colour": 1}, PolicyContext(bs))


def test_default_alias_resolves() -> None:
    bs = (spec("a"), spec("b"))
    assert build_policy("default", {}, PolicyContext(bs)).name == DEFAULT_POLICY
    assert "default" in policy_names()
