"""Live learning in the simulator (the gateway's own code, virtual time): nothing known, a wrong prior,
drift, and bounded exploration."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hetroute.latency import LatencyParams
from hetroute.learning.settings import LearningConfig
from hetroute.policies.backend_model import BackendModels
from hetroute.sim.cluster_file import Fleet, blind_fleet, build_fleet
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import generate_workload
from hetroute.simulation.run import Slowdown
from hetroute.simulation.simulator import run_simulation


@pytest.fixture(scope="module")
def paper_a() -> Fleet:
    return build_fleet(get_scenario("paper-a").cluster())


def nothing_known(fleet: Fleet) -> Fleet:
    """What a new user's `hetroute serve` knows of an engine serving a house model name: its URL."""
    return blind_fleet(fleet)


def wrong_prior(fleet: Fleet, factors: tuple[float, ...]) -> Fleet:
    """Every backend's profile is its true (roofline) model with all times scaled by ``factors[i]``."""
    truth = BackendModels.from_specs(fleet.backends)
    out = []
    for b, model, f in zip(fleet.backends, truth.models, factors, strict=True):
        from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
        from hetroute.prior import roofline_prior_profile

        profile = roofline_prior_profile(
            lookup_gpu(load_gpu_catalog(), b.gpu or ""),
            lookup_model(load_model_catalog(), b.models[0]),
            b.tp or 1,
        )
        scaled = LatencyParams(*(v * f for v in model.params.as_tuple()))
        out.append(replace(b, profile=replace(profile, params=scaled)))
    return replace(fleet, backends=tuple(out))


def test_nothing_known_learns_its_way_to_the_profiled_throughput_and_tails(paper_a: Fleet) -> None:
    workload = generate_workload("sharegpt", 1500, 24.0, 1, paper_a.max_model_len())
    known = run_simulation(paper_a, workload, "default", seed=1)
    blind = run_simulation(nothing_known(paper_a), workload, "default", seed=1)
    learned = run_simulation(nothing_known(paper_a), workload, "default", seed=1, learning=LearningConfig())
    assert learned.ledger_zero and learned.completed == known.completed
    # Without learning the neutral default loses (issue 9's measurement); with it, it is back.
    assert blind.percentile("e2e", 99) > 1.5 * known.percentile("e2e", 99)
    assert learned.throughput_tokens_per_s >= 0.97 * known.throughput_tokens_per_s
    assert learned.percentile("e2e", 99) <= 1.2 * known.percentile("e2e", 99)
    assert learned.percentile("ttft", 99) <= 1.2 * known.percentile("ttft", 99)
    assert learned.learned is not None and learned.learned.prior_of(0).kind == "neutral"


def test_non_streaming_clients_teach_the_learner_from_whole_answers_only(paper_a: Fleet) -> None:
    """A non-streaming answer shows the router no first token and no tokens before its end (the
    simulator models that client as the gateway sees it): the learner fits on e2e alone and still
    recovers the profiled throughput."""
    workload = generate_workload("sharegpt", 1500, 24.0, 1, paper_a.max_model_len())
    whole = [replace(r, stream=False) for r in workload]
    known = run_simulation(paper_a, workload, "default", seed=1)
    learned = run_simulation(nothing_known(paper_a), whole, "default", seed=1, learning=LearningConfig())
    assert learned.ledger_zero and learned.completed == known.completed
    assert learned.throughput_tokens_per_s >= 0.97 * known.throughput_tokens_per_s
    assert learned.learned is not None
    for i in range(len(paper_a.backends)):
        mape = learned.learned.describe(i)["fit_mape"]
        assert isinstance(mape, dict) and mape["ttft"] is None and mape["e2e"] is not None, mape
    streamed = run_simulation(nothing_known(paper_a), workload, "default", seed=1, learning=LearningConfig())
    assert streamed.learned is not None
    assert all(streamed.learned.describe(i)["fit_mape"]["ttft"] is not None for i in range(2))  # type: ignore[index]


@pytest.mark.parametrize("factors", [(2.0, 0.5), (0.5, 2.0)], ids=["fast-thought-slow", "fast-thought-fast"])
def test_a_prior_twice_too_slow_or_too_fast_is_corrected(
    paper_a: Fleet, factors: tuple[float, float]
) -> None:
    fleet = wrong_prior(paper_a, factors)
    workload = generate_workload("sharegpt", 1500, 16.0, 2, paper_a.max_model_len())
    known = run_simulation(paper_a, workload, "default", seed=1)
    wrong = run_simulation(fleet, workload, "default", seed=1)
    result = run_simulation(fleet, workload, "default", seed=1, learning=LearningConfig())
    live = result.learned
    assert live is not None and all(live.observed_total(i) >= 3 for i in range(2))
    truth = BackendModels.from_specs(paper_a.backends)
    idx = np.arange(2)
    prior = np.array([b.profile.params.as_tuple() for b in fleet.backends if b.profile is not None])
    batch, context = np.array([8.0, 8.0]), np.array([400.0, 400.0])
    for i_tokens, o_tokens in ((230, 200), (1000, 50)):
        # At the load the traffic put on them, each backend moved from a factor-2 error to within 25 %
        # of the truth; one the policy sent only exploration probes (3 requests) at least halved it.
        true_lat = truth.request_latency_s(idx, i_tokens, o_tokens, batch, context)
        wrong_lat = truth.request_latency_s(idx, i_tokens, o_tokens, batch, context, prior)
        learned_lat = truth.request_latency_s(idx, i_tokens, o_tokens, batch, context, live.params)
        wrong_err = np.abs(wrong_lat / true_lat - 1)
        learned_err = np.abs(learned_lat / true_lat - 1)
        assert np.all(wrong_err > 0.4)
        for i in range(2):
            limit = 0.25 if live.observed_total(i) >= 50 else 0.5 * wrong_err[i]
            assert learned_err[i] < limit, (i, learned_lat, true_lat, live.observed_total(i))
        # ... and their relative speed at saturation (what the min-max balances): within 20 % where both
        # were well observed; closer than the wrong prior's where one only had probes (this is an
        # extrapolation far beyond the batches the probes showed).
        cap = truth.fallback_capacity_tokens
        true_t = truth.amortised_request_s(idx, i_tokens, o_tokens, cap)
        wrong_t = truth.amortised_request_s(idx, i_tokens, o_tokens, cap, prior)
        learned_t = truth.amortised_request_s(idx, i_tokens, o_tokens, cap, live.params)
        true_ratio = true_t[1] / true_t[0]
        learned_off = abs(learned_t[1] / learned_t[0] / true_ratio - 1)
        if all(live.observed_total(i) >= 50 for i in range(2)):
            assert learned_off < 0.2, learned_off
        else:
            assert learned_off < abs(wrong_t[1] / wrong_t[0] / true_ratio - 1)
    assert result.throughput_tokens_per_s >= 0.97 * known.throughput_tokens_per_s
    assert result.percentile("e2e", 99) <= min(1.2 * known.percentile("e2e", 99), wrong.percentile("e2e", 99))


def test_a_two_fold_slow_down_is_detected_and_its_share_cut_within_60_s(paper_a: Fleet) -> None:
    workload = generate_workload("sharegpt", 2400, 16.0, 1, paper_a.max_model_len())
    t0 = workload[0].arrival_s
    slow = Slowdown(backend_index=0, factor=2.0, after_s=t0 + 60.0)
    static = run_simulation(paper_a, workload, "default", seed=1, slowdowns=[slow])
    learned = run_simulation(
        paper_a, workload, "default", seed=1, slowdowns=[slow], learning=LearningConfig()
    )
    live = learned.learned
    assert live is not None and live.drifts(0) >= 1
    assert t0 + 60.0 < live.drift_times_s(0)[0] <= t0 + 120.0  # detected within 60 modelled seconds
    arrivals = np.array([r.arrival_s for r in workload])
    window = (arrivals >= t0 + 90.0) & (arrivals < t0 + 120.0)
    share_static = float(np.mean(static.backend_index[window] == 0))
    share_learned = float(np.mean(learned.backend_index[window] == 0))
    assert share_learned < share_static - 0.15  # the slowed TP4 gets clearly less
    assert learned.percentile("e2e", 99) < static.percentile("e2e", 99)


def test_exploration_learns_a_backend_the_policy_would_never_pick_and_stays_bounded(paper_a: Fleet) -> None:
    # The TP1 is believed 10x slower than it is: at 2 req/s the policy never needs it. Exploration
    # probes it (a few requests predicted short, only while it is idle), then stops.
    fleet = wrong_prior(paper_a, (1.0, 10.0))
    workload = generate_workload("sharegpt", 600, 2.0, 3, paper_a.max_model_len())
    learning = LearningConfig()
    without = run_simulation(
        fleet, workload, "default", seed=1, learning=learning, policy_params={"explore_share": 0.0}
    )
    explored = run_simulation(fleet, workload, "default", seed=1, learning=learning)
    assert int(np.sum(without.backend_index == 1)) == 0
    on_tp1 = int(np.sum(explored.backend_index == 1))
    assert 1 <= on_tp1 <= 6  # explore_min_samples (3) probes, then the learned model decides
    live = explored.learned
    assert live is not None and live.observed_total(1) == on_tp1
    truth = BackendModels.from_specs(paper_a.backends).params[1]
    # The probes alone bring the decode speed from 10x too slow to within a factor of 2 (β scales it).
    step = live.params[1, 5] * 4 + live.params[1, 7] + (live.params[1, 4] * 4 + live.params[1, 6]) * 400
    true_step = truth[5] * 4 + truth[7] + (truth[4] * 4 + truth[6]) * 400
    assert 0.5 < step / true_step < 2.0


def test_the_learned_model_predicts_held_out_e2e_within_15_percent() -> None:
    """Issue 9: once a backend has had 200 completions, each later request's e2e — predicted before the
    model saw it — is within 15 % in median (nothing known at the start)."""
    fleet = build_fleet(get_scenario("paper-b").cluster())
    workload = generate_workload("sharegpt", 2000, 16.0, 1, fleet.max_model_len())
    result = run_simulation(nothing_known(fleet), workload, "default", seed=1, learning=LearningConfig())
    live = result.learned
    assert live is not None
    for i in range(len(fleet.backends)):
        n = live.observed_total(i)
        assert n >= 220, (i, n)
        after_200 = live.recent_e2e_errors(i)[-(n - 200) :]
        assert float(np.median(after_200)) < 0.15
