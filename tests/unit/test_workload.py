"""Seeded workload generators and trace loading (hetroute/sim/workload.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hetroute.errors import ConfigError
from hetroute.sim.workload import (
    SimRequest,
    clip_to_model_len,
    generate_workload,
    load_trace,
    parse_rate,
    rate_label,
    retime,
)

SHARED_CONV = Path("/work/shared/data/traces/splitwise_conv.csv")


def _lengths(reqs: list[SimRequest]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([r.input_tokens for r in reqs], dtype=float),
        np.array([r.output_tokens for r in reqs], dtype=float),
    )


def test_same_seed_same_workload_and_other_seed_differs() -> None:
    a = generate_workload("sharegpt", 500, 8.0, seed=3)
    b = generate_workload("sharegpt", 500, 8.0, seed=3)
    c = generate_workload("sharegpt", 500, 8.0, seed=4)
    assert a == b
    assert [r.input_tokens for r in a] != [r.input_tokens for r in c]


def test_lengths_do_not_depend_on_rate() -> None:
    slow = generate_workload("azure-conv", 300, 2.0, seed=1)
    fast = generate_workload("azure-conv", 300, 50.0, seed=1)
    burst = generate_workload("azure-conv", 300, math.inf, seed=1)
    key = {r.request_id: (r.input_tokens, r.output_tokens) for r in slow}
    assert all(key[r.request_id] == (r.input_tokens, r.output_tokens) for r in fast + burst)
    assert all(r.arrival_s == 0.0 for r in burst)
    assert slow[-1].arrival_s > fast[-1].arrival_s * 10


def test_sharegpt_matches_calibration_statistics() -> None:
    inputs, outputs = _lengths(generate_workload("sharegpt", 20000, math.inf, seed=0))
    assert 200 <= inputs.mean() <= 235  # calibration.md: mean input ≈ 215-230
    assert 100 <= np.median(inputs) <= 150  # median ~100-150
    assert 190 <= outputs.mean() <= 210  # mean output ≈ 196-203
    assert 180 <= np.median(outputs) <= 220  # median ~200
    assert inputs.min() >= 4 and inputs.max() <= 1024
    assert (inputs + outputs).max() <= 2048
    assert 0.05 < np.corrcoef(inputs, outputs)[0, 1] < 0.4  # weak positive correlation


@pytest.mark.parametrize(
    ("kind", "in_mean", "in_p50", "out_mean", "out_p50"),
    [("azure-conv", 1155, 1020, 211, 129), ("azure-code", 2048, 1469, 28, 13)],
)
def test_azure_lengths_match_published_statistics(
    kind: str, in_mean: float, in_p50: float, out_mean: float, out_p50: float
) -> None:
    inputs, outputs = _lengths(generate_workload(kind, 40000, math.inf, seed=2))  # type: ignore[arg-type]
    assert inputs.mean() == pytest.approx(in_mean, rel=0.05)
    assert np.median(inputs) == pytest.approx(in_p50, rel=0.05)
    assert outputs.mean() == pytest.approx(out_mean, rel=0.08)
    assert np.median(outputs) == pytest.approx(out_p50, rel=0.08)


def test_azure_conv_p90() -> None:
    inputs, outputs = _lengths(generate_workload("azure-conv", 40000, math.inf, seed=5))
    assert np.percentile(inputs, 90) == pytest.approx(2734, rel=0.05)
    assert np.percentile(outputs, 90) == pytest.approx(424, rel=0.05)


def test_max_model_len_clips_prompt_then_output() -> None:
    reqs = generate_workload("azure-conv", 3000, 5.0, seed=0, max_model_len=2048)
    assert all(r.input_tokens + r.output_tokens <= 2048 for r in reqs)
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in reqs)
    assert clip_to_model_len(5000, 300, 2048) == (2047, 1)
    assert clip_to_model_len(1900, 300, 2048) == (1900, 148)
    assert clip_to_model_len(100, 30, 2048) == (100, 30)


def test_poisson_arrivals_have_the_requested_rate_and_cv() -> None:
    reqs = generate_workload("sharegpt", 20001, 16.0, seed=9)
    gaps = np.diff([r.arrival_s for r in reqs])
    assert reqs[0].arrival_s == 0.0
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / 16, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    bursty = generate_workload("sharegpt", 20001, 16.0, seed=9, arrival_cv=4.0)
    bgaps = np.diff([r.arrival_s for r in bursty])
    assert bgaps.mean() == pytest.approx(1 / 16, rel=0.1)
    assert bgaps.std() / bgaps.mean() == pytest.approx(4.0, rel=0.15)


def test_send_max_tokens_and_model() -> None:
    reqs = generate_workload("sharegpt", 50, 4.0, seed=0, send_max_tokens=True, model="m")
    assert all(r.max_tokens == r.output_tokens and r.model == "m" for r in reqs)
    assert all(r.max_tokens is None for r in generate_workload("sharegpt", 50, 4.0, seed=0))


def test_retime_keeps_lengths_and_ids() -> None:
    reqs = generate_workload("sharegpt", 100, math.inf, seed=0)
    moved = retime(reqs, 10.0, seed=1)
    assert [(r.request_id, r.input_tokens) for r in moved] == [(r.request_id, r.input_tokens) for r in reqs]
    assert moved[-1].arrival_s > 1.0


def test_parse_rate_and_label() -> None:
    assert parse_rate("8") == 8.0
    assert parse_rate(" INF ") == math.inf
    assert parse_rate("trace") == "trace"
    assert [rate_label(r) for r in (8.0, 12.5, math.inf, "trace")] == ["8", "12.5", "inf", "trace"]
    for bad in ("0", "-3", "fast", "nan"):
        with pytest.raises(ConfigError) as err:
            parse_rate(bad)
        assert err.value.path == "rates"


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        generate_workload("lmsys", 10, 1.0, seed=0)  # type: ignore[arg-type]
    assert err.value.path == "workload"


def _write_csv(path: Path) -> Path:
    rows = ["arrived_at,num_prefill_tokens,num_decode_tokens", "10.0,374,44", "10.5,396,109", "12.25,0,7"]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def test_csv_trace_keeps_timestamps_shifted_to_zero(tmp_path: Path) -> None:
    reqs = load_trace(_write_csv(tmp_path / "t.csv"))
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 374, 44),
        (0.5, 396, 109),
        (2.25, 1, 7),
    ]


def test_csv_trace_retimed_and_truncated(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "t.csv")
    reqs = load_trace(path, n=2, rate=math.inf, max_model_len=400)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [(0.0, 374, 26), (0.0, 396, 4)]


def test_jsonl_trace_timestamps_are_milliseconds(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    lines = [
        {"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]},
        {"timestamp": 4000, "input_length": 20, "output_length": 3, "hash_ids": [2]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    reqs = load_trace(path, send_max_tokens=True)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, r.max_tokens) for r in reqs] == [
        (0.0, 6758, 500, 500),
        (3.0, 20, 3, 3),
    ]


def test_trace_errors_name_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,12,x\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_trace(bad)
    assert err.value.path == f"{bad}:2"
    nocols = tmp_path / "nocols.csv"
    nocols.write_text("a,b\n1,2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="num_prefill_tokens"):
        load_trace(nocols)
    notime = tmp_path / "notime.csv"
    notime.write_text("num_prefill_tokens,num_decode_tokens\n5,6\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="arrival times"):
        load_trace(notime)
    assert load_trace(notime, rate=2.0)[0].input_tokens == 5
    with pytest.raises(ConfigError):
        load_trace(tmp_path / "absent.csv")


def test_real_conv_trace_or_a_generated_one_loads(tmp_path: Path) -> None:
    # The shared Azure trace is used when present; otherwise a small generated file stands in.
    path = SHARED_CONV if SHARED_CONV.is_file() else _write_csv(tmp_path / "conv.csv")
    reqs = load_trace(path, n=3)
    assert len(reqs) == 3
    assert reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
