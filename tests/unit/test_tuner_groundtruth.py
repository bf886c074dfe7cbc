"""The ground-truth harness: Kendall's τ, and the direct engine-model drive agrees with the real simulator."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hetroute.catalog.specs import GpuSpec, ModelSpec, load_gpu_catalog, load_model_catalog
from hetroute.sim.cluster_file import InstanceSpec, SimClusterSpec
from hetroute.sim.workload import SimRequest, generate_workload
from hetroute.simulation.simulator import run_simulation
from hetroute.tuner.cluster import EngineSettings
from hetroute.tuner.groundtruth import kendall_tau, measure_machine


def measure_machine_routed(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int,
    instances: int,
    requests: Sequence[tuple[int, int]],
    engine: EngineSettings,
) -> float:
    """Saturation throughput (tokens/s) of the machine through ``run_simulation`` with ``round_robin``:
    the router's side of the cross-check, kept here so the tuner imports nothing of the router."""
    args: dict[str, int | float | bool] = {
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.batched_tokens(),
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "overhead_gib_per_gpu": engine.overhead_gib_per_gpu,
        "max_model_len": engine.model_len(model),
    }
    cluster = SimClusterSpec(
        name=f"{gpu.name}-tp{tp}",
        instances=tuple(
            InstanceSpec(name=f"i{k}", gpu=gpu.name, tp=tp, model=model.name, engine_args=args)
            for k in range(instances)
        ),
    )
    workload = [SimRequest(f"r{j}", 0.0, i, o, model=model.name) for j, (i, o) in enumerate(requests)]
    return run_simulation(cluster, workload, "round_robin").throughput_tokens_per_s


def test_kendall_tau() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [2, 1, 3, 4]) == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        kendall_tau([1.0], [1.0])


def test_round_robin_machine_agrees_with_the_routed_simulator() -> None:
    gpu = load_gpu_catalog()["A100-80GB"]
    model = load_model_catalog()["Llama-3-8B"]
    engine = EngineSettings(max_num_seqs=32, max_model_len=2048)
    reqs = [
        (r.input_tokens, r.output_tokens) for r in generate_workload("sharegpt", 120, float("inf"), 1, 2048)
    ]
    direct = measure_machine(gpu, model, 1, 2, reqs, engine)
    routed = measure_machine_routed(gpu, model, 1, 2, reqs, engine)
    assert direct.tokens_per_s == pytest.approx(routed, rel=0.02)
    assert len(direct.instance_makespans_s) == 2
    assert direct.makespan_s == max(direct.instance_makespans_s)
    one = measure_machine(gpu, model, 1, 1, reqs[0::2], engine)
    assert one.makespan_s == pytest.approx(direct.instance_makespans_s[0])
