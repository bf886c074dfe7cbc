"""``hetroute profile`` end to end: discover, calibrate, sweep, fit, judge, write (method.md §2–3).

Owns: the order of the steps, the one HTTP session (bounded connection pool, explicit timeouts),
the log lines an operator sees, and the outcome's exit code. The command-line module only parses
arguments into :class:`ProfileOptions` and calls :func:`profile_backend`; tests call it directly.

Exit codes: 0 profile written; 1 fit refused (held-out error above the threshold, or nothing to
score) or sweep produced too little data; 2 the backend could not be discovered or probed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from hetroute.latency import LatencyProfile, save_profile
from hetroute.types import Clock, EngineKind
from profiling.artifact import Verdict, build_profile, judge, sweep_summary
from profiling.calibrate import Calibration, calibrate
from profiling.client import RequestFailed
from profiling.collect import Progress, SweepConfig, SweepResult, plan_sweep, run_sweep
from profiling.discover import DiscoveryError, EngineInfo, Overrides, discover
from profiling.fit import FitResult, fit_batches

KEEPALIVE_S = 2.0
"""Idle client sockets are closed after this, before the engine closes them (uvicorn, so vLLM, after
5 s): reusing a socket the engine is closing fails the request."""
EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_BACKEND = 2


class ScaledClock:
    """``base`` read ``factor`` times faster: profiling an emulator run with ``--speedup K`` through a
    clock scaled by K yields the modelled GPU seconds, not the emulator's wall seconds."""

    def __init__(self, base: Clock, factor: float) -> None:
        if factor <= 0:
            raise ValueError(f"time_scale: must be > 0, got {factor}")
        self._base = base
        self._factor = factor

    def now(self) -> float:
        return self._base.now() * self._factor


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    backend_url: str
    engine: EngineKind
    out: Path
    sweep: SweepConfig = field(default_factory=SweepConfig)
    overrides: Overrides = field(default_factory=Overrides)
    heldout_frac: float = 0.25
    max_mape: float = 0.10
    force: bool = False
    seed: int = 0
    plot: Path | None = None
    time_scale: float = 1.0
    labels: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac: must be in (0, 1), got {self.heldout_frac}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale: must be > 0, got {self.time_scale}")
        if self.max_mape <= 0:
            raise ValueError(f"max_mape: must be > 0, got {self.max_mape}")


@dataclass
class ProfileOutcome:
    exit_code: int
    message: str
    info: EngineInfo | None = None
    sweep: SweepResult | None = None
    fit: FitResult | None = None
    verdict: Verdict | None = None
    profile: LatencyProfile | None = None
    written: bool = False


def format_progress(p: Progress, time_scale: float = 1.0) -> str:
    """One progress line; elapsed and ETA in wall seconds (the sweep's clock runs ``time_scale`` fast)."""
    s = p.shape
    return (
        f"[profile] batch {p.done}/{p.total} (b={s.batch} I={s.input_tokens} O={s.output_tokens}) "
        f"elapsed {p.elapsed_s / time_scale:.1f}s ETA {p.eta_s / time_scale:.1f}s"
    )


def _session(opts: ProfileOptions) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=opts.sweep.timeout_s)
    connector = aiohttp.TCPConnector(limit=opts.sweep.max_concurrency + 1, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


async def profile_backend(opts: ProfileOptions, clock: Clock, log: Callable[[str], None]) -> ProfileOutcome:
    """Run the whole profile; never raises for backend trouble (it becomes exit code 2)."""
    rng = random.Random(opts.seed)
    sweep_cfg = opts.sweep
    if opts.time_scale != 1.0:  # budget and timeouts stay wall seconds; the sweep reads the scaled clock
        clock = ScaledClock(clock, opts.time_scale)
        k = opts.time_scale
        sweep_cfg = replace(sweep_cfg, budget_s=sweep_cfg.budget_s * k, timeout_s=sweep_cfg.timeout_s * k)
    async with _session(opts) as session:
        try:
            info = await discover(session, opts.backend_url, opts.engine, opts.overrides)
        except DiscoveryError as exc:
            return ProfileOutcome(EXIT_BACKEND, f"discovery failed: {exc}")
        log(
            f"[profile] {opts.backend_url}: {info.engine} {info.engine_version or '(version unknown)'}, "
            f"model {info.model}, max_model_len {info.max_model_len}, "
            f"KV capacity {info.kv_capacity_tokens} tokens ({info.kv_capacity_source})"
        )
        for note in info.notes:
            log(f"[profile]   {note}")
        try:
            cal = await calibrate(session, opts.backend_url, info, opts.sweep.run_id, clock)
        except (RequestFailed, aiohttp.ClientError, TimeoutError) as exc:
            return ProfileOutcome(EXIT_BACKEND, f"probe request failed: {exc}", info=info)
        for note in cal.notes:
            log(f"[profile]   {note}")
        plan = plan_sweep(sweep_cfg, info, rng)
        if not plan:
            return ProfileOutcome(EXIT_REFUSED, "no feasible batch shape (check the limits)", info=info)
        log(
            f"[profile] sweep: {len(plan)} batches, {sum(s.batch for s in plan)} requests, "
            f"budget {opts.sweep.budget_s:.0f}s, at most {opts.sweep.max_concurrency} in flight"
        )
        sweep = await run_sweep(
            session,
            opts.backend_url,
            info,
            plan,
            sweep_cfg,
            cal,
            clock,
            lambda p: log(format_progress(p, opts.time_scale)),
        )
        sweep.elapsed_s /= opts.time_scale  # report wall seconds
    return _fit_and_write(opts, info, cal, sweep, rng, log)


def _fit_and_write(
    opts: ProfileOptions,
    info: EngineInfo,
    cal: Calibration,
    sweep: SweepResult,
    rng: random.Random,
    log: Callable[[str], None],
) -> ProfileOutcome:
    """Fit what the sweep measured, score it on the held-out batches, plot, judge and write."""
    log(
        f"[profile] measured {len(sweep.batches)}/{sweep.planned} batches in {sweep.elapsed_s:.1f}s "
        f"({sweep.stop_reason}; {sweep.failed_batches} failed)"
    )
    for note in sweep.notes:
        log(f"[profile]   {note}")
    samples = [b.to_sample() for b in sweep.batches]
    try:
        fit = fit_batches(samples, opts.heldout_frac, rng)
    except ValueError as exc:
        return ProfileOutcome(EXIT_REFUSED, f"cannot fit: {exc}", info=info, sweep=sweep)
    verdict = judge(fit, opts.max_mape)
    summary = sweep_summary(opts.sweep, sweep, cal, opts.heldout_frac, opts.seed)
    summary["time_scale"] = opts.time_scale
    summary["train_outliers_dropped"] = {
        "prefill": fit.prefill.outliers_dropped,
        "decode": fit.decode.outliers_dropped,
    }
    profile = build_profile(info, fit, summary, opts.labels)
    pre, dec = fit.prefill_heldout, fit.decode_heldout
    log(
        f"[profile] fit: prefill held-out MAPE {pre.mape:.2%} R² {pre.r2:.4f}; "
        f"decode held-out MAPE {dec.mape:.2%} R² {dec.r2:.4f} "
        f"({fit.train_batches} train / {fit.heldout_batches} held-out batches; training outliers dropped: "
        f"{fit.prefill.outliers_dropped} prefill, {fit.decode.outliers_dropped} decode)"
    )
    log(
        "[profile] p1..p8 = "
        + ", ".join(f"{p:.4g}±{e:.2g}" for p, e in zip(fit.params, fit.stderr, strict=True))
    )
    if opts.plot is not None:
        from profiling.plot import plot_fit

        plot_fit(fit, opts.plot, f"{info.model} on {opts.labels.get('gpu') or opts.backend_url}")
        log(f"[profile] plot written to {opts.plot}")
    outcome = ProfileOutcome(EXIT_OK, verdict.reason, info, sweep, fit, verdict, profile)
    if not verdict.accepted and not opts.force:
        outcome.exit_code = EXIT_REFUSED
        outcome.message = f"refusing to write {opts.out}: {verdict.reason} (use --force to write anyway)"
        return outcome
    save_profile(profile, opts.out)
    outcome.written = True
    outcome.message = f"wrote {opts.out}: {verdict.reason}" + ("" if verdict.accepted else " (forced)")
    return outcome
