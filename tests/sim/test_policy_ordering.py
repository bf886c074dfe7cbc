"""Qualitative policy ordering on seeded simulations of paper §5 A (method.md §8 A).

Each run drives the real Router, policy, Ledger and predictor through the simulator, so these tests
fail when a policy, the ledger accounting or the backend model regresses. Thresholds are looser
than what ``benchmarks/policies.py`` measures (docs/policies.md), so that they check the ordering,
not a particular seed's luck.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import pytest

from hetroute.policies import DEFAULT_POLICY
from hetroute.sim.cluster_file import Fleet, build_fleet
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import SimRequest, generate_workload
from hetroute.simulation.simulator import SimResult, run_simulation
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision

SEED = 5
Runner = Callable[..., SimResult]


@pytest.fixture(scope="module")
def run() -> Runner:
    fleet: Fleet = build_fleet(get_scenario("paper-a").cluster())
    cache: dict[tuple[str, str, float, int], SimResult] = {}

    def go(policy: str, rate: float, n: int = 4000, params: Mapping[str, object] | None = None) -> SimResult:
        key = (policy, repr(sorted((params or {}).items())), rate, n)
        if key not in cache:
            work = generate_workload("sharegpt", n, rate, SEED, fleet.max_model_len())
            cache[key] = run_simulation(fleet, work, policy, dict(params or {}), seed=SEED)
            assert cache[key].ledger_zero, f"{policy} left load in the ledger"
            assert cache[key].completed == n
        return cache[key]

    return go


def finish_spread_s(r: SimResult) -> float:
    times = [i.completion_time_s for i in r.instances if i.requests > 0]
    return max(times) - min(times)


def test_default_is_the_balanced_minmax_policy() -> None:
    assert DEFAULT_POLICY == "balanced_minmax"


def test_default_clearly_beats_round_robin_once_the_weak_instance_saturates(run: Runner) -> None:
    # At 24 req/s round robin sends 12 req/s to the TP1 instance, more than it can serve.
    default, rr = run("default", 24.0), run("round_robin", 24.0)
    assert default.throughput_tokens_per_s >= 1.10 * rr.throughput_tokens_per_s
    assert default.percentile("ttft", 99) < 0.2 * rr.percentile("ttft", 99)


def test_paper_scheduler_beats_round_robin_at_24(run: Runner) -> None:
    os_, rr = run("workload_minmax", 24.0), run("round_robin", 24.0)
    assert os_.throughput_tokens_per_s >= 1.05 * rr.throughput_tokens_per_s


def test_default_reaches_the_capacity_bound_and_balances_finish_times_at_saturation(run: Runner) -> None:
    default = run("default", math.inf)
    bound = sum(
        run("single", math.inf, params={"backend": name}).throughput_tokens_per_s
        for name in ("v100-tp4", "v100-tp1")
    )
    assert default.throughput_tokens_per_s >= 0.93 * bound
    paper = run("workload_minmax", math.inf)
    assert default.throughput_tokens_per_s > paper.throughput_tokens_per_s
    # the paper's formula leaves the instances finishing at visibly different times; we do not
    assert finish_spread_s(default) < 0.1 * default.makespan_s < finish_spread_s(paper)


def test_default_keeps_light_load_on_the_fast_instance(run: Runner) -> None:
    default, wrr = run("default", 8.0, n=800), run("weighted_round_robin", 8.0, n=800)
    on_fast = next(i.requests for i in default.instances if i.name == "v100-tp4")
    assert on_fast >= 0.9 * 800
    assert default.percentile("ttft", 99) < wrr.percentile("ttft", 99)
    assert default.throughput_tokens_per_s >= wrr.throughput_tokens_per_s


class Probe:
    """A test policy: always the first candidate; records the snapshot the router showed it."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: list[ClusterSnapshot] = []

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        self.seen.append(snapshot)
        return RoutingDecision(index=int(candidates[0]), reason="probe")


def test_the_simulator_clears_pending_prefill_at_the_first_token() -> None:
    fleet = build_fleet(get_scenario("paper-a").cluster())
    work = [
        SimRequest("a", 0.0, 100, 1000),  # still decoding at t = 5 s
        SimRequest("b", 0.0, 300, 5),  # dispatched before "a" has its first token; done by t = 5 s
        SimRequest("c", 5.0, 10, 5),
    ]
    probe = Probe()
    res = run_simulation(fleet, work, probe, predictor="mean")
    assert res.ledger_zero and res.completed == 3
    at_b, at_c = probe.seen[1], probe.seen[2]
    assert at_b.prefill_pending_tokens.tolist() == [100.0, 0.0]  # "a" waits for its first token
    assert at_c.input_tokens_in_flight.tolist() == [100.0, 0.0]  # "a" is still in flight ...
    assert at_c.prefill_pending_tokens.tolist() == [0.0, 0.0]  # ... but no longer pending prefill


@pytest.fixture(scope="module")
def paper_b() -> Fleet:
    return build_fleet(get_scenario("paper-b").cluster())


def _ttft_p99(fleet: Fleet, policy: str, rate: float, params: Mapping[str, object] | None = None) -> float:
    work = generate_workload("sharegpt", 2000, rate, SEED, fleet.max_model_len())
    res = run_simulation(fleet, work, policy, dict(params or {}), seed=SEED)
    assert res.ledger_zero and res.completed == 2000
    return res.percentile("ttft", 99)


def test_prefill_terms_of_the_floor_cut_the_ttft_tail_on_paper_b(paper_b: Fleet) -> None:
    # Without them the default keeps long prompts on the V100 pairs (faster decode, slower prefill)
    # and queues prompts behind each other; with them its p99 TTFT drops below the old floor's.
    old = {"prefill_queue": False, "ttft_weight": 0.0}
    assert _ttft_p99(paper_b, "default", 24.0) < 0.95 * _ttft_p99(paper_b, "default", 24.0, old)
    assert _ttft_p99(paper_b, "default", 16.0) <= _ttft_p99(paper_b, "round_robin", 16.0)
