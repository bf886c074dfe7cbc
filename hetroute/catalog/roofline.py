"""Roofline step-time model of one engine iteration (calibration.md, extended for mixed batches).

Owns the arithmetic that turns "what one engine step computes" into seconds, for a (GPU, model, TP).
All parameters come from the catalogs (:class:`GpuSpec` knobs, :class:`ModelSpec` shape); nothing
here is a buried constant. Pure functions, no state.

One step computes ``n_p`` prompt tokens (chunks of prefills, chunk i has ``n_i`` new tokens after
``c_i`` cached ones) and one token for each of ``B`` decoding sequences; it reads ``K`` tokens of
KV cache in total. With P parameters, L layers, hidden size d, tensor-parallel degree t::

    t_mem  = (2·P/t + kv_bytes_per_token·K/t) / (BW · decode_bw_eff)
    t_comp = (2·P·n_p + 4·L·d·Σ n_i·(c_i + n_i/2)) / (t · peak · prefill_mfu)
           + 2·P·B / (t · peak · decode_mfu)
    t_step = t_mem + t_comp − compute_overlap · min(t_mem, t_comp)
           + step_overhead_s + L · layer_overhead_s + c_tp
    c_tp   = 0 if t = 1 else 2·L · (allreduce_latency_s + (n_p + B)·d·dtype_bytes·2(t−1)/t / link_BW)

``compute_overlap = 1`` gives calibration.md's pure max(memory, compute) roofline; the measured
Llama-2-70B figures fit better with partial or no overlap (docs/calibration.md). An empty step
(no tokens) costs 0.

Run ``python -m hetroute.catalog.roofline --calibration-table`` to print the comparison with the
published measurements (the table in docs/calibration.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hetroute.catalog.specs import GpuSpec, ModelSpec, check_tp, kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class StepCost:
    """Precomputed coefficients of the step model for one (GPU, model, TP); see module docstring."""

    weight_s: float
    kv_s_per_token: float
    prefill_s_per_token: float
    prefill_attn_s: float
    decode_s_per_seq: float
    compute_overlap: float
    fixed_s: float
    comm_s_per_token: float

    def step_s(
        self, prefill_tokens: int, prefill_attn: float, decode_seqs: int, kv_read_tokens: int
    ) -> float:
        """Seconds for one step.

        ``prefill_attn`` is Σ n_i·(c_i + n_i/2) over the prefill chunks of the step;
        ``kv_read_tokens`` is the KV tokens read (cached context of every scheduled sequence).
        """
        new_tokens = prefill_tokens + decode_seqs
        if new_tokens <= 0:
            return 0.0
        t_mem = self.weight_s + self.kv_s_per_token * kv_read_tokens
        t_comp = (
            self.prefill_s_per_token * prefill_tokens
            + self.prefill_attn_s * prefill_attn
            + self.decode_s_per_seq * decode_seqs
        )
        overlap = self.compute_overlap * (t_mem if t_mem < t_comp else t_comp)
        return t_mem + t_comp - overlap + self.fixed_s + self.comm_s_per_token * new_tokens


def step_cost(gpu: GpuSpec, model: ModelSpec, tp: int) -> StepCost:
    """The :class:`StepCost` coefficients of ``model`` on ``tp`` GPUs of type ``gpu``."""
    check_tp(model, tp)
    peak = gpu.fp16_tflops * 1e12 * tp
    bw = gpu.mem_bw_gbps * 1e9 * gpu.decode_bw_eff
    flops_per_token = 2.0 * model.params
    kv_per_token = kv_bytes_per_token(model) * max(1.0, tp / model.n_kv_heads)
    fixed = gpu.step_overhead_s + model.n_layers * gpu.layer_overhead_s
    comm = 0.0
    if tp > 1:
        fixed += 2 * model.n_layers * gpu.allreduce_latency_s
        bytes_per_token = model.hidden_size * model.dtype_bytes * 2.0 * (tp - 1) / tp
        comm = 2 * model.n_layers * bytes_per_token / (gpu.interconnect_gbps * 1e9)
    return StepCost(
        weight_s=model.weight_bytes / tp / bw,
        kv_s_per_token=kv_per_token / tp / bw,
        prefill_s_per_token=flops_per_token / (peak * gpu.prefill_mfu),
        prefill_attn_s=4.0 * model.n_layers * model.hidden_size / (peak * gpu.prefill_mfu),
        decode_s_per_seq=flops_per_token / (peak * gpu.decode_mfu),
        compute_overlap=gpu.compute_overlap,
        fixed_s=fixed,
        comm_s_per_token=comm,
    )


def prefill_step_s(gpu: GpuSpec, model: ModelSpec, tp: int, new_tokens: int, cached_tokens: int = 0) -> float:
    """One step that prefills ``new_tokens`` of a single prompt after ``cached_tokens`` already cached."""
    attn = new_tokens * (cached_tokens + new_tokens / 2.0)
    return step_cost(gpu, model, tp).step_s(new_tokens, attn, 0, cached_tokens)


def decode_step_s(gpu: GpuSpec, model: ModelSpec, tp: int, batch: int, context_tokens_each: int) -> float:
    """One decode step of ``batch`` sequences each holding ``context_tokens_each`` tokens of KV."""
    return step_cost(gpu, model, tp).step_s(0, 0.0, batch, batch * context_tokens_each)


# ---------------------------------------------------------------- calibration against published figures


@dataclass(frozen=True, slots=True)
class CalibrationPoint:
    """One published measurement (calibration.md) and how to reproduce it with the model."""

    gpu: str
    model: str
    tp: int
    phase: str  # "prefill" (size = prompt tokens) or "decode" (size = batch)
    size: int
    measured_ms: float
    per_layer: bool
    source: str


# Decode measurements do not state the context length; we assume this many tokens of KV per sequence.
DECODE_CONTEXT_TOKENS = 512

_Series = tuple[tuple[float, ...], tuple[float, ...]]
_PER_LAYER: dict[
    str, _Series
] = {  # Llama-2-70B, ms per layer, vLLM 0.4: prompts 250/1000/2000, decode batch 2/20/100/500
    "A100-40GB": ((2, 8, 14), (1.4, 1.5, 2.5, 7)),
    "V100-SXM2-16GB": ((5, 19, 37), (2.3, 2.6, 5.0, 13)),
    "L4": ((12, 38, 72), (6.9, 7.7, 9.4, 26)),
    "T4": ((18, 59, 128), (7.1, 9.0, 11.7, 40)),
}
_TP2: dict[
    str, _Series
] = {  # Llama-2-70B FP16 TP2, ms: prefill 128/512/2048/8192, decode per token at batch 1/8/32
    "A100-80GB": ((81, 195, 688, 2990), (59.9, 61.7, 72.2)),
    "H100-SXM": ((48, 84, 310, 1340), (37.1, 40.4, 52.3)),
}


def calibration_points() -> tuple[CalibrationPoint, ...]:
    """The measurements quoted in calibration.md, as data."""
    out: list[CalibrationPoint] = []
    for gpu, (pre, dec) in _PER_LAYER.items():
        src = "Llama-2-70B per layer, vLLM 0.4"
        out += [
            CalibrationPoint(gpu, "Llama-2-70B", 1, "prefill", n, ms, True, src)
            for n, ms in zip((250, 1000, 2000), pre, strict=True)
        ]
        out += [
            CalibrationPoint(gpu, "Llama-2-70B", 1, "decode", b, ms, True, src)
            for b, ms in zip((2, 20, 100, 500), dec, strict=True)
        ]
    for gpu, (pre, dec) in _TP2.items():
        src = "Llama-2-70B TP2, medians"
        out += [
            CalibrationPoint(gpu, "Llama-2-70B", 2, "prefill", n, ms, False, src)
            for n, ms in zip((128, 512, 2048, 8192), pre, strict=True)
        ]
        out += [
            CalibrationPoint(gpu, "Llama-2-70B", 2, "decode", b, ms, False, src)
            for b, ms in zip((1, 8, 32), dec, strict=True)
        ]
    return tuple(out)


def predict_ms(point: CalibrationPoint, gpu: GpuSpec, model: ModelSpec) -> float:
    """The model's prediction for ``point`` in ms (per layer when the measurement is per layer)."""
    if point.phase == "prefill":
        seconds = prefill_step_s(gpu, model, point.tp, point.size)
    else:
        seconds = decode_step_s(gpu, model, point.tp, point.size, DECODE_CONTEXT_TOKENS)
    if point.per_layer:
        seconds /= model.n_layers
    return seconds * 1e3


def calibration_rows(
    gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]
) -> list[tuple[CalibrationPoint, float, float]]:
    """(point, predicted_ms, relative_error) for every calibration point."""
    rows = []
    for p in calibration_points():
        pred = predict_ms(p, gpus[p.gpu], models[p.model])
        rows.append((p, pred, (pred - p.measured_ms) / p.measured_ms))
    return rows


def calibration_table_markdown(gpus: dict[str, GpuSpec], models: dict[str, ModelSpec]) -> str:
    """The comparison as a Markdown table, plus mean and worst absolute error."""
    rows = calibration_rows(gpus, models)
    lines = [
        "| GPU | TP | phase | size | unit | measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, pred, err in rows:
        unit = "ms/layer" if p.per_layer else "ms"
        size = f"{p.size} tok" if p.phase == "prefill" else f"batch {p.size}"
        lines.append(
            f"| {p.gpu} | {p.tp} | {p.phase} | {size} | {unit} | {p.measured_ms:g} | {pred:.2f} "
            f"| {err * 100:+.1f} % |"
        )
    errs = [abs(e) for _, _, e in rows]
    lines.append("")
    lines.append(
        f"Mean absolute error {100 * sum(errs) / len(errs):.1f} %, worst {100 * max(errs):.1f} % "
        f"over {len(errs)} points (decode context assumed {DECODE_CONTEXT_TOKENS} tokens per sequence)."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog

    parser = argparse.ArgumentParser(
        prog="python -m hetroute.catalog.roofline", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--calibration-table", action="store_true", help="print the calibration comparison")
    args = parser.parse_args(argv)
    if not args.calibration_table:
        parser.print_help()
        return 2
    sys.stdout.write(calibration_table_markdown(load_gpu_catalog(), load_model_catalog()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
