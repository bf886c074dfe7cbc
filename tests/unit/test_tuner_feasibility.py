"""Memory feasibility (method.md §2): GQA-correct KV capacity, weights, max_model_len, TP vs heads."""

from __future__ import annotations

import pytest

from hetroute.catalog.specs import GIB, GpuSpec, ModelSpec, load_gpu_catalog, load_model_catalog
from hetroute.tuner.cluster import EngineSettings
from hetroute.tuner.feasibility import check_instance


@pytest.fixture(scope="module")
def gpus() -> dict[str, GpuSpec]:
    return load_gpu_catalog()


@pytest.fixture(scope="module")
def models() -> dict[str, ModelSpec]:
    return load_model_catalog()


def test_llama3_8b_on_one_v100_matches_the_formula(
    gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]
) -> None:
    f = check_instance(gpus["V100-SXM2-32GB"], models["Llama-3-8B"], 1, EngineSettings(max_model_len=2048))
    free = 1 * (32 * GIB * 0.9 - 2 * GIB) - 8.03e9 * 2
    per_token = 2 * 32 * 8 * 128 * 2  # 128 KiB: 8 KV heads, not 32
    assert per_token == 128 * 1024
    assert f.feasible and f.reason is None
    assert f.kv_capacity_tokens == int(free // per_token)


def test_capacity_grows_superlinearly_with_tp(gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]) -> None:
    caps: list[int] = []
    for tp in (1, 2, 4, 8):
        cap = check_instance(
            gpus["V100-SXM2-32GB"], models["Llama-3-8B"], tp, EngineSettings()
        ).kv_capacity_tokens
        assert cap is not None
        caps.append(cap)
    assert caps == sorted(caps)
    assert caps[1] > 2 * caps[0]  # the weights are paid once per instance


def test_gqa_model_has_four_times_the_capacity_of_mha(
    gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]
) -> None:
    gpu = gpus["A100-80GB"]
    eng = EngineSettings(max_model_len=2048)
    llama3 = check_instance(gpu, models["Llama-3-8B"], 1, eng)
    llama2 = check_instance(gpu, models["Llama-2-7B"], 1, eng)
    assert llama3.kv_capacity_tokens is not None and llama2.kv_capacity_tokens is not None
    # Llama-2-7B has fewer weights but 4x the KV per token
    assert 3.0 < llama3.kv_capacity_tokens / llama2.kv_capacity_tokens < 4.0


def test_weights_that_do_not_fit_give_a_reason(
    gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]
) -> None:
    f = check_instance(gpus["V100-SXM2-32GB"], models["DeepSeek-R1-Distill-Qwen-14B"], 1, EngineSettings())
    assert not f.feasible
    assert f.reason is not None and "weights need 27.5 GiB per GPU" in f.reason
    assert f.kv_capacity_tokens is None


def test_tp_must_divide_the_heads(gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]) -> None:
    f = check_instance(gpus["H100-SXM"], models["DeepSeek-R1-Distill-Qwen-14B"], 3, EngineSettings())
    assert not f.feasible
    assert f.reason == "TP3 does not divide the model's 40 attention heads"
    assert check_instance(
        gpus["H100-SXM"], models["DeepSeek-R1-Distill-Qwen-14B"], 8, EngineSettings()
    ).feasible


def test_capacity_below_max_model_len_is_infeasible(
    gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]
) -> None:
    f = check_instance(
        gpus["L4"], models["Llama-3-8B"], 1, EngineSettings(max_model_len=None, overhead_gib_per_gpu=4.75)
    )
    assert not f.feasible
    assert f.reason is not None and "< max_model_len 8192" in f.reason
    assert f.kv_capacity_tokens is not None and f.kv_capacity_tokens < 8192


def test_engine_tp_degrees_restricts_candidates(
    gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]
) -> None:
    f = check_instance(gpus["H100-SXM"], models["Llama-3-8B"], 8, EngineSettings(tp_degrees=(1, 2)))
    assert not f.feasible and f.reason is not None and "tp_degrees" in f.reason
