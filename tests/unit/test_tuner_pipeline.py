"""tune() end to end with the real roofline prior: caching, choice, errors, JSON, PNG and emitted files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog
from hetroute.commands.tune_deploy import tuning_prior
from hetroute.config import load_config
from hetroute.latency import save_profile
from hetroute.sim.workload import generate_workload
from hetroute.tuner.cluster import ClusterSpec, cluster_from_dict
from hetroute.tuner.emit import compose_file, write_compose, write_router_config
from hetroute.tuner.report import SCHEMA, render_png, render_table, result_to_json, usd_per_mtoken
from hetroute.tuner.tune import ModelFitsNowhere, TuneResult, candidate_tps, tune

REPO = Path(__file__).resolve().parents[2]
GPUS = load_gpu_catalog()
MODELS = load_model_catalog()
REQUESTS = [
    (r.input_tokens, r.output_tokens) for r in generate_workload("sharegpt", 300, float("inf"), 0, 2048)
]


def _cluster(doc: dict[str, Any], base_dir: Path | None = None) -> ClusterSpec:
    return cluster_from_dict(
        doc, GPUS, MODELS, source="t.yaml", base_dir=base_dir or REPO / "config" / "clusters"
    )


def _fleet() -> dict[str, Any]:
    return {
        "models": {"small": "Llama-3-8B", "big": "DeepSeek-R1-Distill-Qwen-14B"},
        "machines": [
            {
                "name": "v",
                "gpu": "V100-SXM2-32GB",
                "gpus": 4,
                "model": "small",
                "count": 3,
                "price_per_hour": 12.0,
            },
            {"name": "a", "gpu": "A800-80GB-PCIe", "gpus": 2, "model": "big", "price_per_hour": 3.8},
            {"name": "l", "gpu": "L4", "gpus": 2, "model": "big"},
        ],
        "engine": {"max_num_seqs": 64, "max_model_len": 2048},
    }


@pytest.fixture(scope="module")
def fleet_result() -> TuneResult:
    cluster = _cluster(_fleet())
    return tune(cluster, REQUESTS, tuning_prior(cluster.engine))


def test_candidates_are_the_divisors() -> None:
    assert candidate_tps(8) == (1, 2, 4, 8)
    assert candidate_tps(6) == (1, 2, 3, 6)


def test_identical_machines_share_one_estimate(fleet_result: TuneResult) -> None:
    # 3 V100 machines (3 TPs) + A800 (2 TPs) + L4 (2 TPs): 7 distinct configurations, not 13
    assert fleet_result.distinct_configs == 7
    v_plans = [p for p in fleet_result.plans if p.machine.gpu.name == "V100-SXM2-32GB"]
    assert len(v_plans) == 3 and all(p.options is v_plans[0].options for p in v_plans)


def test_each_machine_takes_its_best_feasible_option(fleet_result: TuneResult) -> None:
    for plan in fleet_result.plans:
        feasible = [e for e in plan.options if e.feasible]
        if not feasible:
            assert plan.chosen is None
            continue
        assert plan.chosen is not None
        assert plan.chosen.tokens_per_s("iteration") == max(e.tokens_per_s("iteration") for e in feasible)
    total = sum(p.chosen.tokens_per_s("iteration") for p in fleet_result.plans if p.chosen)
    assert fleet_result.total_tokens_per_s == pytest.approx(total)


def test_infeasible_options_explain_why(fleet_result: TuneResult) -> None:
    l4 = next(p for p in fleet_result.plans if p.machine.name == "l")
    tp1 = next(e for e in l4.options if e.tp == 1)
    assert not tp1.feasible and tp1.reason is not None and "weights need" in tp1.reason
    assert next(e for e in l4.options if e.tp == 2).feasible  # 27.5 GiB of weights over two L4s


def test_prior_profiles_are_marked(fleet_result: TuneResult) -> None:
    for plan in fleet_result.plans:
        for e in plan.options:
            if e.feasible:
                assert e.profile_source == "roofline-prior"
                assert e.algorithm1_tokens_per_s is not None and e.algorithm1_tokens_per_s > 0


def test_a_model_that_fits_nowhere_is_a_clear_error() -> None:
    doc = {"model": "Llama-2-70B", "machines": [{"name": "x", "gpu": "L4", "gpus": 2}]}
    cluster = _cluster(doc)
    with pytest.raises(ModelFitsNowhere) as info:
        tune(cluster, REQUESTS, tuning_prior(cluster.engine))
    text = str(info.value)
    assert text.startswith("models.Llama-2-70B: fits on no machine")
    assert "2x L4: TP1: weights need" in text


def test_a_measured_profile_replaces_the_prior(tmp_path: Path) -> None:
    engine = _cluster(
        {"model": "Llama-3-8B", "machines": [{"name": "v", "gpu": "V100-SXM2-32GB", "gpus": 2}]}
    ).engine
    prior = tuning_prior(engine)(GPUS["V100-SXM2-32GB"], MODELS["Llama-3-8B"], 1)
    measured = replace(
        prior,
        source="profiled",
        kv_capacity_tokens=97008,
        kv_capacity_source="vllm:cache_config_info",
        sweep={"batch_sizes": [1, 2, 4, 8, 16, 32]},
    )
    save_profile(measured, tmp_path / "v100-tp1.yaml")
    doc = {
        "model": "Llama-3-8B",
        "machines": [{"name": "v", "gpu": "V100-SXM2-32GB", "gpus": 2}],
        "engine": {"max_model_len": 2048},
        "profiles": [{"gpu": "V100-SXM2-32GB", "tp": 1, "path": "v100-tp1.yaml"}],
    }
    cluster = _cluster(doc, tmp_path)
    result = tune(cluster, REQUESTS, tuning_prior(cluster.engine))
    by_tp = {e.tp: e for e in result.plans[0].options}
    assert by_tp[1].profile_source == "profiled"
    assert by_tp[1].profile_path == str(tmp_path / "v100-tp1.yaml")
    assert by_tp[1].kv_source == "vllm:cache_config_info"
    assert by_tp[1].kv_capacity_tokens == 97008  # the engine-reported figure, not the computed 97017
    assert any("extrapolates" in w for w in by_tp[1].warnings)  # profiled only up to batch 32
    assert by_tp[2].profile_source == "roofline-prior"
    assert not by_tp[2].warnings or all("extrapolates" not in w for w in by_tp[2].warnings)


def test_a_measured_capacity_far_from_the_computed_one_is_flagged(tmp_path: Path) -> None:
    engine = _cluster(
        {"model": "Llama-3-8B", "machines": [{"name": "v", "gpu": "A100-80GB", "gpus": 1}]}
    ).engine
    prior = tuning_prior(engine)(GPUS["A100-80GB"], MODELS["Llama-3-8B"], 1)
    save_profile(replace(prior, source="profiled", kv_capacity_tokens=100_000), tmp_path / "a.yaml")
    doc = {
        "model": "Llama-3-8B",
        "machines": [{"name": "a", "gpu": "A100-80GB", "gpus": 1}],
        "profiles": [{"gpu": "A100-80GB", "tp": 1, "path": "a.yaml"}],
    }
    cluster = _cluster(doc, tmp_path)
    (option,) = tune(cluster, REQUESTS, tuning_prior(cluster.engine)).plans[0].options
    assert option.kv_capacity_tokens == 100_000
    assert any("differs from the computed" in w for w in option.warnings)


def test_constraints_switch_to_the_joint_search() -> None:
    doc = _fleet()
    doc["constraints"] = {"min_instances": 12}
    cluster = _cluster(doc)
    result = tune(cluster, REQUESTS, tuning_prior(cluster.engine))
    assert result.search.joint
    assert result.search.total_instances >= 12
    assert result.search.infeasible_reason is None


def test_json_document(fleet_result: TuneResult) -> None:
    doc = json.loads(json.dumps(result_to_json(fleet_result)))
    assert doc["schema"] == SCHEMA
    assert len(doc["machines"]) == 5
    v = doc["machines"][0]
    assert {o["tp"] for o in v["options"]} == {1, 2, 4}
    ranks = sorted(o["rank"] for o in v["options"] if o["feasible"])
    assert ranks == list(range(1, len(ranks) + 1))
    assert v["chosen_tp"] == next(o["tp"] for o in v["options"] if o["rank"] == 1)
    chosen = next(o for o in v["options"] if o["tp"] == v["chosen_tp"])
    assert chosen["usd_per_mtoken"] == pytest.approx(
        12.0 / (chosen["iteration_tokens_per_s"] * 3600 / 1e6), rel=1e-3
    )
    assert doc["total"]["instances"] == fleet_result.search.total_instances
    assert doc["search"]["mode"] == "separable"


def test_table_groups_identical_machines(fleet_result: TuneResult) -> None:
    text = render_table(fleet_result)
    assert "v-0 .. v-2 (3 machines): 4x V100-SXM2-32GB" in text
    assert "infeasible: weights need" in text
    assert "cluster total:" in text


def test_png_is_written(fleet_result: TuneResult, tmp_path: Path) -> None:
    out = tmp_path / "t.png"
    render_png(fleet_result, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_usd_per_mtoken() -> None:
    assert usd_per_mtoken(3.6, 1000.0) == pytest.approx(1.0)
    assert usd_per_mtoken(None, 1000.0) is None


def test_emitted_router_config_loads_with_the_gateway_loader(
    fleet_result: TuneResult, tmp_path: Path
) -> None:
    target = write_router_config(
        fleet_result, tmp_path / "router.yaml", tuning_prior(fleet_result.cluster.engine)
    )
    config = load_config(target, env={})
    chosen = [(p.machine, p.chosen) for p in fleet_result.plans if p.chosen is not None]
    assert len(config.backends) == sum(e.instances for _, e in chosen)
    urls = [b.url for b in config.backends]
    assert len(set(urls)) == len(urls)
    for backend in config.backends:
        assert backend.engine == "vllm"
        assert backend.profile is not None and backend.profile.source == "roofline-prior"
        assert backend.labels["machine"] in {m.name for m, _ in chosen}
        assert backend.tp == int(backend.labels["tp"])
        assert backend.models is not None
    models = {b.models[0] for b in config.backends if b.models}
    assert "meta-llama/Meta-Llama-3-8B-Instruct" in models
    assert (tmp_path / "profiles").is_dir()


def test_compose_reserves_disjoint_gpus_per_machine(fleet_result: TuneResult, tmp_path: Path) -> None:
    doc = compose_file(fleet_result)
    by_machine: dict[str, list[str]] = {}
    for name, svc in doc["services"].items():
        machine = svc["profiles"][0]
        devices = svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        tp = int(svc["command"][svc["command"].index("--tensor-parallel-size") + 1])
        assert len(devices) == tp
        assert svc["image"].startswith("vllm/vllm-openai")
        assert "healthcheck" in svc and name.startswith(machine)
        by_machine.setdefault(machine, []).extend(devices)
    for plan in fleet_result.plans:
        if plan.chosen is not None:
            ids = by_machine[plan.machine.name]
            assert sorted(ids, key=int) == [str(g) for g in range(plan.machine.gpus)]
    text = write_compose(fleet_result, tmp_path / "compose.yaml").read_text(encoding="utf-8")
    assert yaml.safe_load(text)["services"].keys() == doc["services"].keys()
