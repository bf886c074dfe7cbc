"""Prometheus ``/metrics`` of one emulated engine, with the real vLLM V1 and TGI metric names.

Owns each emulator's ``CollectorRegistry`` (never the global one: two emulators in one process export
separate metrics), rendered by ``generate_latest``, and the emulator's request-level observations.

Why a custom collector, not ``Gauge``/``Counter`` objects: the gauges and the token, prefix-cache and
preemption counters mirror :meth:`EngineModel.stats`, which the engine owns (a ``Counter`` could only chase
it with ``inc``); one snapshot per scrape keeps a scrape's samples consistent; and a collector emits no
``_created`` series (vLLM V1 and TGI export none; ``prometheus_client`` can turn them off only process-wide).
The histograms are ``prometheus_client`` ``Histogram`` objects, on no registry, yielded without ``_created``.

vLLM: labels ``engine="0"`` and ``model_name``; ``vllm:kv_cache_usage_perc`` is a fraction (0-1); the
prefix-cache counters count tokens and are exported even with prefix caching off, as vLLM V1 does (V0's
``vllm:gpu_prefix_cache_hit_rate`` is gone). TGI: no labels, no prefix-cache metric (its router has none);
its Rust exporter writes ``tgi_request_{count,success,failure}`` without ``_total``, which
``prometheus_client`` cannot (every counter family is ``<name>_total``), so they are typed ``untyped``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

from hetroute.sim.emulator_protocol import EngineKind
from hetroute.sim.engine_model import EngineModel
from hetroute.sim.engine_types import EngineStats

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
)  # fmt: skip
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

Observation = Literal["ttft_s", "itl_s", "e2e_s", "prompt_tokens", "output_tokens"]
# observation -> (metric name, upper bounds); TGI's router has no token-latency histogram
_HISTOGRAMS: dict[EngineKind, dict[Observation, tuple[str, tuple[float, ...]]]] = {
    "vllm": {
        "ttft_s": ("vllm:time_to_first_token_seconds", TTFT_BUCKETS_S),
        "itl_s": ("vllm:inter_token_latency_seconds", ITL_BUCKETS_S),
        "e2e_s": ("vllm:e2e_request_latency_seconds", E2E_BUCKETS_S),
        "prompt_tokens": ("vllm:request_prompt_tokens", TOKEN_BUCKETS),
        "output_tokens": ("vllm:request_generation_tokens", TOKEN_BUCKETS),
    },
    "tgi": {
        "e2e_s": ("tgi_request_duration", E2E_BUCKETS_S),
        "prompt_tokens": ("tgi_request_input_length", TOKEN_BUCKETS),
        "output_tokens": ("tgi_request_generated_tokens", TOKEN_BUCKETS),
    },
}
# HELP texts: vLLM's own; TGI's exporter writes none, so those are ours
_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, counted in queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, counted in cached tokens.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
    "vllm:num_preemptions_total": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:request_success_total": "Count of successfully processed requests.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "tgi_queue_size": "Requests waiting in the queue",
    "tgi_batch_current_size": "Current batch size",
    "tgi_batch_current_max_tokens": "Tokens reserved by the batch",
    "tgi_request_count": "Requests received",
    "tgi_request_success": "Requests completed",
    "tgi_request_failure": "Requests failed",
    "tgi_request_duration": "Request duration",
    "tgi_request_input_length": "Input tokens per request",
    "tgi_request_generated_tokens": "Generated tokens per request",
}
_Family = GaugeMetricFamily | CounterMetricFamily | UnknownMetricFamily


class EmulatorMetrics(Collector):
    """The metrics of one emulator, on :attr:`registry`, which this object creates and owns.

    ``kind`` picks the vLLM or the TGI names. The emulator counts requests in the three public counters and
    records latencies and lengths with :meth:`observe`; the engine's state is read at scrape time.
    """

    def __init__(self, engine: EngineModel, kind: EngineKind, served_model: str) -> None:
        self.engine = engine
        self.kind: EngineKind = kind
        self.requests_total = 0  # admitted into the engine
        self.requests_failed = 0  # refused (injected error, too long) or aborted
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        self._labels = {"engine": "0", "model_name": served_model} if kind == "vllm" else {}
        self._histograms = {
            key: Histogram(name, _HELP[name], list(self._labels), registry=None, buckets=bounds)
            for key, (name, bounds) in _HISTOGRAMS[kind].items()
        }
        self._observers = {
            k: h.labels(**self._labels) if self._labels else h for k, h in self._histograms.items()
        }
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe(self, key: Observation, value: float) -> None:
        """Record a latency (seconds of the emulator's clock) or a length (tokens); TGI drops ttft/itl."""
        observer = self._observers.get(key)
        if observer is not None:
            observer.observe(value)

    def exposition(self) -> bytes:
        """The Prometheus text of :attr:`registry` (its content type: ``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """The engine's state (one :meth:`EngineModel.stats` snapshot), then the histograms."""
        stats = self.engine.stats()
        yield from self._vllm(stats) if self.kind == "vllm" else self._tgi(stats)
        for histogram in self._histograms.values():
            for family in histogram.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family

    def _family(
        self, family_type: type[_Family], name: str, value: float, labels: Mapping[str, str] | None = None
    ) -> Metric:
        """One sample of ``name`` (a counter ``x_total`` is the family ``x``, exported as ``x_total``)."""
        labels = self._labels if labels is None else labels
        family = family_type(name, _HELP[name], labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    def _vllm(self, s: EngineStats) -> Iterator[Metric]:
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running", s.running)
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting", s.waiting)
        yield self._family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", s.kv_usage_frac)
        yield self._family(
            CounterMetricFamily, "vllm:prefix_cache_queries_total", s.prefix_cache_queries_total
        )
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_hits_total", s.prefix_cache_hits_total)
        engine = self.engine
        cache_config = {
            "block_size": str(engine.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(engine.config.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": str(engine.config.gpu_memory_utilization),
            "kv_cache_size_tokens": str(engine.kv_capacity_tokens),
            "num_gpu_blocks": str(engine.num_gpu_blocks),
        }
        yield self._family(GaugeMetricFamily, "vllm:cache_config_info", 1.0, cache_config)
        yield self._family(CounterMetricFamily, "vllm:num_preemptions_total", s.num_preemptions_total)
        yield self._family(CounterMetricFamily, "vllm:prompt_tokens_total", s.prompt_tokens_total)
        yield self._family(CounterMetricFamily, "vllm:generation_tokens_total", s.generation_tokens_total)
        name = "vllm:request_success_total"
        success = CounterMetricFamily(name, _HELP[name], labels=[*self._labels, "finished_reason"])
        for reason, n in self.finished_by_reason.items():
            success.add_metric([*self._labels.values(), reason], n)
        yield success

    def _tgi(self, s: EngineStats) -> Iterator[Metric]:
        succeeded = self.finished_by_reason["stop"] + self.finished_by_reason["length"]
        yield self._family(GaugeMetricFamily, "tgi_queue_size", s.waiting)
        yield self._family(GaugeMetricFamily, "tgi_batch_current_size", s.running)
        yield self._family(GaugeMetricFamily, "tgi_batch_current_max_tokens", s.batch_reserved_tokens)
        yield self._family(UnknownMetricFamily, "tgi_request_count", self.requests_total)
        yield self._family(UnknownMetricFamily, "tgi_request_success", succeeded)
        yield self._family(UnknownMetricFamily, "tgi_request_failure", self.requests_failed)
