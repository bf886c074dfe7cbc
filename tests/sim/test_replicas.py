"""Several router replicas in the simulator (``run_simulation(replicas=R)``)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hetroute.admission.config import AdmissionConfig
from hetroute.commands import simulate as simulate_cmd
from hetroute.errors import ConfigError
from hetroute.learning.settings import LearningConfig
from hetroute.sim.cluster_file import Fleet, build_fleet
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import generate_workload
from hetroute.simulation.admission_run import SimAdmission
from hetroute.simulation.simulator import run_simulation

N_BURST = 1000


def test_one_replica_decides_the_same_whatever_it_does_with_foreign_load() -> None:
    fleet = build_fleet(get_scenario("paper-b").cluster())
    wl = generate_workload("sharegpt", 600, 24.0, 2, fleet.max_model_len())
    off = run_simulation(fleet, wl, "default", {}, foreign="off")
    for mode in ("raw", "scaled", "scaled_excess"):
        on = run_simulation(fleet, wl, "default", {}, foreign=mode)
        assert np.array_equal(on.backend_index, off.backend_index), mode


@pytest.mark.parametrize("mode", ["off", "scaled_excess"])
def test_replicas_share_the_traffic_and_each_ledger_releases_to_zero(mode: str) -> None:
    fleet = build_fleet(get_scenario("paper-b").cluster())
    wl = generate_workload("sharegpt", 600, 24.0, 2, fleet.max_model_len())
    single = run_simulation(fleet, wl, "default", {})
    four = run_simulation(fleet, wl, "default", {}, replicas=4, foreign=mode, learning=LearningConfig())  # type: ignore[arg-type]
    assert four.completed == single.completed == 600 and four.ledger_zero
    # Four routers that each see a quarter of the traffic still spread it over the whole fleet and
    # keep the throughput (arrival-bound here).
    used = np.bincount(four.backend_index, minlength=len(fleet.backends))
    assert (used > 0).all()
    assert four.throughput_tokens_per_s >= 0.97 * single.throughput_tokens_per_s


def test_replicas_exchanging_summaries_each_learn_from_every_completion() -> None:
    fleet = build_fleet(get_scenario("paper-b").cluster())
    wl = generate_workload("sharegpt", 600, 24.0, 2, fleet.max_model_len())
    runs = {
        interval: run_simulation(
            fleet, wl, "default", {}, replicas=4, learning=LearningConfig(), peer_interval_s=interval
        )
        for interval in (0.0, 0.1)
    }
    for result in runs.values():
        assert result.completed == 600 and result.ledger_zero
    seen = {}
    for interval, result in runs.items():
        learned = result.learned
        assert learned is not None  # replica 0's learner
        seen[interval] = sum(learned.observed_total(i) for i in range(len(fleet.backends)))
    assert seen[0.0] == 150  # its own quarter
    assert seen[0.1] >= 0.97 * 600  # everyone's, but those finished after the last exchange


def test_replicas_are_validated() -> None:
    fleet = build_fleet(get_scenario("paper-a").cluster())
    wl = generate_workload("sharegpt", 20, 8.0, 1, fleet.max_model_len())
    with pytest.raises(ConfigError, match="replicas"):
        run_simulation(fleet, wl, "default", {}, replicas=0)
    with pytest.raises(ConfigError, match="replicas"):
        run_simulation(fleet, wl, "default", {}, replicas=2, admission=SimAdmission(AdmissionConfig()))
    with pytest.raises(ConfigError, match="peer_interval_s"):
        run_simulation(fleet, wl, "default", {}, replicas=2, peer_interval_s=-1.0)


def test_simulate_command_runs_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())
    out = tmp_path / "o.json"
    argv = [
        "simulate",
        "--scenario",
        "paper-b",
        "--policies",
        "default",
        "--rates",
        "24",
        "--requests",
        "300",
    ]
    args = parser.parse_args([*argv, "--replicas", "3", "--foreign-load", "raw", "--json", str(out)])
    assert args.func(args) == 0
    assert "3 router replicas taking arrivals in turn; foreign load raw" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 300
    bad = parser.parse_args([*argv, "--replicas", "0"])
    assert bad.func(bad) != 0
    assert "--replicas: must be >= 1, got 0" in capsys.readouterr().err
    exchanging = parser.parse_args([*argv, "--replicas", "2", "--peer-interval", "0.02", "--json", str(out)])
    assert exchanging.func(exchanging) == 0
    assert (
        "2 router replicas taking arrivals in turn; foreign load scaled_excess; summaries every 0.02 s"
        in (capsys.readouterr().out)
    )
    assert json.loads(out.read_text())["runs"][0]["completed"] == 300
    bad = parser.parse_args([*argv, "--replicas", "2", "--peer-interval", "-1"])
    assert bad.func(bad) != 0
    assert "--peer-interval: must be a finite number >= 0" in capsys.readouterr().err


def _nothing_known(scenario: str) -> Fleet:
    """The scenario's fleet with nothing known (no GPU, TP, limits or profile): a new user's setup."""
    fleet = build_fleet(get_scenario(scenario).cluster())
    stripped = tuple(
        replace(b, gpu=None, tp=None, labels={}, max_num_seqs=None, profile=None) for b in fleet.backends
    )
    return replace(fleet, backends=stripped)


def test_a_burst_all_replicas_take_at_once_is_counted_by_the_mirror() -> None:
    """Rate ∞: every request arrives at once, before any summary can say who took what. Replicas that
    mirror their own change onto their peers decide as one router would; without the mirror each fills
    the fleet as if alone and the throughput falls well short (docs/replicas.md)."""
    fleet = _nothing_known("paper-a")
    wl = generate_workload("sharegpt", N_BURST, math.inf, 1, fleet.max_model_len())
    single = run_simulation(fleet, wl, "default", {}, learning=LearningConfig())
    runs = {
        mirror: run_simulation(
            fleet,
            wl,
            "default",
            {},
            learning=LearningConfig(),
            replicas=4,
            peer_interval_s=0.005,
            peer_mirror=mirror,
        )
        for mirror in (True, False)
    }
    for result in runs.values():
        assert result.completed == N_BURST and result.ledger_zero
    ratio = {m: r.throughput_tokens_per_s / single.throughput_tokens_per_s for m, r in runs.items()}
    assert ratio[True] >= 0.97, ratio
    assert ratio[False] < 0.9, ratio
