"""Pure parsers from an engine's Prometheus ``/metrics`` text to :class:`EngineMetrics`.

One alias table per engine kind maps the engine's metric names to our fields; a metric
the engine does not expose stays ``None`` (never 0). With several engine cores (vLLM data
parallel, label ``engine``) request counts and counters (preemptions, prefix-cache queries and hits, in
tokens) are summed and KV usage is averaged. TGI exports no prefix-cache metric.
No I/O here: :mod:`hetroute.backends.scrape` fetches the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from hetroute.errors import HetrouteError
from hetroute.types import EngineKind, EngineMetrics

# field -> (metric sample names, in order of preference; how samples combine)
_Table = dict[str, tuple[tuple[str, ...], str]]
_VLLM: _Table = {
    "num_requests_running": (("vllm:num_requests_running",), "sum"),
    "num_requests_waiting": (("vllm:num_requests_waiting",), "sum"),
    "kv_usage_frac": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "mean"),
    "num_preemptions_total": (("vllm:num_preemptions_total",), "sum"),
    # counters in tokens; the gpu_ names are vLLM 0.9's deprecated aliases
    "prefix_cache_queries_total": (
        ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "sum",
    ),
    "prefix_cache_hits_total": (("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"), "sum"),
}
_TGI: _Table = {
    "num_requests_waiting": (("tgi_queue_size",), "sum"),
    "num_requests_running": (("tgi_batch_current_size",), "sum"),
    "batch_current_max_tokens": (("tgi_batch_current_max_tokens",), "sum"),
}
_LLAMACPP: _Table = {
    "num_requests_running": (("llamacpp:requests_processing",), "sum"),
    "num_requests_waiting": (("llamacpp:requests_deferred",), "sum"),
}
_TABLES: dict[EngineKind, tuple[_Table, ...]] = {
    "vllm": (_VLLM,),
    "tgi": (_TGI,),
    "openai": (_VLLM, _LLAMACPP),  # an unknown OpenAI server: use whichever family it exposes
}


class MetricsParseError(HetrouteError, ValueError):
    """The text is not valid Prometheus exposition format (still a ``ValueError``)."""


@dataclass(slots=True)
class _Samples:
    values: dict[str, list[float]] = field(default_factory=dict)
    cache_info: list[dict[str, str]] = field(default_factory=list)


def _collect(text: str) -> _Samples:
    out = _Samples()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    out.cache_info.append(dict(sample.labels))
                out.values.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"invalid Prometheus text: {exc}") from exc
    return out


def _combine(values: list[float], how: str) -> float:
    return sum(values) / len(values) if how == "mean" else sum(values)


def _label_int(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        value = int(float(raw))
    except ValueError:
        return None
    return value if value > 0 else None


def parse_metrics(engine: EngineKind, text: str, scraped_at_s: float) -> EngineMetrics:
    """Parse ``/metrics`` text of an engine of kind ``engine`` (MetricsParseError if malformed)."""
    samples = _collect(text)
    fields: dict[str, float | int | None] = {}
    for table in _TABLES[engine]:
        for name, (aliases, how) in table.items():
            if fields.get(name) is not None:
                continue
            for alias in aliases:
                if alias in samples.values:
                    fields[name] = _combine(samples.values[alias], how)
                    break
    block_size = num_blocks = capacity = None
    if samples.cache_info:
        labels = samples.cache_info[0]
        block_size = _label_int(labels, "block_size")
        num_blocks = _label_int(labels, "num_gpu_blocks")
        capacity = _label_int(labels, "kv_cache_size_tokens")
        if block_size is not None and num_blocks is not None:
            capacity = block_size * num_blocks
    return EngineMetrics(
        scraped_at_s=scraped_at_s,
        num_requests_running=fields.get("num_requests_running"),
        num_requests_waiting=fields.get("num_requests_waiting"),
        kv_usage_frac=fields.get("kv_usage_frac"),
        kv_capacity_tokens=capacity,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        num_preemptions_total=fields.get("num_preemptions_total"),
        batch_current_max_tokens=fields.get("batch_current_max_tokens"),
        prefix_cache_queries_total=fields.get("prefix_cache_queries_total"),
        prefix_cache_hits_total=fields.get("prefix_cache_hits_total"),
    )


def parse_vllm(text: str, scraped_at_s: float = 0.0) -> EngineMetrics:
    return parse_metrics("vllm", text, scraped_at_s)


def parse_tgi(text: str, scraped_at_s: float = 0.0) -> EngineMetrics:
    return parse_metrics("tgi", text, scraped_at_s)
