"""``--plot``: measured versus fitted time per phase, training and held-out batches marked.

Owns only the figure; matplotlib is imported lazily with the non-interactive Agg backend so the
profiler never needs a display.
"""

from __future__ import annotations

from pathlib import Path

from profiling.fit import BatchSample, FitResult, decode_design, predict, prefill_design


def _points(batches: tuple[BatchSample, ...], fit: FitResult, phase: str) -> tuple[list[float], list[float]]:
    if phase == "prefill":
        pre = [b.prefill for b in batches]
        return [s.time_s for s in pre], list(predict(prefill_design(pre), fit.prefill.coef)) if pre else []
    dec = [b.decode for b in batches if b.decode is not None]
    return [s.time_s for s in dec], list(predict(decode_design(dec), fit.decode.coef)) if dec else []


def plot_fit(fit: FitResult, path: str | Path, title: str) -> None:
    """Write a PNG with one log-log panel per phase; the diagonal is a perfect fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, phase, quality in (
        (axes[0], "prefill", fit.prefill_heldout),
        (axes[1], "decode", fit.decode_heldout),
    ):
        lo, hi = float("inf"), 0.0
        for batches, label, marker in ((fit.train, "train", "o"), (fit.heldout, "held-out", "x")):
            measured, fitted = _points(batches, fit, phase)
            if measured:
                ax.scatter(measured, fitted, label=f"{label} ({len(measured)})", marker=marker, s=18)
                lo = min(lo, *measured, *fitted)
                hi = max(hi, *measured, *fitted)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured (s)")
        ax.set_ylabel("fitted (s)")
        ax.set_title(f"{phase}: held-out MAPE {quality.mape:.1%}, R² {quality.r2:.3f}")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
