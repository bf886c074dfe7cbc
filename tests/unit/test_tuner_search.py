"""Deployment choice: the separable argmax and the exact joint search, checked against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetroute.tuner.search import (
    OFF,
    JointConstraints,
    Option,
    SearchTooLarge,
    choose_separable,
    joint_search,
)


def _brute(options: list[list[Option]], prices: list[float], c: JointConstraints) -> float | None:
    allow_off = c.max_cost_per_hour is not None or c.demand_tokens_per_s is not None
    best: float | None = None
    for combo in itertools.product(*[list(o) + ([OFF] if allow_off or not o else []) for o in options]):
        if all(o.tp is None for o in combo):
            continue
        thr = sum(o.tokens_per_s for o in combo)
        if c.min_instances is not None and sum(o.instances for o in combo) < c.min_instances:
            continue
        cost = sum(p for o, p in zip(combo, prices, strict=True) if o.tp is not None)
        if c.max_cost_per_hour is not None and cost > c.max_cost_per_hour + 1e-9:
            continue
        if c.demand_tokens_per_s is not None:
            rho = min(o.rho_max for o in combo if o.tp is not None)
            if c.demand_tokens_per_s > rho * thr * (1 + 1e-12):
                continue
        if best is None or thr > best:
            best = thr
    return best


def test_joint_search_equals_brute_force_on_random_instances() -> None:
    rng = random.Random(7)
    for _ in range(150):
        kinds = [
            [
                Option(t, 8 // t, rng.uniform(1, 10), rng.choice([0.3, 0.5, 0.9, math.inf]))
                for t in (1, 2, 4, 8)
                if rng.random() < 0.8
            ]
            for _ in range(3)
        ]
        which = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        options = [kinds[k] for k in which]
        prices = [(1.0, 2.5, 4.0)[k] for k in which]
        c = JointConstraints(
            min_instances=rng.choice([None, 2, 5, 12, 30]),
            max_cost_per_hour=rng.choice([None, 3.0, 6.5, 100.0]),
            demand_tokens_per_s=rng.choice([None, 2.0, 8.0, 20.0]),
        )
        result = joint_search(options, list(prices), c)
        expected = _brute(options, prices, c)
        if expected is None:
            assert result.infeasible_reason is not None
        else:
            assert result.infeasible_reason is None
            assert result.total_tokens_per_s == pytest.approx(expected)
            # the reported choice really achieves the total and meets the constraints
            assert sum(o.tokens_per_s for o in result.choice) == pytest.approx(expected)
            if c.min_instances is not None:
                assert result.total_instances >= c.min_instances
            if c.max_cost_per_hour is not None:
                assert result.total_cost_per_hour <= c.max_cost_per_hour + 1e-9


def test_separable_choice_is_the_per_machine_argmax() -> None:
    a = [Option(1, 8, 100.0), Option(2, 4, 120.0), Option(4, 2, 110.0)]
    b = [Option(1, 2, 50.0), Option(2, 1, 40.0)]
    result = choose_separable([a, b], [None, None])
    assert [o.tp for o in result.choice] == [2, 1]
    assert result.total_tokens_per_s == 170.0
    assert result.total_instances == 6
    assert not result.joint


def test_separable_choice_with_no_feasible_option() -> None:
    result = choose_separable([[]], [None])
    assert result.choice == (OFF,)
    assert result.infeasible_reason is not None


def test_min_instances_forces_smaller_tp_on_the_cheapest_machine() -> None:
    # the best per-machine choice has 4 + 1 = 5 instances; 8 are needed. Switching machine 0 to TP1 costs
    # 20 tokens/s, switching machine 1 to TP1 costs 30: the optimum moves machine 0.
    m0 = [Option(1, 8, 100.0), Option(2, 4, 120.0)]
    m1 = [Option(1, 4, 60.0), Option(4, 1, 90.0)]
    result = joint_search([m0, m1], [None, None], JointConstraints(min_instances=9))
    assert [o.tp for o in result.choice] == [1, 4]
    assert result.total_tokens_per_s == 190.0
    assert result.joint


def test_budget_leaves_the_least_efficient_machine_unused() -> None:
    opts = [[Option(1, 1, 100.0)], [Option(1, 1, 90.0)], [Option(1, 1, 30.0)]]
    result = joint_search(opts, [10.0, 5.0, 5.0], JointConstraints(max_cost_per_hour=15.0))
    assert [o.tp for o in result.choice] == [1, 1, None]
    assert result.total_cost_per_hour == 15.0


def test_slo_excludes_options_without_headroom() -> None:
    # TP1 is faster but violates the SLO above rho 0.5; at demand 80 with thr 150, rho = 0.53 > 0.5.
    opts = [[Option(1, 8, 150.0, rho_max=0.5), Option(2, 4, 120.0, rho_max=0.9)]]
    result = joint_search(opts, [None], JointConstraints(demand_tokens_per_s=80.0))
    assert result.choice[0].tp == 2
    low = joint_search(opts, [None], JointConstraints(demand_tokens_per_s=70.0))
    assert low.choice[0].tp == 1


def test_budget_needs_prices() -> None:
    with pytest.raises(ValueError, match=r"machines\[0\] has no price_per_hour"):
        joint_search([[Option(1, 1, 1.0)]], [None], JointConstraints(max_cost_per_hour=1.0))


def test_state_budget_gives_a_clear_error() -> None:
    opts = [[Option(t, 8 // t, float(t) + k * 0.37) for t in (1, 2, 4, 8)] for k in range(30)]
    with pytest.raises(SearchTooLarge, match="state updates|DP cells"):
        joint_search(
            opts,
            [1.0 + k for k in range(30)],
            JointConstraints(min_instances=100, max_cost_per_hour=200.0),
            max_states=1000,
        )


def test_identical_machines_are_searched_as_one_class_quickly() -> None:
    opts = [[Option(1, 8, 100.0), Option(2, 4, 125.0), Option(4, 2, 110.0), Option(8, 1, 80.0)]] * 120
    result = joint_search(opts, [10.0] * 120, JointConstraints(min_instances=720, max_cost_per_hour=1000.0))
    # 100 machines fit the budget; with a at TP1 (8 instances) and the rest at TP2 (4):
    # 8a + 4(100 - a) >= 720  =>  a >= 80
    assert sum(1 for o in result.choice if o.tp is not None) == 100
    assert result.total_instances >= 720
    assert [o.tp for o in result.choice].count(1) == 80
    assert result.total_tokens_per_s == pytest.approx(80 * 100.0 + 20 * 125.0)
    assert result.elapsed_s < 5.0
