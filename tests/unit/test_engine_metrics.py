"""Metric parsers on real-shaped vLLM and TGI /metrics text; missing metrics are None."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetroute.backends.engines import MetricsParseError, parse_metrics, parse_tgi, parse_vllm
from hetroute.errors import HetrouteError

DATA = Path(__file__).resolve().parent.parent / "data"


def test_vllm_fixture() -> None:
    m = parse_vllm((DATA / "vllm_metrics.txt").read_text(), scraped_at_s=12.5)
    assert m.scraped_at_s == 12.5
    assert m.num_requests_running == 4.0
    assert m.num_requests_waiting == 7.0
    assert m.kv_usage_frac == pytest.approx(0.4375)
    assert (m.block_size, m.num_gpu_blocks, m.kv_capacity_tokens) == (32, 64, 2048)
    assert m.num_preemptions_total == 3.0
    assert m.batch_current_max_tokens is None
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (18432.0, 2048.0)


def test_tgi_fixture_has_no_kv_metric() -> None:
    m = parse_tgi((DATA / "tgi_metrics.txt").read_text(), scraped_at_s=1.0)
    assert m.num_requests_waiting == 12.0
    assert m.num_requests_running == 32.0
    assert m.batch_current_max_tokens == 15872.0
    assert m.kv_usage_frac is None and m.kv_capacity_tokens is None and m.num_preemptions_total is None
    assert m.prefix_cache_queries_total is None and m.prefix_cache_hits_total is None  # TGI has none


def test_vllm_data_parallel_sums_counts_and_averages_kv() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 5\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
    )
    m = parse_vllm(text)
    assert m.num_requests_running == 8.0 and m.kv_usage_frac == pytest.approx(0.4)
    assert m.num_requests_waiting is None  # absent, not 0


def test_vllm_old_gauge_name_and_zero_is_kept() -> None:
    m = parse_vllm('vllm:gpu_cache_usage_perc{model_name="m"} 0.0\nvllm:num_requests_waiting 0\n')
    assert m.kv_usage_frac == 0.0 and m.num_requests_waiting == 0.0 and m.num_requests_running is None


def test_openai_engine_reads_llamacpp_names() -> None:
    m = parse_metrics("openai", "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n", 0.0)
    assert (m.num_requests_running, m.num_requests_waiting) == (2.0, 1.0)


def test_empty_text_gives_all_none() -> None:
    m = parse_vllm("")
    assert m.num_requests_running is None and m.kv_usage_frac is None and m.kv_capacity_tokens is None


def test_malformed_text_raises() -> None:
    with pytest.raises(MetricsParseError, match="^invalid Prometheus text: ") as err:
        parse_vllm("vllm:num_requests_running{engine=0 3 4 5\n")
    assert isinstance(err.value, HetrouteError) and isinstance(err.value, ValueError)


def test_vllm_prefix_cache_counters_sum_over_engines_and_read_the_old_names() -> None:
    text = (
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0\n'
    )
    m = parse_vllm(text)
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (1500.0, 640.0)
    old = parse_vllm(
        "# TYPE vllm:gpu_prefix_cache_queries_total counter\n"
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 32.0\n'
        "# TYPE vllm:gpu_prefix_cache_hits_total counter\n"
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 16.0\n'
    )
    assert (old.prefix_cache_queries_total, old.prefix_cache_hits_total) == (32.0, 16.0)
    # a V0 server's hit-rate gauge is not a token count: it is not read as one
    v0 = parse_vllm('vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.5\n')
    assert v0.prefix_cache_queries_total is None and v0.prefix_cache_hits_total is None
