"""The emulator's ``/metrics`` exposition: what the router's parser and the profiler read from it, the exact
vLLM and TGI family names, no ``_created`` series, and one registry per emulator (none on the global one)."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetroute.backends.engines import parse_tgi, parse_vllm
from hetroute.prefix.hashing import token_block_hashes
from hetroute.sim.emulator_metrics import EmulatorMetrics
from hetroute.sim.emulator_protocol import EngineKind
from hetroute.sim.engine_model import EngineModel
from profiling.discover import parse_cache_config_info
from tests.unit.test_engine_model import config

VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:cache_config_info": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
TGI_FAMILIES = {
    "tgi_queue_size": "gauge",
    "tgi_batch_current_size": "gauge",
    "tgi_batch_current_max_tokens": "gauge",
    "tgi_request_count": "unknown",  # a counter in TGI, written without _total (see the module docstring)
    "tgi_request_success": "unknown",
    "tgi_request_failure": "unknown",
    "tgi_request_duration": "histogram",
    "tgi_request_input_length": "histogram",
    "tgi_request_generated_tokens": "histogram",
}


def busy_engine(kind: str) -> EngineModel:
    """An engine mid-run with requests running and waiting, a preemption (vLLM) and prefix-cache hits."""
    engine = EngineModel(config(engine=kind, num_gpu_blocks_override=64, max_model_len=1024, max_num_seqs=4))
    hashes = token_block_hashes(list(range(320)), engine.block_size)
    for i in range(8):
        engine.submit(f"r{i}", 320, 300, 0.0, block_hashes=hashes)
    now_s = 0.0
    for _ in range(2000):
        s = engine.stats()
        if (
            s.running
            and s.waiting
            and s.prefix_cache_hits_total
            and (s.num_preemptions_total or kind == "tgi")
        ):
            return engine
        now_s += engine.step(now_s).duration_s
    raise AssertionError(f"the {kind} engine never got busy: {engine.stats()}")


def test_the_router_and_the_profiler_read_every_vllm_field() -> None:
    engine = busy_engine("vllm")
    text = EmulatorMetrics(engine, "vllm", "llama").exposition().decode()
    m, s = parse_vllm(text, scraped_at_s=3.0), engine.stats()
    assert (m.num_requests_running, m.num_requests_waiting) == (s.running, s.waiting) == (3, 5)
    assert m.kv_usage_frac == s.kv_usage_frac and 0 < s.kv_usage_frac < 1
    assert (m.block_size, m.num_gpu_blocks, m.kv_capacity_tokens) == (16, 64, 64 * 16)
    assert m.num_preemptions_total == s.num_preemptions_total > 0
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (
        s.prefix_cache_queries_total,
        s.prefix_cache_hits_total,
    )
    assert 0 < s.prefix_cache_hits_total < s.prefix_cache_queries_total
    assert m.batch_current_max_tokens is None  # a TGI-only field
    assert parse_cache_config_info(text) == (64, 16)


def test_the_router_reads_every_tgi_field() -> None:
    engine = busy_engine("tgi")
    m, s = parse_tgi(EmulatorMetrics(engine, "tgi", "llama").exposition().decode()), engine.stats()
    assert (m.num_requests_running, m.num_requests_waiting) == (s.running, s.waiting)
    assert s.running > 0 and s.waiting > 0
    assert m.batch_current_max_tokens == s.batch_reserved_tokens > 0
    assert m.kv_usage_frac is None and m.prefix_cache_hits_total is None  # TGI exports neither


@pytest.mark.parametrize(("kind", "families"), [("vllm", VLLM_FAMILIES), ("tgi", TGI_FAMILIES)])
def test_exactly_the_engines_families_and_no_created_series(
    kind: EngineKind, families: dict[str, str]
) -> None:
    metrics = EmulatorMetrics(busy_engine(kind), kind, "llama")
    metrics.observe("ttft_s", 0.5)  # TGI has no such histogram: dropped
    metrics.observe("e2e_s", 2.0)
    parsed = list(text_string_to_metric_families(metrics.exposition().decode()))
    assert {f.name: f.type for f in parsed} == families
    samples = [s for f in parsed for s in f.samples]
    assert not [s.name for s in samples if s.name.endswith("_created")]
    want = {"engine": "0", "model_name": "llama"} if kind == "vllm" else {}
    assert all(s.labels.items() >= want.items() for s in samples if not s.name.startswith("vllm:cache_"))


def test_histograms_and_counters_keep_their_semantics() -> None:
    metrics = EmulatorMetrics(busy_engine("vllm"), "vllm", "llama")
    for ttft_s in (0.25, 0.3, 30.0):  # a value on a bucket's upper bound counts in that bucket
        metrics.observe("ttft_s", ttft_s)
    metrics.observe("output_tokens", 7)
    metrics.finished_by_reason["stop"] += 1
    metrics.finished_by_reason["abort"] += 1
    base = {"engine": "0", "model_name": "llama"}

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {**base, **labels})

    ttft, success = "vllm:time_to_first_token_seconds", "vllm:request_success_total"
    bounds = ("0.1", "0.25", "0.5", "20.0", "+Inf")
    assert [sample(f"{ttft}_bucket", le=le) for le in bounds] == [0, 1, 2, 2, 3]
    assert sample(f"{ttft}_count") == 3 and sample(f"{ttft}_sum") == pytest.approx(30.55)
    assert sample("vllm:request_generation_tokens_bucket", le="10.0") == 1
    reasons = {r: sample(success, finished_reason=r) for r in ("stop", "length", "abort")}
    assert reasons == {"stop": 1, "length": 0, "abort": 1}
    tgi = EmulatorMetrics(busy_engine("tgi"), "tgi", "llama")
    tgi.requests_total, tgi.requests_failed = 5, 2
    tgi.finished_by_reason.update(stop=1, length=2)
    counts = {n: tgi.registry.get_sample_value(f"tgi_request_{n}") for n in ("count", "success", "failure")}
    assert counts == {"count": 5, "success": 3, "failure": 2}  # success: stop + length


def test_two_emulators_keep_separate_registries_and_leave_the_global_one_alone() -> None:
    a = EmulatorMetrics(busy_engine("vllm"), "vllm", "llama")
    b = EmulatorMetrics(EngineModel(config()), "vllm", "llama")  # same names and labels
    a.observe("e2e_s", 1.0)
    assert a.registry is not b.registry
    count = "vllm:e2e_request_latency_seconds_count"
    labels = {"engine": "0", "model_name": "llama"}
    assert (a.registry.get_sample_value(count, labels), b.registry.get_sample_value(count, labels)) == (1, 0)
    assert parse_vllm(b.exposition().decode()).num_requests_running == 0
    global_names = {f.name for f in prometheus_client.REGISTRY.collect()}
    assert not {n for n in global_names if n.startswith(("vllm:", "tgi_"))}
