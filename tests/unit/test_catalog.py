"""GPU/model catalogs: loading, validation errors naming file and field, KV arithmetic (method.md §2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hetroute.catalog.specs import (
    GIB,
    CatalogError,
    UnknownCatalogEntry,
    WeightsDoNotFit,
    kv_bytes_per_token,
    kv_capacity_tokens,
    load_gpu_catalog,
    load_model_catalog,
    lookup_gpu,
    lookup_model,
)
from hetroute.errors import ConfigError

GPU_ITEM = {
    "name": "X",
    "fp16_tflops": 100,
    "memory_gib": 40,
    "mem_bw_gbps": 1000,
    "interconnect": "nvlink",
    "interconnect_gbps": 300,
    "decode_bw_eff": 0.8,
    "prefill_mfu": 0.6,
    "decode_mfu": 0.4,
    "compute_overlap": 0.5,
    "step_overhead_s": 0.003,
    "layer_overhead_s": 0.0,
    "allreduce_latency_s": 0.00002,
}
MODEL_ITEM = {
    "name": "M",
    "n_layers": 4,
    "hidden_size": 256,
    "n_heads": 8,
    "n_kv_heads": 2,
    "head_dim": 32,
    "params": 1.0e8,
    "dtype_bytes": 2,
    "max_model_len": 2048,
}


def write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_default_catalogs_have_the_required_entries() -> None:
    gpus = load_gpu_catalog()
    models = load_model_catalog()
    for name in ("V100-SXM2-32GB", "T4", "L4", "A10", "A100-80GB", "A800-80GB-PCIe", "H100-SXM"):
        assert name in gpus
    for name in ("Llama-3-8B", "DeepSeek-R1-Distill-Qwen-14B", "Llama-2-7B", "Llama-2-70B"):
        assert name in models
    assert gpus["H100-SXM"].fp16_tflops == 989  # dense, not the sparse datasheet figure
    assert gpus["A800-80GB-PCIe"].mem_bw_gbps == 1935


def test_kv_bytes_per_token_is_gqa_correct() -> None:
    models = load_model_catalog()
    assert kv_bytes_per_token(models["Llama-3-8B"]) == 131072  # 2·32·8·128·2 = 128 KiB
    assert kv_bytes_per_token(models["Llama-2-7B"]) == 524288  # 2·32·32·128·2 = 512 KiB
    assert kv_bytes_per_token(models["Llama-2-70B"]) == 327680  # 2·80·8·128·2 = 320 KiB
    assert kv_bytes_per_token(models["DeepSeek-R1-Distill-Qwen-14B"]) == 196608  # 2·48·8·128·2


def test_kv_capacity_matches_method_formula() -> None:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    # V100 32 GiB, φ=0.9, δ=2 GiB: 26.8 GiB usable = 28,776,286,208 B; minus 16.06e9 B of weights
    # = 12,716,286,208 B; / 131,072 B per token = 97,017.7 tokens.
    assert kv_capacity_tokens(gpus["V100-SXM2-32GB"], models["Llama-3-8B"], 1) == 97017
    four = kv_capacity_tokens(gpus["V100-SXM2-32GB"], models["Llama-3-8B"], 4)
    assert four == int((4 * 26.8 * GIB - 16.06e9) // 131072)
    lower = kv_capacity_tokens(gpus["V100-SXM2-32GB"], models["Llama-3-8B"], 1, gpu_memory_utilization=0.8)
    assert lower < 97017


def test_weights_that_do_not_fit_raise_a_clear_error() -> None:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    with pytest.raises(WeightsDoNotFit, match=r"Llama-2-70B does not fit on 1x A100-80GB"):
        kv_capacity_tokens(gpus["A100-80GB"], models["Llama-2-70B"], 1)
    # 2·(72 − 2) GiB − 138 GB of weights = 11.5 GiB; / 320 KiB per token = 37.6 k tokens
    assert kv_capacity_tokens(gpus["A100-80GB"], models["Llama-2-70B"], 2) == 37609


def test_tp_must_divide_attention_heads() -> None:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    with pytest.raises(ValueError, match="does not divide"):
        kv_capacity_tokens(gpus["A100-80GB"], models["DeepSeek-R1-Distill-Qwen-14B"], 3)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mem_bw_gbps", -1, "gpus.yaml: gpus[3].mem_bw_gbps: must be > 0, got -1"),
        ("interconnect", "infiniband", "gpus.yaml: gpus[3].interconnect: expected one of nvlink, pcie"),
        ("decode_bw_eff", 1.5, "gpus.yaml: gpus[3].decode_bw_eff: must be <= 1, got 1.5"),
        ("compute_overlap", 2, "gpus.yaml: gpus[3].compute_overlap: must be <= 1, got 2"),
        ("fp16_tflops", "fast", "gpus.yaml: gpus[3].fp16_tflops: expected a finite number"),
    ],
)
def test_gpu_validation_names_file_and_field(tmp_path: Path, field: str, value: object, message: str) -> None:
    items = [dict(GPU_ITEM, name=f"G{i}") for i in range(4)]
    items[3][field] = value
    with pytest.raises(CatalogError) as info:
        load_gpu_catalog(write(tmp_path, "gpus.yaml", {"gpus": items}))
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ConfigError)
    assert info.value.field_path == f"gpus[3].{field}"


def test_gpu_missing_field_and_duplicates(tmp_path: Path) -> None:
    item = {k: v for k, v in GPU_ITEM.items() if k != "mem_bw_gbps"}
    with pytest.raises(CatalogError, match=r"gpus\[0\]\.mem_bw_gbps: missing"):
        load_gpu_catalog(write(tmp_path, "gpus.yaml", {"gpus": [item]}))
    with pytest.raises(CatalogError, match=r"gpus\[1\]\.name: duplicate name 'x'"):
        load_gpu_catalog(write(tmp_path, "gpus.yaml", {"gpus": [GPU_ITEM, dict(GPU_ITEM, name="x")]}))


def test_memory_gb_is_accepted_and_converted(tmp_path: Path) -> None:
    item = {k: v for k, v in GPU_ITEM.items() if k != "memory_gib"}
    item["memory_gb"] = 80
    gpu = load_gpu_catalog(write(tmp_path, "gpus.yaml", {"gpus": [item]}))["X"]
    assert gpu.memory_gib == pytest.approx(80e9 / GIB)


def test_model_validation(tmp_path: Path) -> None:
    bad = dict(MODEL_ITEM, n_kv_heads=3)
    with pytest.raises(
        CatalogError, match=r"models.yaml: models\[1\]\.n_kv_heads: 3 does not divide n_heads=8"
    ):
        load_model_catalog(write(tmp_path, "models.yaml", {"models": [dict(MODEL_ITEM, name="A"), bad]}))
    with pytest.raises(CatalogError, match=r"models\[0\]\.n_layers: expected an integer, got 2.5"):
        load_model_catalog(write(tmp_path, "models.yaml", {"models": [dict(MODEL_ITEM, n_layers=2.5)]}))
    model = load_model_catalog(
        write(tmp_path, "models.yaml", {"models": [dict(MODEL_ITEM, params="1.0e8")]})
    )["M"]
    assert model.params == 1.0e8  # YAML 1.1 reads "1.0e8" as a string; the loader accepts it
    assert model.kv_dtype_bytes == 2


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="gpus.yaml: <file>: cannot read"):
        load_gpu_catalog(tmp_path / "gpus.yaml")
    path = tmp_path / "models.yaml"
    path.write_text("models: [unclosed", encoding="utf-8")
    with pytest.raises(CatalogError, match="models.yaml: <file>: not valid YAML"):
        load_model_catalog(path)
    with pytest.raises(CatalogError, match="models.yaml: models: expected a top-level mapping"):
        load_model_catalog(write(tmp_path, "models.yaml", {"gpus": []}))


def test_lookup_is_case_insensitive_and_lists_valid_names() -> None:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    assert lookup_gpu(gpus, "t4").name == "T4"
    assert lookup_model(models, "meta-llama/Meta-Llama-3-8B-Instruct").name == "Llama-3-8B"
    with pytest.raises(UnknownCatalogEntry) as info:
        lookup_gpu(gpus, "B200")
    assert "unknown GPU 'B200'" in str(info.value) and "A100-80GB" in str(info.value)


def test_an_unknown_catalog_key_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CatalogError) as info:
        load_gpu_catalog(write(tmp_path, "gpus.yaml", {"gpus": [dict(GPU_ITEM, mem_bw_gpbs=900)]}))
    assert info.value.field_path == "gpus[0].mem_bw_gpbs" and "unknown field" in info.value.message
