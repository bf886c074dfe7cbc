"""Cluster-file validation: every error names the file and the field; the example files load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hetroute.catalog.specs import GpuSpec, ModelSpec, load_gpu_catalog, load_model_catalog
from hetroute.latency import EngineLimits, LatencyParams, LatencyProfile, save_profile
from hetroute.tuner.cluster import ClusterError, ClusterSpec, cluster_from_dict, load_cluster

REPO = Path(__file__).resolve().parents[2]
GPUS: dict[str, GpuSpec] = load_gpu_catalog()
MODELS: dict[str, ModelSpec] = load_model_catalog()


def _load(data: Any, base_dir: Path | None = None) -> ClusterSpec:
    return cluster_from_dict(data, GPUS, MODELS, source="c.yaml", base_dir=base_dir)


def _base() -> dict[str, Any]:
    return {"model": "Llama-3-8B", "machines": [{"name": "n1", "gpu": "V100-SXM2-32GB", "gpus": 8}]}


@pytest.mark.parametrize(
    "name", ["paper-c.yaml", "mixed-fleet.yaml", "mixed-fleet-constrained.yaml", "slo-fleet.yaml"]
)
def test_example_cluster_files_load(name: str) -> None:
    spec = load_cluster(REPO / "config" / "clusters" / name, GPUS, MODELS)
    assert spec.machines
    assert spec.source == name


def test_paper_c_is_the_papers_setup() -> None:
    spec = load_cluster(REPO / "config" / "clusters" / "paper-c.yaml", GPUS, MODELS)
    (m,) = spec.machines
    assert (m.gpu.name, m.gpus, spec.models[m.model_key].name) == ("V100-SXM2-32GB", 8, "Llama-3-8B")
    assert (spec.workload.requests, spec.workload.duplicates) == (1000, 8)


def test_mixed_fleet_has_four_gpu_types_and_two_models() -> None:
    spec = load_cluster(REPO / "config" / "clusters" / "mixed-fleet.yaml", GPUS, MODELS)
    assert {m.gpu.name for m in spec.machines} == {"V100-SXM2-32GB", "A800-80GB-PCIe", "L4", "H100-SXM"}
    assert len({m.model_key for m in spec.machines}) == 2


def test_defaults_and_count_expansion() -> None:
    data = _base()
    data["machines"][0]["count"] = 3
    spec = _load(data)
    assert [m.name for m in spec.machines] == ["n1-0", "n1-1", "n1-2"]
    assert spec.engine.gpu_memory_utilization == 0.9
    assert spec.engine.overhead_gib_per_gpu == 2.0
    assert not spec.constraints.active


def test_inline_model() -> None:
    data = _base()
    del data["model"]
    data["models"] = {
        "tiny": {
            "n_layers": 4,
            "hidden_size": 512,
            "n_heads": 8,
            "n_kv_heads": 2,
            "params": 1e8,
            "dtype": "bf16",
        }
    }
    spec = _load(data)
    m = spec.models["tiny"]
    assert (m.n_layers, m.head_dim, m.n_kv_heads, m.dtype_bytes) == (4, 64, 2, 2)


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda d: d["machines"][0].update(gpu="V200"), "c.yaml: machines[0].gpu", "unknown GPU 'V200'"),
        (lambda d: d["machines"][0].update(gpus=0), "c.yaml: machines[0].gpus", "must be >= 1, got 0"),
        (lambda d: d["machines"][0].update(gpus="8"), "c.yaml: machines[0].gpus", "expected an integer"),
        (lambda d: d["machines"][0].pop("name"), "c.yaml: machines[0].name", "missing"),
        (lambda d: d["machines"][0].update(price_per_hour=-1), "c.yaml: machines[0].price_per_hour", ">= 0"),
        (lambda d: d["machines"][0].update(colour="red"), "c.yaml: machines[0].colour", "unknown field"),
        (
            lambda d: d["machines"][0].update(model="gpt-5"),
            "c.yaml: machines[0].model",
            "unknown model 'gpt-5'",
        ),
        (lambda d: d["machines"].append(dict(d["machines"][0])), "c.yaml: machines[1].name", "duplicate"),
        (lambda d: d.update(model="Llama-9"), "c.yaml: model.catalog", "unknown model 'Llama-9'"),
        (lambda d: d.update(machines=[]), "c.yaml: machines", "non-empty list"),
        (
            lambda d: d.update(engine={"gpu_memory_utilization": 1.5}),
            "c.yaml: engine.gpu_memory_utilization",
            "<= 1",
        ),
        (lambda d: d.update(engine={"max_num_seqs": -4}), "c.yaml: engine.max_num_seqs", "must be >= 1"),
        (
            lambda d: d.update(engine={"max_num_seqs": 512, "max_num_batched_tokens": 256}),
            "c.yaml: engine.max_num_batched_tokens",
            "256 must be >= max_num_seqs (512)",
        ),
        (lambda d: d.update(engine={"max_model_len": 100_000}), "c.yaml: engine.max_model_len", "exceeds"),
        (
            lambda d: d.update(engine={"tp_degrees": [1, 3]}),
            "c.yaml: engine.tp_degrees[1]",
            "TP 3 does not divide model 'Llama-3-8B''s 32 attention heads",
        ),
        (
            lambda d: d.update(engine={"tp_degrees": [1, "2"]}),
            "c.yaml: engine.tp_degrees[1]",
            "expected an integer",
        ),
        (
            lambda d: d.update(constraints={"slo": {"rate_rps": 5}}),
            "c.yaml: constraints.slo",
            "ttft_s, tpot_s",
        ),
        (
            lambda d: d.update(constraints={"min_instances": 0}),
            "c.yaml: constraints.min_instances",
            "must be >= 1",
        ),
        (lambda d: d.update(workload={"requests": 0}), "c.yaml: workload.requests", "must be >= 1"),
        (lambda d: d.update(deploy={"engine": "tgi"}), "c.yaml: deploy.engine", "only 'vllm'"),
        (
            lambda d: d.update(deploy={"policy": "fastest"}),
            "c.yaml: deploy.policy",
            "unknown policy 'fastest'",
        ),
        (
            lambda d: d.update(profiles=[{"gpu": "V100-SXM2-32GB", "tp": 1}]),
            "c.yaml: profiles[0].path",
            "missing",
        ),
        (
            lambda d: d.update(profiles=[{"gpu": "V100-SXM2-32GB", "tp": 1, "path": "nope.yaml"}]),
            "c.yaml: profiles[0].path",
            "cannot read",
        ),
        (lambda d: d.update(banana=1), "c.yaml: <root>.banana", "unknown field"),
    ],
)
def test_invalid_clusters_name_the_field(mutate: Any, field: str, words: str, tmp_path: Path) -> None:
    data = _base()
    mutate(data)
    with pytest.raises(ClusterError) as info:
        _load(data, tmp_path)
    assert str(info.value).startswith(field + ":"), str(info.value)
    assert words in str(info.value)


def test_inline_model_errors_name_the_field() -> None:
    data = _base()
    del data["model"]
    data["models"] = {"m": {"n_layers": 4, "hidden_size": 512, "n_heads": 8, "n_kv_heads": 3, "params": 1e8}}
    with pytest.raises(ClusterError, match=r"c\.yaml: models\.m\.n_kv_heads: 3 does not divide n_heads=8"):
        _load(data)
    data["models"]["m"] = {"n_layers": 4, "hidden_size": 512, "n_heads": 8, "params": 1e8, "dtype": "fp12"}
    with pytest.raises(ClusterError, match=r"models\.m\.dtype: expected one of"):
        _load(data)


def test_several_models_need_a_model_per_machine() -> None:
    data = _base()
    del data["model"]
    data["models"] = {"a": "Llama-3-8B", "b": "Llama-2-7B"}
    with pytest.raises(ClusterError, match=r"machines\[0\]\.model: missing"):
        _load(data)


def test_slo_needs_a_single_model() -> None:
    data = _base()
    del data["model"]
    data["models"] = {"a": "Llama-3-8B", "b": "Llama-2-7B"}
    data["machines"][0]["model"] = "a"
    data["constraints"] = {"slo": {"rate_rps": 5, "tpot_s": 0.1}}
    with pytest.raises(ClusterError, match=r"constraints\.slo: .*single-model"):
        _load(data)


def test_profiles_resolve_relative_to_the_file(tmp_path: Path) -> None:
    prof = LatencyProfile(LatencyParams(*([1e-3] * 8)), 1000, "test", EngineLimits(max_num_seqs=8))
    save_profile(prof, tmp_path / "v100-tp1.yaml")
    data = _base()
    data["profiles"] = [{"gpu": "v100-sxm2-32gb", "tp": 1, "path": "v100-tp1.yaml"}]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    spec = load_cluster(tmp_path / "c.yaml", GPUS, MODELS)
    key = ("V100-SXM2-32GB", 1, "Llama-3-8B")
    assert spec.profiles[key].kv_capacity_tokens == 1000
    assert spec.profile_paths[key] == str(tmp_path / "v100-tp1.yaml")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"missing\.yaml: <file>: cannot read"):
        load_cluster(tmp_path / "missing.yaml", GPUS, MODELS)
    bad = tmp_path / "bad.yaml"
    bad.write_text("machines: [", encoding="utf-8")
    with pytest.raises(ClusterError, match=r"bad\.yaml: <file>: not valid YAML"):
        load_cluster(bad, GPUS, MODELS)
