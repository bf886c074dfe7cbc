"""Turning a fit into the latency-profile artifact the router reads (``hetroute.latency``, schema v1).

Owns: assembling a :class:`hetroute.latency.LatencyProfile` from what discovery found, the fit and
the sweep that produced it; the acceptance rule for writing it.

Invariants: the artifact is written only through ``hetroute.latency.save_profile`` (so it always
round-trips through ``load_profile``); a profile whose held-out MAPE exceeds the threshold, or that
could not be scored on any held-out batch, is refused unless forced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hetroute.latency import EngineLimits, FitQuality, LatencyParams, LatencyProfile
from profiling.calibrate import Calibration
from profiling.collect import SweepConfig, SweepResult
from profiling.discover import EngineInfo
from profiling.fit import FitResult


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a fit may be written, and why not."""

    accepted: bool
    reason: str


def judge(fit: FitResult, max_mape: float) -> Verdict:
    """Accept when both phases were scored on held-out batches with MAPE ≤ ``max_mape``."""
    pre, dec = fit.prefill_heldout, fit.decode_heldout
    if pre.samples == 0 or dec.samples == 0 or math.isnan(pre.mape) or math.isnan(dec.mape):
        return Verdict(False, "no held-out batches to score the fit on (sweep too short)")
    worst = max(pre.mape, dec.mape)
    if worst > max_mape:
        return Verdict(
            False,
            f"held-out MAPE prefill {pre.mape:.1%}, decode {dec.mape:.1%} is above {max_mape:.1%}",
        )
    return Verdict(True, f"held-out MAPE prefill {pre.mape:.1%}, decode {dec.mape:.1%} (≤ {max_mape:.1%})")


def _finite_or_zero(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def sweep_summary(
    cfg: SweepConfig, sweep: SweepResult, cal: Calibration, heldout_frac: float, seed: int
) -> dict[str, Any]:
    """The sweep as plain data for the artifact: what was asked, what ran, how it was controlled."""
    shapes = sorted({(b.shape.batch, b.shape.input_tokens, b.shape.output_tokens) for b in sweep.batches})
    return {
        "batch_sizes": sorted({s[0] for s in shapes}),
        "input_lens": sorted({s[1] for s in shapes}),
        "output_lens": sorted({s[2] for s in shapes}),
        "reps": cfg.reps,
        "batches_planned": sweep.planned,
        "batches_measured": len(sweep.batches),
        "batches_failed": sweep.failed_batches,
        "batches_remeasured": sweep.remeasured,
        "batches_dropped_disturbed": sweep.dropped_disturbed,
        "requests_sent": sweep.requests_sent,
        "stop_reason": sweep.stop_reason,
        "queued_at_batch": sweep.queued_at_batch,
        "elapsed_s": round(sweep.elapsed_s, 3),
        "budget_s": cfg.budget_s,
        "max_concurrency": cfg.max_concurrency,
        "output_control": cal.control,
        "input_tokens_measured": cal.input_measured,
        "heldout_frac": heldout_frac,
        "seed": seed,
        "fit": "scipy lsq_linear (bvls), p >= 0, relative least squares, gross outliers dropped",
        "decode_steps": "O - 1 (first token comes from the prefill step)",
    }


def build_profile(
    info: EngineInfo,
    fit: FitResult,
    sweep: Mapping[str, Any],
    labels: Mapping[str, str | None],
) -> LatencyProfile:
    """The artifact: p1..p8 and their standard errors, KV capacity and source, limits, quality, labels."""
    all_labels = {
        "engine": info.engine,
        "model": info.model,
        **({"engine_version": info.engine_version} if info.engine_version else {}),
        **{k: v for k, v in labels.items() if v is not None},
    }
    return LatencyProfile(
        params=LatencyParams(*fit.params),
        stderr=LatencyParams(*fit.stderr),
        kv_capacity_tokens=info.kv_capacity_tokens,
        kv_capacity_source=info.kv_capacity_source,
        limits=EngineLimits(
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_model_len=info.max_model_len,
        ),
        quality=FitQuality(
            prefill_mape=_finite_or_zero(fit.prefill_heldout.mape),
            prefill_r2=_finite_or_zero(fit.prefill_heldout.r2),
            decode_mape=_finite_or_zero(fit.decode_heldout.mape),
            decode_r2=_finite_or_zero(fit.decode_heldout.r2),
            heldout_batches=fit.heldout_batches,
        ),
        labels=all_labels,
        sweep=dict(sweep),
        source="emulated" if info.emulated else "profiled",
    )
