"""Deterministic simulator runs: the real router, policies, ledger and predictors on engine models."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hetroute.commands import policy_specs
from hetroute.commands import simulate as simulate_cmd
from hetroute.errors import ConfigError
from hetroute.sim.cluster_file import Fleet, build_fleet, parse_cluster
from hetroute.sim.engine_model import EngineModel
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import SimRequest, generate_workload
from hetroute.simulation.simulator import run_simulation
from hetroute.types import ClusterSnapshot, EngineMetrics, IntArray, RequestFeatures, RoutingDecision


@pytest.fixture(scope="module")
def paper_a() -> Fleet:
    return build_fleet(get_scenario("paper-a").cluster())


class Probe:
    """A test policy: always the first candidate; records what the router showed it."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: list[tuple[RequestFeatures, ClusterSnapshot]] = []

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        self.seen.append((features, snapshot))
        return RoutingDecision(index=int(candidates[0]), reason="probe")


def _standalone(fleet: Fleet, index: int, reqs: list[SimRequest]) -> dict[str, tuple[float, float]]:
    """(first token, finish) per request when ``reqs`` run alone on one fresh engine: the reference."""
    engine = EngineModel(fleet.configs[index])
    out: dict[str, list[float]] = {}
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    now = 0.0
    while pending or engine.has_work():
        if not engine.has_work():
            now = max(now, pending[0].arrival_s)
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            engine.submit(r.request_id, r.input_tokens, r.output_tokens, r.arrival_s)
        step = engine.step(now)
        now += step.duration_s
        for ev in step.emitted:
            if ev.first:
                out[ev.request_id] = [now, math.nan]
        for rid in step.finished:
            out[rid][1] = now
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_every_request_completes_and_accounting_returns_to_zero(paper_a: Fleet) -> None:
    work = generate_workload("sharegpt", 400, 16.0, seed=1, max_model_len=8192)
    res = run_simulation(paper_a, work, "least_outstanding", {})
    assert res.completed == 400 and res.rejected == 0 and res.ledger_zero
    assert sum(i.requests for i in res.instances) == 400
    assert res.input_tokens == sum(r.input_tokens for r in work)
    assert res.output_tokens == sum(r.output_tokens for r in work)
    assert sum(i.output_tokens for i in res.instances) == res.output_tokens
    assert np.all(res.ttft_s > 0) and np.all(res.e2e_s >= res.ttft_s)
    last_finish = max(r.arrival_s + e for r, e in zip(work, res.e2e_s, strict=True))
    assert res.makespan_s == pytest.approx(last_finish)
    assert res.throughput_tokens_per_s == pytest.approx(
        (res.input_tokens + res.output_tokens) / res.makespan_s
    )
    assert max(i.completion_time_s for i in res.instances) == pytest.approx(res.makespan_s)


def test_runs_are_deterministic_and_independent(paper_a: Fleet) -> None:
    work = generate_workload("sharegpt", 200, 24.0, seed=2)
    first = run_simulation(paper_a, work, "random", {}, seed=5)
    other = run_simulation(paper_a, work, "random", {}, seed=6)
    again = run_simulation(paper_a, work, "random", {}, seed=5)
    assert np.array_equal(first.backend_index, again.backend_index)
    assert np.array_equal(first.e2e_s, again.e2e_s)
    assert first.makespan_s == again.makespan_s
    assert not np.array_equal(first.backend_index, other.backend_index)


def test_round_robin_and_weighted_round_robin_really_route(paper_a: Fleet) -> None:
    work = generate_workload("sharegpt", 100, 8.0, seed=0)
    rr = run_simulation(paper_a, work, "round_robin", {})
    assert rr.backend_index.tolist() == [0, 1] * 50
    wrr = run_simulation(paper_a, work, "weighted_round_robin", {"weights": [4, 1]})
    assert [i.requests for i in wrr.instances] == [80, 20]


def test_weighted_beats_round_robin_on_the_heterogeneous_pair(paper_a: Fleet) -> None:
    # paper §5 A: RR overloads the TP1 instance; WRR 4:1 finishes far sooner at saturation.
    work = generate_workload("sharegpt", 600, math.inf, seed=0)
    rr = run_simulation(paper_a, work, "round_robin", {})
    wrr = run_simulation(paper_a, work, "weighted_round_robin", {})
    assert wrr.throughput_tokens_per_s > 1.5 * rr.throughput_tokens_per_s
    tp4, tp1 = rr.instances
    assert tp1.completion_time_s > 2 * tp4.completion_time_s  # RR leaves the small instance as the straggler


def test_single_request_times_equal_the_engine_model(paper_a: Fleet) -> None:
    req = SimRequest("only", arrival_s=1.5, input_tokens=300, output_tokens=40)
    res = run_simulation(paper_a, [req], Probe())
    first, finish = _standalone(paper_a, 0, [req])["only"]
    assert res.ttft_s[0] == pytest.approx(first - 1.5, abs=1e-12)
    assert res.e2e_s[0] == pytest.approx(finish - 1.5, abs=1e-12)
    assert res.makespan_s == pytest.approx(finish - 1.5, abs=1e-12)


def test_the_ledger_sees_tokens_generated_before_each_decision(paper_a: Fleet) -> None:
    long = SimRequest("long", 0.0, 100, 1000)
    later = SimRequest("later", 5.0, 10, 5)
    probe = Probe()
    run_simulation(paper_a, [long, later], probe, predictor="mean")
    reference = EngineModel(paper_a.configs[0])
    reference.submit("long", 100, 1000, 0.0)
    now, tokens = 0.0, 0
    while True:
        step = reference.step(now)
        if now + step.duration_s > 5.0:
            break
        now += step.duration_s
        tokens += sum(ev.tokens for ev in step.emitted)
    _, snap = probe.seen[1]
    assert snap.now_s == 5.0
    assert snap.generated_tokens_in_flight[0] == tokens > 0
    assert snap.requests_in_flight.tolist() == [1, 0]


def test_live_and_scraped_engine_metrics(paper_a: Fleet) -> None:
    work = generate_workload("sharegpt", 60, 20.0, seed=4)
    live, scraped = Probe(), Probe()
    run_simulation(paper_a, work, live, scrape_interval_s=0.0)
    run_simulation(paper_a, work, scraped, scrape_interval_s=1.0)
    for _, snap in live.seen:
        m = snap.metrics[0]
        assert isinstance(m, EngineMetrics) and m.scraped_at_s == snap.now_s
        assert m.kv_capacity_tokens == paper_a.backends[0].kv_capacity_tokens
    assert any((snap.metrics[0].num_requests_running or 0) > 0 for _, snap in live.seen[1:])  # type: ignore[union-attr]
    ages = []
    for _, snap in scraped.seen:
        m = snap.metrics[0]
        assert m is not None and m.scraped_at_s <= snap.now_s
        ages.append(snap.now_s - m.scraped_at_s)
        assert m.scraped_at_s == pytest.approx(round(m.scraped_at_s))  # scrapes at 0, 1, 2, ... s
    assert max(ages) < 1.0 and max(ages) > 0.5


def test_tgi_backends_publish_no_kv_gauge() -> None:
    fleet = build_fleet(
        parse_cluster(
            {
                "defaults": {"model": "Llama-3-8B"},
                "instances": [
                    {"name": "t", "gpu": "A100-80GB", "engine": "tgi"},
                    {"name": "v", "gpu": "A100-80GB"},
                ],
            }
        )
    )
    probe = Probe()
    work = generate_workload("sharegpt", 20, 10.0, seed=0, send_max_tokens=True)
    res = run_simulation(fleet, work, probe)
    assert res.completed == 20 and res.ledger_zero
    tgi, vllm = probe.seen[-1][1].metrics
    assert tgi is not None and tgi.kv_usage_frac is None and tgi.batch_current_max_tokens is not None
    assert vllm is not None and vllm.kv_usage_frac is not None


def test_the_predictor_learns_from_completions(paper_a: Fleet) -> None:
    work = [SimRequest(f"r{k}", k * 2.0, 50, 17) for k in range(40)]
    probe = Probe()
    run_simulation(paper_a, work, probe, predictor="online")
    predictions = [f.predicted_output_tokens for f, _ in probe.seen]
    assert predictions[0] != 17  # the prior, before anything completed
    assert predictions[-1] == 17  # learned from the observed outputs


def test_too_long_requests_are_rejected_and_released() -> None:
    fleet = build_fleet(
        parse_cluster(
            {"instances": [{"gpu": "L4", "model": "Llama-3-8B", "engine_args": {"max_model_len": 512}}]}
        )
    )
    work = [SimRequest("ok", 0.0, 100, 10), SimRequest("big", 0.1, 500, 100), SimRequest("ok2", 0.2, 10, 10)]
    res = run_simulation(fleet, work, "round_robin")
    assert (res.completed, res.rejected, res.ledger_zero) == (2, 1, True)
    assert math.isnan(res.e2e_s[1])


def test_bad_workloads_are_config_errors(paper_a: Fleet) -> None:
    with pytest.raises(ConfigError, match="not served"):
        run_simulation(paper_a, [SimRequest("a", 0.0, 5, 5, model="Llama-2-70B")], "round_robin")
    with pytest.raises(ConfigError, match="sorted"):
        run_simulation(paper_a, [SimRequest("a", 1.0, 5, 5), SimRequest("b", 0.0, 5, 5)], "round_robin")
    with pytest.raises(ConfigError, match="unique"):
        run_simulation(paper_a, [SimRequest("a", 0.0, 5, 5), SimRequest("a", 0.0, 5, 5)], "round_robin")
    with pytest.raises(ConfigError) as err:
        run_simulation(paper_a, [SimRequest("a", 0.0, 5, 5)], "weighted_round_robin", {"weights": [1, -1]})
    assert err.value.path.startswith("policy.params.weights")


def test_policy_spec_syntax() -> None:
    spec = policy_specs.parse_policy_spec("weighted_round_robin:weights=4:1")
    assert (spec.label, spec.name, dict(spec.params)) == (
        "weighted_round_robin:weights=4:1",
        "weighted_round_robin",
        {"weights": [4, 1]},
    )
    spec = policy_specs.parse_policy_spec("x:theta=0.5:kv_signal=engine:on=true:w=2,3")
    assert dict(spec.params) == {"theta": 0.5, "kv_signal": "engine", "on": True, "w": [2, 3]}
    assert [s.name for s in policy_specs.parse_policy_list("round_robin, default,")] == [
        "round_robin",
        "default",
    ]
    for bad in (":a=1", "x:=1", "x:oops"):
        with pytest.raises(ConfigError):
            policy_specs.parse_policy_spec(bad)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    code: int = args.func(args)
    return code


def test_cli_writes_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
    code = _cli(
        [
            "--scenario", "paper-a", "--policies", "round_robin,weighted_round_robin:weights=4:1", "--rates",
            "16,inf", "--requests", "50", "--json", str(out_json), "--plot", str(out_png),
        ]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "weighted_round_robin:weights=4:1" in text and "4 runs in" in text
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "hetroute.simulate/1"
    assert [i["name"] for i in doc["cluster"]["instances"]] == ["v100-tp4", "v100-tp1"]
    assert [(r["rate"], r["policy"]) for r in doc["runs"]] == [
        ("16", "round_robin"),
        ("16", "weighted_round_robin:weights=4:1"),
        ("inf", "round_robin"),
        ("inf", "weighted_round_robin:weights=4:1"),
    ]
    run = doc["runs"][1]
    assert run["completed"] == 50 and [i["requests"] for i in run["instances"]] == [40, 10]
    tokens = run["input_tokens"] + run["output_tokens"]
    assert run["throughput_tokens_per_s"] == pytest.approx(tokens / run["makespan_s"], rel=1e-5)
    assert (
        set(run["ttft_s"]) == {"mean", "p50", "p90", "p99"} and run["ttft_s"]["p50"] <= run["ttft_s"]["p99"]
    )
    assert all(i["completion_time_s"] > 0 for i in run["instances"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_lists_scenarios_and_reports_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["--list-scenarios"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("paper-a", "paper-b", "mixed"))
    assert _cli(["--scenario", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
    assert _cli(["--scenario", "paper-a", "--policies", "weighted_round_robin:weights=1:0"]) == 2
    assert "weights" in capsys.readouterr().err
    assert _cli(["--scenario", "paper-a", "--rates", "trace"]) == 2


@pytest.mark.parametrize("scenario", ["paper-a", "paper-b", "mixed"])
def test_every_scenario_serves_an_azure_burst(scenario: str) -> None:
    fleet = build_fleet(get_scenario(scenario).cluster())
    work = generate_workload("azure-conv", 120, math.inf, seed=3, max_model_len=fleet.max_model_len())
    res = run_simulation(fleet, work, "round_robin", {})
    assert res.completed == 120 and res.ledger_zero
    assert [i.requests for i in res.instances] == [
        120 // len(fleet.backends) + (k < 120 % len(fleet.backends)) for k in range(len(fleet.backends))
    ]


def test_an_empty_workload_is_an_empty_result(paper_a: Fleet) -> None:
    res = run_simulation(paper_a, [], "round_robin")
    assert (res.completed, res.makespan_s, res.throughput_tokens_per_s, res.events) == (0, 0.0, 0.0, 0)
    assert math.isnan(res.percentile("ttft", 50))


def test_cli_theta_goes_only_to_policies_that_take_it(tmp_path: Path) -> None:
    out_json = tmp_path / "t.json"
    argv = [
        "--scenario",
        "paper-a",
        "--policies",
        "round_robin,workload_minmax,workload_minmax:theta=3:label=x",
    ]
    assert _cli([*argv, "--theta", "0.5", "--rates", "inf", "--requests", "20", "--json", str(out_json)]) == 2
    argv[3] = "round_robin,workload_minmax,memory_minmax:theta=3"
    assert _cli([*argv, "--theta", "0.5", "--rates", "inf", "--requests", "20", "--json", str(out_json)]) == 0
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["policy_params"] for r in runs] == [{}, {"theta": 0.5}, {"theta": 3}]


def test_kv_pressure_preempts_yet_every_request_completes() -> None:
    args = {"num_gpu_blocks_override": 64, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 16}
    fleet = build_fleet(
        parse_cluster({"instances": [{"gpu": "L4", "model": "Llama-3-8B", "engine_args": args}]})
    )
    work = generate_workload("sharegpt", 60, math.inf, seed=0, max_model_len=1024)
    res = run_simulation(fleet, work, "round_robin")
    assert res.instances[0].preemptions > 0
    assert res.completed == 60 and res.ledger_zero
    assert res.output_tokens == sum(r.output_tokens for r in work)
