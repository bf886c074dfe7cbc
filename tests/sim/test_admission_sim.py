"""The admission queue in the simulator (the gateway's queue code, virtual time, seeded)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hetroute.admission.config import parse_admission
from hetroute.commands import simulate as simulate_cmd
from hetroute.errors import ConfigError
from hetroute.learning.settings import LearningConfig
from hetroute.sim.cluster_file import Fleet, blind_fleet, build_fleet
from hetroute.sim.prefix_workloads import generate_prefix_workload
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import generate_workload
from hetroute.simulation.admission_run import SimAdmission
from hetroute.simulation.simulator import run_simulation

CAPACITY_RPS = 44.0  # paper-a: ≈ 18,000 tok/s at saturation / ≈ 416 tokens per ShareGPT-like request


@pytest.fixture(scope="module")
def paper_a() -> Fleet:
    return build_fleet(get_scenario("paper-a").cluster())


def test_overload_priorities_fair_shares_bounded_waits_and_exact_accounting(paper_a: Fleet) -> None:
    duration_s = 40.0
    work = generate_workload("sharegpt", int(1.5 * CAPACITY_RPS * duration_s), 1.5 * CAPACITY_RPS, 3, 2048)
    rng = np.random.default_rng(3)
    interactive = rng.random(len(work)) < 0.2
    tenant_a = rng.random(len(work)) < 0.5
    labels = {
        r.request_id: ("interactive" if i else "batch", "a" if t else "b")
        for r, i, t in zip(work, interactive, tenant_a, strict=True)
    }
    cfg = parse_admission(
        {
            "classes": [
                {"name": "interactive", "max_queue_wait_s": 10, "placement": "first_token"},
                {"name": "batch", "max_queue_len": 400, "max_queue_wait_s": 15, "ageing_s": 5},
            ],
            "tenants": {"a": 3, "b": 1},
        }
    )
    r = run_simulation(paper_a, work, "default", seed=3, admission=SimAdmission(cfg, labels))
    done = ~np.isnan(r.ttft_s)
    shed = sum(v for k, v in r.extra.items() if k.startswith("shed_"))
    assert r.completed + shed == len(work) and shed > 0  # overloaded: some 429s, nothing lost
    assert r.ledger_zero and r.extra["queue_left"] == 0
    assert sum(i.requests for i in r.instances) == r.completed  # a shed request never reached an engine
    assert r.queue_wait_s is not None
    assert r.queue_wait_s[~interactive].max() <= 15.0 + 1e-9  # batch waits are bounded as configured
    assert done[interactive].all()  # interactive traffic (20 %) is never shed
    p99_interactive = float(np.percentile(r.ttft_s[interactive & done], 99))
    assert p99_interactive < 0.5 < float(np.percentile(r.ttft_s[~interactive & done], 50))
    # weighted shares of batch tokens dispatched while both tenants were backlogged
    dispatched = np.array([w.arrival_s for w in work]) + r.queue_wait_s
    tokens = np.array([w.input_tokens + w.output_tokens for w in work], dtype=np.float64)
    sel = ~interactive & done & (dispatched > 10.0) & (dispatched < duration_s)
    share = tokens[sel & tenant_a].sum() / tokens[sel].sum()
    assert abs(share - 0.75) < 0.075


def test_saturation_queue_keeps_engines_full_and_drains_to_zero(paper_a: Fleet) -> None:
    work = generate_workload("sharegpt", 1500, math.inf, 4, 2048)
    unbounded = {"classes": [{"name": "default", "max_queue_len": 100000, "max_queue_wait_s": 1e6}]}
    queued = run_simulation(
        paper_a, work, "default", seed=4, admission=SimAdmission(parse_admission(unbounded))
    )
    pushed = run_simulation(paper_a, work, "default", seed=4)
    assert queued.completed == len(work) and queued.ledger_zero and queued.extra["queue_left"] == 0
    assert queued.queue_wait_s is not None and queued.queue_wait_s.max() > 0  # requests did wait
    assert queued.throughput_tokens_per_s >= 0.9 * pushed.throughput_tokens_per_s


def test_without_a_profile_the_queue_learns_each_engines_limit_and_keeps_it_full() -> None:
    """Nothing configured (no GPU, profile, max_num_seqs or KV capacity), learning on: the queue's
    KV test reads the engines' capacity from their metrics, the observed sequence limit stands in
    for max_num_seqs, and the fleet gets far more done than with every request pushed at t = 0."""
    bare = blind_fleet(build_fleet(get_scenario("paper-b").cluster()), keep_kv_capacity=False)
    work = generate_workload("sharegpt", 3000, math.inf, 5, 2048)
    unbounded = {"classes": [{"name": "default", "max_queue_len": 100000, "max_queue_wait_s": 1e6}]}
    adm = SimAdmission(parse_admission(unbounded))
    queued = run_simulation(bare, work, "default", seed=5, admission=adm, learning=LearningConfig())
    pushed = run_simulation(bare, work, "default", seed=5, learning=LearningConfig())
    assert queued.completed == len(work) and queued.ledger_zero and queued.extra["queue_left"] == 0
    assert queued.throughput_tokens_per_s >= 1.3 * pushed.throughput_tokens_per_s


def test_simulate_command_runs_the_queue_from_a_router_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("admission:\n  classes: [{name: only, max_queue_len: 20, max_queue_wait_s: 5}]\n")
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())
    out = tmp_path / "o.json"
    argv = [
        "simulate",
        "--scenario",
        "paper-a",
        "--policies",
        "default",
        "--rates",
        "inf",
        "--requests",
        "800",
    ]
    args = parser.parse_args([*argv, "--admission", str(cfg), "--json", str(out)])
    assert args.func(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert 0 < run["completed"] < 800  # a 20-deep queue at rate ∞ sheds the rest with 429
    bad = parser.parse_args([*argv, "--admission", str(tmp_path / "missing.yaml")])
    assert bad.func(bad) == 2
    assert "--admission" in capsys.readouterr().err


def test_a_client_with_few_connections_sends_each_request_when_one_frees(paper_a: Fleet) -> None:
    """``client_connections``: a closed-loop client. With one connection every request waits for the
    previous answer, so the run lasts exactly the sum of the requests' times alone; times still count
    from each request's arrival."""
    work = generate_workload("sharegpt", 6, math.inf, 2, 2048)
    first = {"backend": paper_a.backends[0].name}
    one = run_simulation(paper_a, work, "single", first, client_connections=1, prefix=None)
    assert one.completed == 6 and one.ledger_zero
    alone = [run_simulation(paper_a, [r], "single", first, prefix=None).makespan_s for r in work]
    assert one.makespan_s == pytest.approx(sum(alone), rel=1e-9)
    assert np.all(np.diff(one.e2e_s) > 0)  # served one after another, in order
    assert one.e2e_s[-1] == pytest.approx(one.makespan_s)
    free = run_simulation(paper_a, work, "single", first, prefix=None)
    assert free.makespan_s < 0.5 * one.makespan_s
    with pytest.raises(ConfigError, match="client_connections"):
        run_simulation(paper_a, work, "round_robin", client_connections=-1)


def test_a_closed_loop_client_behind_a_shedding_queue_gets_every_answer_or_refusal(paper_a: Fleet) -> None:
    """Refusals free the client's connections too: with a queue that sheds, nothing waits forever."""
    work = generate_workload("sharegpt", 600, math.inf, 4, 2048)
    cfg = parse_admission(
        {"classes": [{"name": "default", "max_queue_len": 8, "max_queue_wait_s": 2.0}], "full": {}}
    )
    r = run_simulation(paper_a, work, "default", admission=SimAdmission(cfg), client_connections=400)
    shed = r.extra.get("shed_queue_full", 0.0) + r.extra.get("shed_wait_timeout", 0.0)
    assert r.completed + shed == len(work) and shed > 0
    assert r.ledger_zero and r.extra["queue_left"] == 0.0


def test_overloaded_shared_prefixes_behind_the_queue_keep_their_hits_and_backends_end_together() -> None:
    """Long shared documents (``rag``) far beyond paper-b's prefill capacity. Pushed at arrival, the
    backlog is committed inside the engines on the drain-time estimates of the moment, and the
    backends finish apart; behind the queue each request is placed when a backend has room, priced
    with the prefix index then, so the engines keep their cache hits and end within seconds of each
    other (docs/prefix.md, "Behind the admission queue")."""
    fleet = build_fleet(get_scenario("paper-b").cluster())
    work = generate_prefix_workload("rag", 600, 12.0, 1, 32768)
    unbounded = {"classes": [{"name": "default", "max_queue_len": 100000, "max_queue_wait_s": 1e6}]}
    adm = SimAdmission(parse_admission(unbounded))
    queued = run_simulation(fleet, work, "default", admission=adm, learning=LearningConfig())
    pushed = run_simulation(fleet, work, "default", learning=LearningConfig())
    assert queued.completed == len(work) and queued.ledger_zero and queued.extra["queue_left"] == 0
    assert queued.queue_wait_s is not None and queued.queue_wait_s.max() > 10.0  # it was overloaded

    def hit(r: object) -> float:
        extra = r.extra  # type: ignore[attr-defined]
        return float(extra["prefix_cache_hits_tokens"] / extra["prefix_cache_queries_tokens"])

    def end_spread_s(r: object) -> float:
        finished = np.array([w.arrival_s for w in work]) + r.e2e_s  # type: ignore[attr-defined]
        index = r.backend_index  # type: ignore[attr-defined]
        return float(np.ptp([finished[index == b].max() for b in range(len(fleet.backends))]))

    assert hit(queued) >= 0.9 * hit(pushed) > 0.1
    assert end_spread_s(queued) < 0.5 * end_spread_s(pushed)
