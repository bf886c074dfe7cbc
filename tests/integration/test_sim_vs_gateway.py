"""The simulator predicts the gateway: same workload, real gateway + emulators vs ``run_simulation``.

The harness is :mod:`hetroute.simulation.crosscheck` (``benchmarks/crosscheck.py`` runs larger cases).
Here 150 ShareGPT-like requests at 24 req/s on ``paper-a`` (the load at which RR overloads the TP1
instance) go through the real gateway in front of two in-process emulators running 2.5× faster than real
time (6-8 s wall per policy, about 0.9 s of CPU, so the run keeps pace even when other jobs share the
cores), and the throughput, (input + output tokens) / makespan in virtual seconds, must agree with the
simulator's within 5 %. Measured on the 2-core dev machine: within 0.1-2 %.

Wall-clock timing on a shared machine can be starved (once in CI, right after the real-engine set-up:
-5.4 %), so a gateway run outside the tolerance is repeated once and the repeat must agree: a real
disagreement fails both."""

from __future__ import annotations

import pytest

from hetroute.sim.cluster_file import Fleet, build_fleet
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import SimRequest, generate_workload
from hetroute.simulation import crosscheck
from hetroute.simulation.simulator import run_simulation


async def _gateway_within(
    fleet: Fleet, work: list[SimRequest], policy: str, sim: crosscheck.Measured, rel: float
) -> crosscheck.Measured:
    """The gateway's run of ``work``; a second run when the first is outside ``rel`` of ``sim``."""
    gateway = await crosscheck.run_gateway(fleet, work, policy, {}, speedup=2.5)
    if gateway.throughput_tokens_per_s != pytest.approx(sim.throughput_tokens_per_s, rel=rel):
        gateway = await crosscheck.run_gateway(fleet, work, policy, {}, speedup=2.5)
    return gateway


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["round_robin", "weighted_round_robin"])
async def test_gateway_and_simulator_agree_on_throughput(policy: str) -> None:
    cc = crosscheck
    fleet = build_fleet(get_scenario("paper-a").cluster())
    work = generate_workload(
        "sharegpt", 150, 24.0, seed=0, max_model_len=fleet.max_model_len(), send_max_tokens=True
    )
    sim = cc.run_simulator(fleet, work, policy, {})
    gateway = await _gateway_within(fleet, work, policy, sim, 0.05)
    assert gateway.tokens == sim.tokens == sum(r.input_tokens + r.output_tokens for r in work)
    assert dict(gateway.per_backend) == dict(sim.per_backend)  # the same routing decisions
    assert gateway.throughput_tokens_per_s == pytest.approx(sim.throughput_tokens_per_s, rel=0.05), (
        f"event-loop lag p99 {gateway.loop_lag_p99_s * 1e3:.1f} ms (a few ms when the process gets its CPU; "
        "tens of ms mean other jobs starved it and wall-clock timing cannot be trusted)"
    )
    # The check is meaningful: at this load the two policies differ by far more than 5 %.
    other = cc.run_simulator(
        fleet, work, "weighted_round_robin" if policy == "round_robin" else "round_robin", {}
    )
    assert abs(other.throughput_tokens_per_s / sim.throughput_tokens_per_s - 1) > 0.15


@pytest.mark.timeout(90)
async def test_gateway_and_simulator_agree_on_a_shared_prefix_workload() -> None:
    """Shared system prompts: the emulators cache the rendered prompt text's blocks as the simulated
    engines cache the segments' blocks, so decisions and throughput agree as without sharing."""
    from hetroute.sim.prefix_workloads import generate_prefix_workload

    cc = crosscheck
    fleet = build_fleet(get_scenario("paper-a").cluster())
    work = generate_prefix_workload("system-prompts", 150, 12.0, 0, fleet.max_model_len())
    sim = cc.run_simulator(fleet, work, "round_robin", {})
    cached = run_simulation(fleet, work, "round_robin", {}).extra
    assert cached["prefix_cache_hits_tokens"] > 0.5 * cached["prefix_cache_queries_tokens"]  # it is shared
    gateway = await _gateway_within(fleet, work, "round_robin", sim, 0.05)
    assert dict(gateway.per_backend) == dict(sim.per_backend)
    assert gateway.throughput_tokens_per_s == pytest.approx(sim.throughput_tokens_per_s, rel=0.05), (
        f"event-loop lag p99 {gateway.loop_lag_p99_s * 1e3:.1f} ms"
    )
