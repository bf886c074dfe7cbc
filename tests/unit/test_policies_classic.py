"""Table-driven tests of the classic policies on built snapshots."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from hetroute.errors import ConfigError
from hetroute.policies import DEFAULT_POLICY, POLICIES, PolicyContext, build_policy, policy_names
from hetroute.policy_names import POLICY_NAMES
from hetroute.types import BackendSpec, Policy
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


def _picks(policy: Policy, bs: tuple[BackendSpec, ...], in_flight: list[int], n: int) -> list[int]:
    snap = snapshot(bs, in_flight=in_flight)
    return [policy.choose(features(), snap, np.array([0, 1])).index for _ in range(n)]


def test_weighted_least_request_without_load_splits_as_the_weights() -> None:
    bs = (spec("big", weight=3), spec("small", weight=1))
    p = build_policy("least_outstanding", {}, PolicyContext(bs))
    assert _picks(p, bs, [0, 0], 4) == [0, 0, 1, 0]  # smooth: 3 of every 4, interleaved
    assert Counter(_picks(p, bs, [0, 0], 400)) == {0: 300, 1: 100}


def test_weighted_least_request_is_a_schedule_not_an_argmax() -> None:
    # effective = w/(active+1): big 4/(4+1) = 0.8, small 1/(0+1) = 1.0. An argmax would send every
    # request to small; Envoy's weighted round robin over the effective weights splits 0.8 : 1.
    bs = (spec("big", weight=4), spec("small", weight=1))
    p = build_policy("least_outstanding", {}, PolicyContext(bs))
    assert Counter(_picks(p, bs, [4, 0], 900)) == {0: 400, 1: 500}


def test_weighted_least_request_load_takes_share_from_the_loaded_backend() -> None:
    bs = (spec("a", weight=2), spec("b", weight=1))
    idle = Counter(_picks(build_policy("least_outstanding", {}, PolicyContext(bs)), bs, [0, 0], 600))
    assert idle == {0: 400, 1: 200}
    # a has 9 in flight: 2/10 = 0.2 against 1/1 = 1.0, so 1 : 5, yet a is never starved
    loaded = Counter(_picks(build_policy("least_outstanding", {}, PolicyContext(bs)), bs, [9, 0], 600))
    assert loaded == {0: 100, 1: 500}
    # a larger bias lowers the loaded backend's weight more: 2/10^2 = 0.02 against 1
    strong = build_policy("least_outstanding", {"bias": 2.0}, PolicyContext(bs))
    assert Counter(_picks(strong, bs, [9, 0], 510)) == {0: 10, 1: 500}


def test_weighted_least_request_with_bias_zero_is_weighted_round_robin() -> None:
    bs = (spec("a", weight=4), spec("b", weight=1))
    lo = build_policy("least_outstanding", {"bias": 0.0}, PolicyContext(bs))
    wrr = build_policy("weighted_round_robin", {}, PolicyContext(bs))
    assert _picks(lo, bs, [30, 0], 50) == _picks(wrr, bs, [0, 0], 50)


def test_weighted_least_request_follows_load_as_it_changes() -> None:
    # requests never finish: each pick adds one in flight. Each backend's pick rate follows its
    # effective weight, d(a)/d(b) = 3(b+1)/(a+1), so (a+1)^2 ~ 3(b+1)^2: the loaded share shrinks
    # as load grows, but slower than an argmax (which would hold (a+1) = 3(b+1)).
    bs = (spec("a", weight=3), spec("b", weight=1))
    p = build_policy("least_outstanding", {"seed": 4}, PolicyContext(bs))
    in_flight = [0, 0]
    for _ in range(398):
        in_flight[p.choose(features(), snapshot(bs, in_flight=in_flight), np.array([0, 1])).index] += 1
    assert (in_flight[0] + 1) / (in_flight[1] + 1) == pytest.approx(math.sqrt(3), abs=0.03)


def test_weighted_least_request_is_deterministic() -> None:
    bs = (spec("a", weight=2), spec("b", weight=5), spec("c", weight=1))
    loads = [[i % 3, (i * 7) % 5, i % 2] for i in range(60)]
    runs = []
    for _ in range(2):
        p = build_policy("least_outstanding", {"seed": 9}, PolicyContext(bs))
        runs.append([p.choose(features(), snapshot(bs, in_flight=load), ALL).index for load in loads])
    assert runs[0] == runs[1] and set(runs[0]) == {0, 1, 2}


def test_equal_weights_among_the_candidates_use_p2c() -> None:
    bs = (spec("a", weight=2), spec("b", weight=2), spec("c", weight=7))
    p = build_policy("least_outstanding", {"seed": 2}, PolicyContext(bs))
    snap = snapshot(bs, in_flight=[5, 0, 0])
    picks = Counter(p.choose(features(), snap, np.array([0, 1])).index for _ in range(50))
    assert picks == {1: 50}  # two candidates, both drawn: the idle one always wins


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


def test_the_names_config_validates_against_are_the_registry() -> None:
    """hetroute.policy_names lists the names without loading the policies; it must match the table."""
    assert tuple(sorted(POLICIES)) == POLICY_NAMES
