"""Prometheus text exposition of an emulated engine, with the real vLLM V1 and TGI metric names.

Owns the per-app latency histograms and the rendering of ``/metrics``. Gauges and counters are read
from :meth:`EngineModel.stats` at scrape time, so they move with the engine. Hand-written text (no
global ``prometheus_client`` registry); the format follows the Prometheus text exposition 0.0.4.

vLLM names (label ``model_name``, plus ``engine="0"``): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0–1), ``vllm:cache_config_info{...} 1.0``,
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (counters in tokens, exported
even with prefix caching off, as vLLM V1 does; its older ``vllm:gpu_prefix_cache_hit_rate`` gauge is a V0
metric that V1 replaced by these two), ``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}``, histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``.
TGI names (no labels, counters without ``_total`` as TGI's exporter writes them): ``tgi_queue_size``,
``tgi_batch_current_size``, ``tgi_batch_current_max_tokens``, ``tgi_request_count``,
``tgi_request_success``, ``tgi_request_failure``, histograms ``tgi_request_duration``,
``tgi_request_generated_tokens``, ``tgi_request_input_length``. TGI exports no prefix-cache metric (its
router's ``tgi_*`` metrics have none, though its radix prefix cache is on by default), so none is here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetroute.sim.engine_model import EngineModel

TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _fmt(value: float) -> str:
    return repr(float(value))


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    inner = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in pairs
    )
    return "{" + inner + "}"


class Histogram:
    """A cumulative Prometheus histogram (fixed upper bounds, +Inf implied)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str, labels: Sequence[tuple[str, str]]) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cumulative += n
            lines.append(f"{name}_bucket{_labels([*labels, ('le', _fmt(bound))])} {_fmt(cumulative)}")
        lines.append(f"{name}_bucket{_labels([*labels, ('le', '+Inf')])} {_fmt(self.count)}")
        lines.append(f"{name}_count{_labels(labels)} {_fmt(self.count)}")
        lines.append(f"{name}_sum{_labels(labels)} {_fmt(self.total)}")
        return lines


@dataclass
class EmulatorMetrics:
    """Per-app request-level observations (the engine holds the rest)."""

    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    input_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    generated_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    finished_by_reason: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    requests_total: int = 0
    requests_failed: int = 0


def _sample(
    name: str, kind: str, help_text: str, labels: Sequence[tuple[str, str]], value: float
) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{_labels(labels)} {_fmt(value)}"]


def render_vllm(
    engine: EngineModel, m: EmulatorMetrics, served_model: str, gpu_memory_utilization: float
) -> str:
    s = engine.stats()
    base = [("engine", "0"), ("model_name", served_model)]
    lines: list[str] = []
    lines += _sample(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        base,
        s.running,
    )
    lines += _sample(
        "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", base, s.waiting
    )
    lines += _sample(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        base,
        s.kv_usage_frac,
    )
    lines += _sample(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, counted in queried tokens.",
        base,
        s.prefix_cache_queries_total,
    )
    lines += _sample(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, counted in cached tokens.",
        base,
        s.prefix_cache_hits_total,
    )
    cache_labels = [
        ("block_size", str(engine.block_size)),
        ("cache_dtype", "auto"),
        ("enable_prefix_caching", str(engine.config.enable_prefix_caching)),
        ("engine", "0"),
        ("gpu_memory_utilization", str(gpu_memory_utilization)),
        ("kv_cache_size_tokens", str(engine.kv_capacity_tokens)),
        ("num_gpu_blocks", str(engine.num_gpu_blocks)),
    ]
    lines += _sample(
        "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", cache_labels, 1.0
    )
    lines += [
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{_labels(base)} {_fmt(s.num_preemptions_total)}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{_labels(base)} {_fmt(s.prompt_tokens_total)}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{_labels(base)} {_fmt(s.generation_tokens_total)}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason, n in m.finished_by_reason.items():
        lines.append(f"vllm:request_success_total{_labels([*base, ('finished_reason', reason)])} {_fmt(n)}")
    lines += m.ttft_s.render(
        "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", base
    )
    lines += m.itl_s.render(
        "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", base
    )
    lines += m.e2e_s.render(
        "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", base
    )
    lines += m.input_tokens.render("vllm:request_prompt_tokens", "Number of prefill tokens processed.", base)
    lines += m.generated_tokens.render(
        "vllm:request_generation_tokens", "Number of generation tokens processed.", base
    )
    return "\n".join(lines) + "\n"


def render_tgi(engine: EngineModel, m: EmulatorMetrics) -> str:
    s = engine.stats()
    lines: list[str] = []
    lines += _sample("tgi_queue_size", "gauge", "Requests waiting in the queue", (), s.waiting)
    lines += _sample("tgi_batch_current_size", "gauge", "Current batch size", (), s.running)
    lines += _sample(
        "tgi_batch_current_max_tokens", "gauge", "Tokens reserved by the batch", (), s.batch_reserved_tokens
    )
    lines += _sample("tgi_request_count", "counter", "Requests received", (), m.requests_total)
    success = m.finished_by_reason["stop"] + m.finished_by_reason["length"]
    lines += _sample("tgi_request_success", "counter", "Requests completed", (), success)
    lines += _sample("tgi_request_failure", "counter", "Requests failed", (), m.requests_failed)
    lines += m.e2e_s.render("tgi_request_duration", "Request duration", ())
    lines += m.input_tokens.render("tgi_request_input_length", "Input tokens per request", ())
    lines += m.generated_tokens.render("tgi_request_generated_tokens", "Generated tokens per request", ())
    return "\n".join(lines) + "\n"
