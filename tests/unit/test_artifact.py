"""The profile artifact: built from a fit, judged, written, read back by the router's loader."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from hetroute.errors import HetrouteError
from hetroute.latency import LatencyParams, ProfileError, load_profile, profile_to_dict, save_profile
from profiling.artifact import build_profile, judge, sweep_summary
from profiling.batches import BatchRecord, BatchShape, burst_read, disturbed, undecided
from profiling.calibrate import Calibration, PromptMaker
from profiling.client import RequestRecord
from profiling.collect import QueueWatch, SweepConfig, SweepResult, default_input_lens, plan_sweep
from profiling.discover import EngineInfo, parse_cache_config_info
from profiling.fit import BatchSample, DecodeSample, FitResult, PrefillSample, fit_batches

TRUE = LatencyParams(2e-6, 1.5e-3, 6e-5, 0.012, 1e-8, 2e-4, 3e-7, 0.018)
INFO = EngineInfo(
    engine="vllm",
    model="Llama-3-8B",
    kv_capacity_tokens=97008,
    kv_capacity_source="vllm:cache_config_info",
    max_model_len=8192,
    max_num_seqs=None,
    engine_version="0.32.0",
)


def noisy_fit(noise: float) -> FitResult:
    rng = np.random.default_rng(5)
    batches = [
        BatchSample(
            PrefillSample(b, i, TRUE.prefill_s(b, i) * (1 + noise * rng.standard_normal())),
            DecodeSample(b, i, 63, TRUE.decode_s(b, i, 63) * (1 + noise * rng.standard_normal())),
        )
        for b in (1, 2, 4, 8, 16)
        for i in (128, 512, 1024)
        for _ in range(4)
    ]
    return fit_batches(batches, 0.25, random.Random(0))


def summary() -> dict[str, object]:
    cal = Calibration(1.0, 3.0, "exact", True)
    rec = RequestRecord(0.1, 0.9, 130, 64, 64, "length")
    sweep = SweepResult(batches=[BatchRecord(BatchShape(2, 128, 64), (rec, rec))], planned=3, requests_sent=6)
    return sweep_summary(SweepConfig(), sweep, cal, 0.25, 7)


def test_profile_round_trips_through_the_routers_loader(tmp_path: Path) -> None:
    fit = noisy_fit(0.01)
    profile = build_profile(INFO, fit, summary(), {"gpu": "V100-SXM2-32GB", "tp": "1", "unused": None})
    path = tmp_path / "v100.yaml"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    assert loaded.params.as_tuple() == pytest.approx(fit.params)
    assert loaded.stderr is not None and loaded.stderr.as_tuple() == pytest.approx(fit.stderr)
    assert loaded.kv_capacity_tokens == 97008
    assert loaded.kv_capacity_source == "vllm:cache_config_info"
    assert loaded.limits.max_model_len == 8192 and loaded.limits.max_num_seqs is None
    assert loaded.labels == {
        "engine": "vllm",
        "model": "Llama-3-8B",
        "engine_version": "0.32.0",
        "gpu": "V100-SXM2-32GB",
        "tp": "1",
    }
    assert loaded.quality is not None
    assert loaded.quality.heldout_batches == fit.heldout_batches == 15
    assert loaded.quality.decode_mape == pytest.approx(fit.decode_heldout.mape)
    assert loaded.sweep["batch_sizes"] == [2] and loaded.sweep["output_control"] == "exact"
    # The artifact predicts what the true model does.
    assert loaded.params.decode_s(8, 512, 63) == pytest.approx(TRUE.decode_s(8, 512, 63), rel=0.02)


def test_judge_accepts_good_and_refuses_bad_fits() -> None:
    assert judge(noisy_fit(0.01), 0.05).accepted
    bad = judge(noisy_fit(0.3), 0.10)
    assert not bad.accepted and "above 10.0%" in bad.reason


def test_judge_refuses_a_fit_with_nothing_held_out() -> None:
    batches = [
        BatchSample(
            PrefillSample(b, 128, TRUE.prefill_s(b, 128)), DecodeSample(b, 128, 9, TRUE.decode_s(b, 128, 9))
        )
        for b in (1, 2, 4, 8)
    ]
    fit = fit_batches(batches, 0.25, random.Random(0))
    assert fit.heldout_batches == 0
    verdict = judge(fit, 0.10)
    assert not verdict.accepted and "no held-out" in verdict.reason


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d["params"].pop("p5"), "params.p5"),
        (lambda d: d["params"].update(p2="fast"), "params.p2"),
        (lambda d: d["kv_capacity"].update(tokens=-3), "kv_capacity.tokens"),
        (lambda d: d["quality"].update(decode_mape=float("nan")), "quality.decode_mape"),
        (lambda d: d["quality"].update(mape=0.1), "quality.mape"),
        (lambda d: d["limits"].update(max_num_seqs=0), "limits.max_num_seqs"),
        (lambda d: d.update(source="guessed"), "source"),
    ],
)
def test_corrupt_or_incompatible_artifact_names_file_and_field(
    tmp_path: Path, edit: object, field: str
) -> None:
    data = profile_to_dict(build_profile(INFO, noisy_fit(0.01), summary(), {}))
    edit(data)  # type: ignore[operator]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value) and field in str(err.value)
    assert err.value.field_path == field


def test_truncated_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "trunc.yaml"
    path.write_text("schema_version: 1\nparams: {p1: [")
    with pytest.raises(ProfileError, match="trunc.yaml: <file>: not valid YAML"):
        load_profile(path)


def test_profile_error_is_a_hetroute_error_and_still_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(HetrouteError) as err:
        load_profile(path)
    assert isinstance(err.value, ProfileError) and isinstance(err.value, ValueError)
    assert str(err.value).startswith(f"{path}: <file>: cannot read")
    assert err.value.source == str(path) and err.value.field_path == "<file>"


METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.92",kv_cache_size_tokens="8192",num_cpu_blocks="None",num_gpu_blocks="256"} 1.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_parse_cache_config_info_reads_blocks_and_block_size() -> None:
    assert parse_cache_config_info(METRICS) == (256, 32)
    assert parse_cache_config_info("vllm:num_requests_running 0.0\n") is None
    assert parse_cache_config_info('vllm:cache_config_info{block_size="16"} 1.0') is None


def test_plan_covers_every_feasible_shape_per_pass_within_bounds() -> None:
    info = EngineInfo("vllm", "m", kv_capacity_tokens=8192, kv_capacity_source="x", max_model_len=1024)
    cfg = SweepConfig(batch_sizes=(1, 4, 16, 64), input_lens=(128, 900), output_lens=(64, 128), reps=2)
    plan = plan_sweep(cfg, info, random.Random(0))
    shapes = set(plan)
    # 64 > max_concurrency 32; 900+128 > 1024; b·(I+O) must stay under 90 % of 8192.
    assert all(s.batch <= 32 and s.input_tokens + s.output_tokens <= 1024 for s in shapes)
    assert all(s.batch * (s.input_tokens + s.output_tokens) <= 0.9 * 8192 for s in shapes)
    assert BatchShape(16, 900, 64) not in shapes and BatchShape(4, 900, 128) not in shapes
    assert BatchShape(16, 128, 128) in shapes
    assert BatchShape(4, 128, 128) in shapes and BatchShape(1, 900, 64) in shapes
    half = len(plan) // 2
    assert set(plan[:half]) == set(plan[half:]) == shapes  # each pass visits every shape once
    assert plan[:half] != plan[half:]  # ... in a freshly shuffled order
    limited = plan_sweep(
        SweepConfig(batch_sizes=(1, 4), input_lens=(128,), max_requests=12), info, random.Random(0)
    )
    assert sum(s.batch for s in limited) + 4 <= 12  # the warm-up batch of 4 counts


def test_default_input_lens_fit_the_model_length() -> None:
    assert default_input_lens(8192, 128) == (128, 512, 1024, 2048)
    assert default_input_lens(1024, 128) == (128, 512)
    assert default_input_lens(100, 64) == (18,)


def rec(first: float, end: float, prompt: int = 130, out: int = 64) -> RequestRecord:
    return RequestRecord(first, end, prompt, out, out, "length")


def test_batch_record_turns_into_prefill_and_decode_samples() -> None:
    batch = BatchRecord(BatchShape(2, 128, 64), (rec(0.10, 1.0, 129), rec(0.15, 1.2, 131)))
    sample = batch.to_sample()
    assert sample.prefill == PrefillSample(2, 131, 0.15)
    assert sample.decode is not None
    assert (sample.decode.batch, sample.decode.input_tokens, sample.decode.steps) == (2, 131, 63)
    assert sample.decode.time_s == pytest.approx(1.05)
    assert sample.config == (2, 128, 64)  # grouped by the requested shape
    assert not batch.queued


def test_a_batch_the_engine_queued_is_detected() -> None:
    assert BatchRecord(BatchShape(2, 128, 64), (rec(0.1, 0.5), rec(0.6, 1.0))).queued


def test_queue_watch_needs_two_strikes_before_capping_batch_sizes() -> None:
    queued = BatchRecord(BatchShape(8, 128, 64), (rec(0.1, 0.5),) * 4 + (rec(0.6, 1.0),) * 4)
    assert queued.ran_together == 4
    watch = QueueWatch()
    first = watch.observe(queued)
    assert "dropped" in first and not watch.blocks(8)
    second = watch.observe(queued)
    assert "batch sizes >= 8 skipped" in second
    assert watch.blocks(8) and watch.blocks(16) and not watch.blocks(4)
    assert watch.limit_batch == 8 and watch.ran_together == 4


def test_disturbed_batches_are_those_far_from_their_shapes_median() -> None:
    a, b = BatchShape(2, 128, 64), BatchShape(4, 128, 64)
    ok = BatchRecord(a, (rec(0.10, 1.0), rec(0.10, 1.0)))
    slow_decode = BatchRecord(a, (rec(0.10, 2.0), rec(0.10, 2.0)))
    slow_prefill = BatchRecord(a, (rec(0.30, 1.2), rec(0.30, 1.2)))
    pair = [BatchRecord(b, (rec(0.1, 1.0),) * 4), BatchRecord(b, (rec(0.1, 5.0),) * 4)]
    batches = [ok, slow_decode, ok, slow_prefill, ok, *pair]
    # 2 batches of shape b cannot say which one is off, so neither is flagged.
    assert disturbed(batches, 0.25) == [1, 3]
    assert disturbed(batches, 2.5) == []


def test_prompt_maker_hits_the_token_target_and_never_repeats_a_prefix() -> None:
    maker = PromptMaker(
        "run7", Calibration(tokens_per_word=2.0, offset_tokens=6.0, control="exact", input_measured=True)
    )
    first, second = maker.make(206), maker.make(206)
    assert first.startswith("run7-1:") and second.startswith("run7-2:")
    assert first.count(" the") == second.count(" the") == 100  # (206 - 6) / 2 filler words
    assert maker.make(1).count(" the") == 1


def test_queueing_below_a_width_that_already_ran_whole_is_a_hiccup_not_a_limit() -> None:
    watch = QueueWatch()
    watch.ran_whole(BatchRecord(BatchShape(16, 128, 8), (rec(0.1, 0.5),) * 16))
    queued = BatchRecord(BatchShape(2, 128, 64), (rec(0.1, 0.5), rec(0.6, 1.0)))
    for _ in range(3):
        assert "not a limit" in watch.observe(queued)
    assert not watch.blocks(2) and not watch.blocks(32) and watch.limit_batch is None


def test_two_disagreeing_batches_of_a_shape_ask_for_a_third() -> None:
    a, b = BatchShape(2, 128, 64), BatchShape(4, 128, 64)
    batches = [
        BatchRecord(a, (rec(0.1, 1.0),) * 2),
        BatchRecord(a, (rec(0.1, 0.102),) * 2),  # decode read in one burst
        BatchRecord(b, (rec(0.1, 1.0),) * 4),
        BatchRecord(b, (rec(0.11, 1.05),) * 4),
    ]
    assert undecided(batches, 0.25) == [a]


def test_a_stream_read_in_one_burst_is_disturbed_even_when_its_shape_has_no_siblings() -> None:
    width4 = [BatchRecord(BatchShape(4, i, 64), (rec(0.1, 0.1 + 0.6),) * 4) for i in (128, 256, 512)]
    burst = BatchRecord(BatchShape(4, 1024, 64), (rec(0.5, 0.5005),) * 4)
    assert burst_read([*width4, burst]) == [3]
    assert disturbed([*width4, burst], 0.25) == [3]
