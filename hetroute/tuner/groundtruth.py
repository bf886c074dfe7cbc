"""Ground truth for ``tune-deploy``: serve a workload at saturation on the simulator's engine model.

Owns: :func:`measure_machine`. Every instance of the machine is a real
:class:`hetroute.sim.engine_model.EngineModel` (roofline step times, vLLM V1 scheduling, lazy KV with
preemption); requests are spread round-robin over the instances and all arrive at t = 0 (rate ∞), so the
instances are independent and the machine's makespan is the largest instance makespan. Throughput is
Σ(input + output tokens) / makespan (method.md §8). This is what the estimates are judged against; it is
slow (one Python step per engine iteration) and never used to choose a deployment.

:func:`kendall_tau` compares rankings. The tuner knows nothing of the router: the cross-check of
:func:`measure_machine` against the real simulator (router, ledger, ``round_robin``) is a test
(``tests/unit/test_tuner_groundtruth.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from hetroute.catalog.specs import GpuSpec, ModelSpec
from hetroute.sim.engine_model import EngineConfig, EngineModel
from hetroute.tuner.cluster import EngineSettings


@dataclass(frozen=True, slots=True)
class MachineMeasurement:
    """Measured saturation throughput of one machine configuration."""

    tokens_per_s: float
    makespan_s: float
    instance_makespans_s: tuple[float, ...]
    preemptions: int


def measure_machine(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int,
    instances: int,
    requests: Sequence[tuple[int, int]],
    engine: EngineSettings,
) -> MachineMeasurement:
    """Run ``requests`` [(I, O), ...] round-robin over ``instances`` engine models of ``tp`` GPUs each."""
    config = EngineConfig(
        gpu=gpu,
        model=model,
        tp=tp,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.batched_tokens(),
        gpu_memory_utilization=engine.gpu_memory_utilization,
        overhead_gib_per_gpu=engine.overhead_gib_per_gpu,
        max_model_len=engine.model_len(model),
    )
    makespans: list[float] = []
    preemptions = 0
    for k in range(instances):
        engine_model = EngineModel(config)
        for j in range(k, len(requests), instances):
            inp, out = requests[j]
            engine_model.submit(f"r{j}", inp, out, 0.0)
        now = 0.0
        while engine_model.has_work():
            now += engine_model.step(now).duration_s
        makespans.append(now)
        preemptions += engine_model.stats().num_preemptions_total
    tokens = sum(i + o for i, o in requests)
    makespan = max(makespans)
    return MachineMeasurement(tokens / makespan, makespan, tuple(makespans), preemptions)


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's τ-a between two score lists over the same items (1 = identical ranking, −1 = reversed)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("kendall_tau needs two lists of the same length >= 2")
    score = 0
    pairs = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        score += ((da > 0) - (da < 0)) * ((db > 0) - (db < 0))
        pairs += 1
    return score / pairs
