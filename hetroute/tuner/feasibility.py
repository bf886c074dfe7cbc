"""Memory feasibility of one engine instance (method.md §2, paper Eq. 1–2 fixed for GQA).

Owns: :class:`Feasibility` and :func:`check_instance`. For ``tp`` GPUs of type ``gpu`` serving ``model``::

    kv_bytes_per_token = 2 · n_layers · n_kv_heads · head_dim · kv_dtype_bytes
                         (× tp / n_kv_heads when tp > n_kv_heads: KV heads are replicated)
    free_bytes         = tp · (memory · gpu_memory_utilization − overhead_per_gpu) − params · dtype_bytes
    cap                = floor(free_bytes / kv_bytes_per_token)

An instance is feasible only if ``tp`` divides the attention heads, the weights fit, and
``cap ≥ max_model_len`` (vLLM refuses to start otherwise). The arithmetic itself is the catalog's
:func:`kv_capacity_tokens`, so the simulator
and the tuner can never disagree on capacity. Every infeasible verdict carries a reason in words.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetroute.catalog.specs import GIB, GpuSpec, ModelSpec, WeightsDoNotFit, kv_capacity_tokens
from hetroute.tuner.cluster import EngineSettings


@dataclass(frozen=True, slots=True)
class Feasibility:
    """The verdict for one (GPU type, TP, model, engine settings)."""

    feasible: bool
    reason: str | None
    kv_capacity_tokens: int | None
    weight_gib_per_gpu: float
    usable_gib_per_gpu: float


def check_instance(gpu: GpuSpec, model: ModelSpec, tp: int, engine: EngineSettings) -> Feasibility:
    """Is one instance of ``model`` on ``tp`` × ``gpu`` deployable, and with how many KV tokens?"""
    weight_gib = model.weight_bytes / tp / GIB
    usable_gib = gpu.memory_gib * engine.gpu_memory_utilization - engine.overhead_gib_per_gpu

    def no(reason: str, cap: int | None = None) -> Feasibility:
        return Feasibility(False, reason, cap, weight_gib, usable_gib)

    if engine.tp_degrees is not None and tp not in engine.tp_degrees:
        return no(f"TP{tp} not in engine.tp_degrees {list(engine.tp_degrees)}")
    if model.n_heads % tp != 0:
        return no(f"TP{tp} does not divide the model's {model.n_heads} attention heads")
    try:
        cap = kv_capacity_tokens(gpu, model, tp, engine.gpu_memory_utilization, engine.overhead_gib_per_gpu)
    except WeightsDoNotFit:
        return no(f"weights need {weight_gib:.1f} GiB per GPU, only {usable_gib:.1f} GiB usable per GPU")
    need = engine.model_len(model)
    if cap < need:
        return no(f"KV capacity {cap} tokens < max_model_len {need}", cap)
    return Feasibility(True, None, cap, weight_gib, usable_gib)
