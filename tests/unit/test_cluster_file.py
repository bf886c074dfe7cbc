"""Cluster-file parsing, validation and resolution against the catalogs (hetroute/sim/cluster_file.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetroute.catalog.specs import kv_capacity_tokens, load_gpu_catalog, load_model_catalog
from hetroute.errors import ConfigError
from hetroute.sim.cluster_file import build_fleet, load_cluster_file, parse_cluster
from hetroute.sim.scenarios import SCENARIOS, get_scenario

REPO = Path(__file__).resolve().parents[2]
GPUS = load_gpu_catalog()
MODELS = load_model_catalog()


def _err(data: Any, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        parse_cluster(data, **kw)
    return err.value


def test_defaults_count_and_engine_args_merge() -> None:
    spec = parse_cluster(
        {
            "defaults": {"model": "Llama-3-8B", "engine_args": {"max_num_seqs": 64, "block_size": 32}},
            "instances": [
                {"gpu": "A100-80GB", "count": 2, "engine_args": {"max_num_seqs": 8}},
                {"name": "t", "gpu": "T4", "tp": 2, "engine": "tgi", "weight": 0.5},
            ],
        },
        default_name="c",
    )
    assert spec.name == "c"
    assert [i.name for i in spec.instances] == ["A100-80GB-tp1-0", "A100-80GB-tp1-1", "t"]
    assert spec.instances[0].engine_args == {"max_num_seqs": 8, "block_size": 32}
    assert spec.instances[2].engine == "tgi" and spec.instances[2].tp == 2 and spec.instances[2].weight == 0.5
    assert spec.models() == ("Llama-3-8B",)
    assert spec.gpus_total() == 4


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ([], "<root>"),
        ({"instances": []}, "instances"),
        ({"instances": [{"gpu": "T4", "model": "m"}], "extra": 1}, "extra"),
        ({"instances": [{"gpu": "T4", "model": "m", "tpp": 2}]}, "instances[0].tpp"),
        ({"instances": [{"gpu": "T4", "model": "m", "tp": 0}]}, "instances[0].tp"),
        ({"instances": [{"gpu": "T4", "model": "m", "tp": True}]}, "instances[0].tp"),
        ({"instances": [{"model": "m"}]}, "instances[0].gpu"),
        ({"instances": [{"gpu": "T4"}]}, "instances[0].model"),
        ({"instances": [{"gpu": "T4", "model": "m", "engine": "sglang"}]}, "instances[0].engine"),
        ({"instances": [{"gpu": "T4", "model": "m", "weight": 0}]}, "instances[0].weight"),
        ({"instances": [{"gpu": "T4", "model": "m", "count": -1}]}, "instances[0].count"),
        (
            {"instances": [{"gpu": "T4", "model": "m", "engine_args": {"max_seqs": 1}}]},
            "instances[0].engine_args.max_seqs",
        ),
        (
            {"instances": [{"gpu": "T4", "model": "m", "engine_args": {"gpu_memory_utilization": 1.5}}]},
            "instances[0].engine_args.gpu_memory_utilization",
        ),
        (
            {"instances": [{"gpu": "T4", "model": "m", "engine_args": {"enable_chunked_prefill": 1}}]},
            "instances[0].engine_args.enable_chunked_prefill",
        ),
        ({"defaults": {"count": 2}, "instances": [{"gpu": "T4", "model": "m"}]}, "defaults.count"),
        ({"instances": [{"gpu": "T4", "model": "m"}, {"gpu": "T4", "model": "m"}]}, "instances"),
    ],
)
def test_errors_name_the_field(data: Any, path: str) -> None:
    assert _err(data).path == path


def test_catalog_names_are_checked_when_given() -> None:
    err = _err({"instances": [{"gpu": "Z100", "model": "Llama-3-8B"}]}, known_gpus=GPUS, known_models=MODELS)
    assert err.path == "instances[0].gpu" and "H100-SXM" in err.message


def test_example_file_equals_the_builtin_scenario() -> None:
    from_file = load_cluster_file(REPO / "config/simulate/paper-a.yaml", known_gpus=GPUS, known_models=MODELS)
    builtin = get_scenario("paper-a").cluster()
    assert from_file == builtin


def test_every_example_file_builds() -> None:
    files = sorted((REPO / "config/simulate").glob("*.yaml"))
    assert len(files) >= 2
    for path in files:
        fleet = build_fleet(load_cluster_file(path))
        assert all(b.kv_capacity_tokens and b.kv_capacity_tokens > 0 for b in fleet.backends)


def test_file_errors_carry_the_file_name_and_relative_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("instances:\n  - {gpu: T4, model: Llama-3-8B, tp: zero}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_cluster_file(bad)
    assert err.value.path == f"{bad}: instances[0].tp"
    good = tmp_path / "sub" / "c.yaml"
    good.parent.mkdir()
    good.write_text(
        "instances:\n  - {gpu: T4, model: Llama-3-8B, tp: 2, profile: p.yaml}\n", encoding="utf-8"
    )
    spec = load_cluster_file(good)
    assert spec.name == "c"
    assert spec.instances[0].profile_path == str(good.parent / "p.yaml")
    with pytest.raises(ConfigError) as err:
        build_fleet(spec)  # the profile file does not exist
    assert err.value.path == "instances[0].profile"
    with pytest.raises(ConfigError, match="not valid YAML"):
        bad.write_text("instances: [", encoding="utf-8")
        load_cluster_file(bad)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenarios_fit_and_capacity_matches_the_catalog(name: str) -> None:
    fleet = build_fleet(get_scenario(name).cluster(known_gpus=GPUS, known_models=MODELS))
    for inst, backend, config in zip(fleet.cluster.instances, fleet.backends, fleet.configs, strict=True):
        cap = kv_capacity_tokens(GPUS[inst.gpu], MODELS[inst.model], inst.tp)
        assert backend.kv_capacity_tokens == cap // config.block_size * config.block_size
        assert backend.kv_capacity_tokens >= MODELS[inst.model].max_model_len  # method.md §2 feasibility
        assert backend.gpu == inst.gpu and backend.tp == inst.tp and backend.models == (inst.model,)
        assert backend.url == f"sim://{inst.name}"


def test_scenario_shapes() -> None:
    a = build_fleet(get_scenario("paper-a").cluster())
    assert [(b.gpu, b.tp, b.weight) for b in a.backends] == [
        ("V100-SXM2-32GB", 4, 4.0),
        ("V100-SXM2-32GB", 1, 1.0),
    ]
    b = build_fleet(get_scenario("paper-b").cluster())
    assert [(x.gpu, x.tp) for x in b.backends] == [("V100-SXM2-32GB", 2)] * 4 + [("A800-80GB-PCIe", 1)]
    m = build_fleet(get_scenario("mixed").cluster())
    assert sorted(x.gpu or "" for x in m.backends for _ in range(x.tp or 1)) == sorted(
        ["H100-SXM", "A100-80GB", "A100-80GB", "L4", "L4", "T4", "T4"]
    )
    with pytest.raises(ConfigError) as err:
        get_scenario("paper-z")
    assert "paper-a" in err.value.message


def test_a_model_that_does_not_fit_names_the_instance() -> None:
    spec = parse_cluster(
        {"instances": [{"gpu": "A100-80GB", "model": "Llama-3-8B"}, {"gpu": "T4", "model": "Llama-3-8B"}]}
    )
    with pytest.raises(ConfigError) as err:
        build_fleet(spec)
    assert err.value.path == "instances[1]"
    small = parse_cluster(
        {"instances": [{"gpu": "L4", "model": "Llama-3-8B", "engine_args": {"num_gpu_blocks_override": 64}}]}
    )
    with pytest.raises(ConfigError) as err:
        build_fleet(small)  # 1,024 tokens of KV cannot hold an 8,192-token request
    assert err.value.path == "instances[0].max_model_len"
    fits = parse_cluster(
        {
            "instances": [
                {
                    "gpu": "L4",
                    "model": "Llama-3-8B",
                    "engine_args": {"num_gpu_blocks_override": 64, "max_model_len": 1024},
                }
            ]
        }
    )
    fleet = build_fleet(fits)
    assert fleet.backends[0].kv_capacity_tokens == 1024
    assert fleet.max_model_len() == 1024
