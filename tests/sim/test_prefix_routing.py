"""Prefix-aware routing in the simulator: the cost model uses cache locality, and costs nothing without it."""

from __future__ import annotations

from typing import Any

import numpy as np

from hetroute.sim.cluster_file import build_fleet, parse_cluster
from hetroute.sim.prefix_workloads import generate_prefix_workload
from hetroute.sim.scenarios import get_scenario
from hetroute.simulation.simulator import run_simulation

TWINS: dict[str, Any] = {
    "name": "twins",
    "defaults": {"model": "Llama-3-8B", "engine": "vllm"},
    "instances": [{"name": "a100", "gpu": "A100-80GB", "tp": 1, "count": 2}],
}


def _hit(result: object) -> float:
    extra = result.extra  # type: ignore[attr-defined]
    return float(extra["prefix_cache_hits_tokens"] / extra["prefix_cache_queries_tokens"])


def test_without_shared_prefixes_the_default_decides_exactly_as_without_the_prefix_term() -> None:
    fleet = build_fleet(get_scenario("mixed").cluster())
    wl = generate_prefix_workload("no-sharing", 600, 12.0, 3, 8192)
    on = run_simulation(fleet, wl, "balanced_minmax", {})
    off = run_simulation(fleet, wl, "balanced_minmax", {"prefix": False})
    assert np.array_equal(on.backend_index, off.backend_index)
    assert on.throughput_tokens_per_s == off.throughput_tokens_per_s
    assert on.extra["prefix_cache_hits_tokens"] == 0.0 and on.ledger_zero


def test_on_shared_system_prompts_the_default_keeps_the_cache_hits_and_the_throughput() -> None:
    fleet = build_fleet(parse_cluster(TWINS))
    wl = generate_prefix_workload("system-prompts", 800, 40.0, 1, 8192)
    default = run_simulation(fleet, wl, "balanced_minmax", {})
    rr = run_simulation(fleet, wl, "round_robin", {})
    ca = run_simulation(fleet, wl, "cache_aware", {})
    assert _hit(default) >= 0.95 * _hit(ca)
    best = max(rr.throughput_tokens_per_s, ca.throughput_tokens_per_s)
    assert default.throughput_tokens_per_s >= 0.97 * best
    # The router's estimate of its hits is close to the engines' own counters.
    assert abs(default.extra["prefix_expected_hit_ratio"] - _hit(default)) < 0.1
    assert default.ledger_zero


def test_on_rag_over_a_mixed_fleet_the_prefix_term_buys_hits_throughput_and_tail() -> None:
    """Long shared documents on a heterogeneous fleet: pricing the uncached prefill beats both the
    default without it and SGLang's cache-aware policy (which ignores speed)."""
    fleet = build_fleet(get_scenario("mixed").cluster())
    wl = generate_prefix_workload("rag", 800, 15.0, 1, 8192)
    default = run_simulation(fleet, wl, "balanced_minmax", {})
    plain = run_simulation(fleet, wl, "balanced_minmax", {"prefix": False})
    ca = run_simulation(fleet, wl, "cache_aware", {})
    assert _hit(default) > 1.1 * _hit(plain)
    assert default.throughput_tokens_per_s > plain.throughput_tokens_per_s
    assert default.percentile("ttft", 99) < plain.percentile("ttft", 99)
    assert default.throughput_tokens_per_s > 2 * ca.throughput_tokens_per_s


def test_engines_without_prefix_caching_teach_the_router_to_distrust_its_index() -> None:
    cluster = {**TWINS, "defaults": {**TWINS["defaults"], "engine_args": {"enable_prefix_caching": False}}}
    fleet = build_fleet(parse_cluster(cluster))
    wl = generate_prefix_workload("system-prompts", 800, 20.0, 1, 8192)
    result = run_simulation(fleet, wl, "balanced_minmax", {})
    assert result.extra["prefix_cache_hits_tokens"] == 0.0
    # Trust falls toward its floor, so the router stops expecting hits it never gets.
    assert result.extra["prefix_expected_hit_ratio"] < 0.3
