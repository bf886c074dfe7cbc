"""A latency profile derived from the roofline model, for backends that were never profiled.

Owns :func:`roofline_prior_profile`: it "profiles" the engine model instead of a live server, on a grid
of batch sizes and lengths, and fits the paper's latency model (method.md §3) by ordinary least squares::

    T_prefill(b, I) = p1·b·I + p2·b + p3·I + p4   fitted to the emulated TTFT of b prompts of I tokens
                                                  (chunked by max_num_batched_tokens, as the engine runs them)
    τ_decode(L, b)  = p5·b·L + p6·b + p7·L + p8   fitted to roofline decode steps of b sequences at length L

Fit quality is measured on a held-out grid of in-between points. The result has ``source="roofline-prior"``
and ``kv_capacity_source="catalog"``; a measured profile should replace it when one exists.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from hetroute.catalog.specs import GpuSpec, ModelSpec, kv_capacity_tokens
from hetroute.latency import EngineLimits, FitQuality, LatencyParams, LatencyProfile
from hetroute.sim.engine_model import EngineConfig, EngineFlavour, EngineModel

_Array = npt.NDArray[np.float64]
FIT_LENGTHS = (16, 64, 256, 1024, 2048, 4096)
HELDOUT_LENGTHS = (32, 128, 512, 1536, 3072)


def _batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


def _prefill_s(config: EngineConfig, batch: int, input_tokens: int) -> float:
    """TTFT of the last of ``batch`` simultaneous prompts, run through the engine model."""
    engine = EngineModel(config)
    for i in range(batch):
        engine.submit(f"p{i}", input_tokens, 1, 0.0)
    total_s = 0.0
    while engine.has_work():
        total_s += engine.step(total_s).duration_s
    return total_s


def _fit(design: _Array, target: _Array) -> _Array:
    # Rows scaled by 1/target: least squares on relative error, so short batches count as much as long ones.
    weights = 1.0 / target
    coef, *_ = np.linalg.lstsq(design * weights[:, None], target * weights, rcond=None)
    return np.asarray(coef, dtype=np.float64)


def _quality(design: _Array, target: _Array, coef: _Array) -> tuple[float, float]:
    pred = design @ coef
    mape = float(np.mean(np.abs(pred - target) / target))
    ss_res = float(np.sum((target - pred) ** 2))
    ss_tot = float(np.sum((target - target.mean()) ** 2))
    return mape, (1.0 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def _samples(
    config: EngineConfig, batches: list[int], lengths: tuple[int, ...], cap_tokens: int, max_len: int
) -> tuple[_Array, _Array, _Array, _Array]:
    cost = EngineModel(config).cost
    pre_x: list[list[float]] = []
    pre_y: list[float] = []
    dec_x: list[list[float]] = []
    dec_y: list[float] = []
    for b in batches:
        for length in lengths:
            if length + 1 > max_len or b * (length + 1) > cap_tokens:
                continue
            pre_x.append([b * length, b, length, 1.0])
            pre_y.append(_prefill_s(config, b, length))
            dec_x.append([b * length, b, length, 1.0])
            dec_y.append(cost.step_s(0, 0.0, b, b * length))
    return np.array(pre_x), np.array(pre_y), np.array(dec_x), np.array(dec_y)


def roofline_prior_profile(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    engine: EngineFlavour = "vllm",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    overhead_gib_per_gpu: float = 2.0,
    max_model_len: int | None = None,
) -> LatencyProfile:
    """Fit p1..p8 to the engine model of ``model`` on ``tp`` × ``gpu`` (raises WeightsDoNotFit)."""
    cap = kv_capacity_tokens(gpu, model, tp, gpu_memory_utilization, overhead_gib_per_gpu)
    max_len = min(max_model_len or model.max_model_len, (cap // block_size) * block_size)
    config = EngineConfig(
        gpu=gpu,
        model=model,
        tp=tp,
        engine=engine,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        overhead_gib_per_gpu=overhead_gib_per_gpu,
        max_model_len=max_len,
    )
    cap_tokens = EngineModel(config).kv_capacity_tokens
    batches = _batch_sizes(max_num_seqs)
    pre_x, pre_y, dec_x, dec_y = _samples(config, batches, FIT_LENGTHS, cap_tokens, max_len)
    pre_coef, dec_coef = _fit(pre_x, pre_y), _fit(dec_x, dec_y)
    held_batches = sorted({max(1, (a + b) // 2) for a, b in zip(batches, batches[1:], strict=False)} | {1})
    hp_x, hp_y, hd_x, hd_y = _samples(config, held_batches, HELDOUT_LENGTHS, cap_tokens, max_len)
    prefill_mape, prefill_r2 = _quality(hp_x, hp_y, pre_coef)
    decode_mape, decode_r2 = _quality(hd_x, hd_y, dec_coef)
    params = LatencyParams(*(float(v) for v in (*pre_coef, *dec_coef)))
    return LatencyProfile(
        params=params,
        kv_capacity_tokens=cap_tokens,
        kv_capacity_source="catalog",
        limits=EngineLimits(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len
        ),
        quality=FitQuality(prefill_mape, prefill_r2, decode_mape, decode_r2, heldout_batches=len(hp_y)),
        labels={"gpu": gpu.name, "model": model.name, "tp": str(tp), "engine": engine},
        sweep={
            "batch_sizes": batches,
            "input_lengths": list(FIT_LENGTHS),
            "heldout_lengths": list(HELDOUT_LENGTHS),
        },
        source="roofline-prior",
    )
