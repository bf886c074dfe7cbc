"""Roofline step model: the calibration.md formula, monotonicity, and the fit to published measurements."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hetroute.catalog.roofline import (
    calibration_rows,
    calibration_table_markdown,
    decode_step_s,
    main,
    prefill_step_s,
    step_cost,
)
from hetroute.catalog.specs import WeightsDoNotFit, kv_bytes_per_token, load_gpu_catalog, load_model_catalog
from hetroute.latency import profile_from_dict, profile_to_dict
from hetroute.prior import roofline_prior_profile

GPUS = load_gpu_catalog()
MODELS = load_model_catalog()

# The error bounds docs/calibration.md states for the shipped catalog.
MEAN_ABS_ERROR_BOUND = 0.06
WORST_ABS_ERROR_BOUND = 0.30


def test_full_overlap_reduces_to_the_calibration_formula() -> None:
    gpu = dataclasses.replace(GPUS["A100-80GB"], compute_overlap=1.0, layer_overhead_s=0.0)
    model = MODELS["Llama-3-8B"]
    peak = 312e12
    c = gpu.step_overhead_s
    # decode_step(B, Σctx) = max((2P + kv·Σctx)/(BW·eff), 2PB/(peak·mfu_d)) + c_step   (TP = 1)
    b, ctx = 64, 700
    mem = (2 * model.params + kv_bytes_per_token(model) * b * ctx) / (2039e9 * gpu.decode_bw_eff)
    comp = 2 * model.params * b / (peak * gpu.decode_mfu)
    assert decode_step_s(gpu, model, 1, b, ctx) == pytest.approx(max(mem, comp) + c)
    # prefill_step(n) = (2Pn + 4·L·d·n·(n/2)) / (peak·mfu_p) + c_step when compute-bound
    n = 4096
    flops = 2 * model.params * n + 4 * model.n_layers * model.hidden_size * n * (n / 2)
    assert prefill_step_s(gpu, model, 1, n) == pytest.approx(flops / (peak * gpu.prefill_mfu) + c)


def test_monotone_in_work_and_tp_helps_small_batches() -> None:
    gpu, model = GPUS["V100-SXM2-32GB"], MODELS["Llama-3-8B"]
    prefill = [prefill_step_s(gpu, model, 1, n) for n in (1, 64, 512, 2048, 8192)]
    decode = [decode_step_s(gpu, model, 1, b, 512) for b in (1, 8, 64, 256)]
    assert prefill == sorted(prefill) and decode == sorted(decode)
    assert decode_step_s(gpu, model, 4, 1, 512) < decode_step_s(gpu, model, 1, 1, 512)
    assert decode_step_s(gpu, model, 1, 64, 2048) > decode_step_s(gpu, model, 1, 64, 128)  # KV reads cost
    # faster GPUs are faster
    assert decode_step_s(GPUS["H100-SXM"], model, 1, 32, 512) < decode_step_s(GPUS["T4"], model, 1, 32, 512)


def test_tp_adds_communication_and_empty_step_is_free() -> None:
    gpu, model = GPUS["A100-80GB"], MODELS["Llama-2-70B"]
    one, two = step_cost(gpu, model, 1), step_cost(gpu, model, 2)
    assert one.comm_s_per_token == 0.0 and two.comm_s_per_token > 0.0
    assert two.fixed_s > one.fixed_s
    assert two.step_s(0, 0.0, 0, 0) == 0.0


def test_prediction_matches_published_measurements_within_stated_error() -> None:
    rows = calibration_rows(GPUS, MODELS)
    assert len(rows) == 42
    errors = [abs(err) for _, _, err in rows]
    assert sum(errors) / len(errors) <= MEAN_ABS_ERROR_BOUND
    assert max(errors) <= WORST_ABS_ERROR_BOUND


def test_calibration_table_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--calibration-table"]) == 0
    out = capsys.readouterr().out
    assert out == calibration_table_markdown(GPUS, MODELS) + "\n"
    assert "| A100-80GB | 2 | prefill | 8192 tok | ms | 2990 |" in out


def test_docs_calibration_table_is_current() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "calibration.md"
    assert calibration_table_markdown(GPUS, MODELS) in doc.read_text(encoding="utf-8")


def test_roofline_prior_profile_fits_the_engine_model() -> None:
    gpu, model = GPUS["V100-SXM2-32GB"], MODELS["Llama-3-8B"]
    profile = roofline_prior_profile(gpu, model, 1, max_num_seqs=128)
    assert profile.source == "roofline-prior" and profile.kv_capacity_source == "catalog"
    assert profile.kv_capacity_tokens == 97008  # 6063 blocks of 16
    assert profile.limits.max_num_seqs == 128 and profile.limits.max_model_len == 8192
    assert profile.labels == {"gpu": "V100-SXM2-32GB", "model": "Llama-3-8B", "tp": "1", "engine": "vllm"}
    q = profile.quality
    assert q is not None and q.heldout_batches > 20
    assert q.prefill_mape < 0.06 and q.decode_mape < 0.06 and q.decode_r2 > 0.95
    for b, length in ((3, 300), (48, 1500), (100, 700)):
        expected = decode_step_s(gpu, model, 1, b, length)
        assert profile.params.decode_step_s(b, length) == pytest.approx(expected, rel=0.08)
    assert profile_from_dict(profile_to_dict(profile)) == profile
    assert profile.amortised_request_s(200, 200) > 0


def test_roofline_prior_needs_the_weights_to_fit() -> None:
    with pytest.raises(WeightsDoNotFit):
        roofline_prior_profile(GPUS["T4"], MODELS["Llama-2-70B"], 1)
    faster = roofline_prior_profile(GPUS["V100-SXM2-32GB"], MODELS["Llama-3-8B"], 4)
    slower = roofline_prior_profile(GPUS["V100-SXM2-32GB"], MODELS["Llama-3-8B"], 1)
    assert faster.params.decode_step_s(1, 500) < slower.params.decode_step_s(1, 500)
    assert faster.kv_capacity_tokens > 4 * slower.kv_capacity_tokens
