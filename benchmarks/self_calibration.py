"""Self-calibration: how fast live latency learning makes up for what the router was not told.

Usage: ``python benchmarks/self_calibration.py [--requests 2000] [--rates 8,16,24,inf]
[--seeds 1,2,3] [--scenarios paper-a,paper-b,mixed] [--azure-scenarios paper-a,mixed] [--workers 2]
[--slowdown-requests 3200] [--gateway-scenarios paper-a,mixed] [--gateway-rates 16,24]
[--gateway-requests 800] [--speedup 2] [--skip-sim] [--skip-gateway] [--reuse FILE]
[--out benchmarks/results]``.

Four starting points, each with live learning on (``LearningConfig()`` defaults):

- ``profiled``: every backend has a latency profile. Simulator: ``config/profiles/*.yaml`` where one
  exists for that GPU/TP/model (paper-a, paper-b; measured on the emulator), else the roofline prior
  fitted to the very engine model the simulator runs (mixed) loaded as a profile;
- ``prior``: the fleet as built: ``gpu``/``tp`` labels, so the catalog's roofline prior;
- ``nothing``: no labels, no profile, no ``max_num_seqs`` (the neutral default prior);
- ``wrong``: a profile whose p1..p8 are the roofline prior's × 0.5 on even and × 2 on odd backends.

References: ``profiled-off`` (profiles, no learning), ``nothing-off`` (no labels, no learning: the
behaviour before learning) and ``wrr`` (``weighted_round_robin`` with ``benchmarks/policies.py``'s
``hand_weights``: TP × FP16 TFLOP/s). Every other run uses the ``default`` policy.

Simulator part (virtual time, the real router code): paper-a, paper-b and mixed with the ShareGPT-like
workload plus ``azure-conv`` on ``--azure-scenarios``; every rate and seed; ``--requests`` requests per
run. Reported per run: throughput, p99 TTFT and p99 e2e over the whole run and over the requests after
the first 1,000 (by arrival), and as ratios to the ``profiled`` run of the same scenario, workload,
rate and seed. The learned model's held-out error is recorded by wrapping ``LiveModels.observe``:
before each observation is learned from, |predicted / observed e2e − 1| under the published
parameters (what ``observe`` computes itself); the median over each backend's completions after its
200th is the held-out error. Slow-down: one backend (paper-a v100-tp4, paper-b a800-tp1, mixed h100)
runs 2× slower from t = 60 s at 16 req/s (``Slowdown``); reported: when ``LiveModels.drift_times_s``
first fires after the fault, and when the backend's request share (15 s trailing window) has moved
half-way from its pre-fault share to its share in a run where it was slow from the start.

Gateway part (real HTTP, real time): ``hetroute emulate --speedup K`` servers (``--served-model-name
house-llm`` for ``nothing``) and ``hetroute serve`` per run, the workload replayed open-loop with
streamed ``/v1/completions`` (``ignore_eos``); backend per request from ``x-hetroute-backend``; the
learned models from ``/admin/backends``. The gateway does not know K, so every profile file is written
with p1..p8 / K (in the emulators' clock), the ``prior`` start is the roofline prior / K written as a
profile file (with K = 1 the labels are used instead), and the learning clock is scaled too
(``refit_interval_s`` = 1 / K, ``half_life_s`` = 30 / K). Times are reported in model seconds (× K).
On a small shared machine the emulators, the gateway and the client share the CPU: contention shows
up as extra latency that the simulator does not have.

Writes ``self_calibration.json``, ``self_calibration.md``, ``self_calibration_convergence.png`` and
``self_calibration_slowdown.png`` under ``--out``. Loopback only; every run is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROFILES_DIR = HERE.parent / "config" / "profiles"
HETROUTE = [sys.executable, "-m", "hetroute"]
ADMIN_TOKEN = "bench"
STARTS = ("profiled", "prior", "nothing", "wrong")
REFERENCES = ("profiled-off", "nothing-off", "wrr")
LEARNING_ON = frozenset({"profiled", "prior", "nothing", "wrong"})
WARMUP = 1000
"""Requests (by arrival) that the "after warm-up" columns leave out."""
ERR_AFTER = 200
"""A backend's held-out error counts its completions after this many."""
FOCUS = {"paper-a": 0, "paper-b": 4, "mixed": 0}
"""Per scenario the backend the plots follow and the slow-down hits (the fastest one)."""
SLOW_FACTOR = 2.0
SLOW_AFTER_S = 60.0
SLOW_RATE = 16.0
SHARE_WINDOW_S = 15.0
THR_TARGET, LAT_TARGET, ERR_TARGET, DELAY_TARGET_S = 0.97, 1.2, 0.15, 60.0
TIE = 0.005
"""Throughputs within this fraction of WRR's count as a tie (both carry the offered load)."""


# --------------------------------------------------------------------------- fleets


def _catalogs() -> tuple[Any, Any]:
    from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog

    return load_gpu_catalog(), load_model_catalog()


def roofline_profile(spec: Any) -> Any:
    """The catalog's roofline prior of one backend as a profile."""
    from hetroute.catalog.specs import lookup_gpu, lookup_model
    from hetroute.prior import roofline_prior_profile

    gpus, models = _catalogs()
    return roofline_prior_profile(lookup_gpu(gpus, spec.gpu), lookup_model(models, spec.models[0]), spec.tp)


def profiled_profile(spec: Any) -> tuple[Any, str]:
    """The measured profile of ``spec`` when ``config/profiles`` has one, else the fitted roofline prior."""
    from hetroute.latency import load_profile

    name = f"{spec.gpu.lower()}_tp{spec.tp}_{spec.models[0].lower()}.yaml"
    path = PROFILES_DIR / name
    if path.exists():
        return load_profile(path), f"config/profiles/{name}"
    return roofline_profile(spec), "roofline prior fitted to the engine model"


def scaled(profile: Any, factor: float) -> Any:
    from hetroute.latency import LatencyParams

    return replace(profile, params=LatencyParams(*(v * factor for v in profile.params.as_tuple())))


def wrong_factor(i: int) -> float:
    return 0.5 if i % 2 == 0 else 2.0


_FLEETS: dict[tuple[str, str], Any] = {}


def fleet_for(scenario: str, variant: str) -> Any:
    """The simulator fleet of ``scenario`` as a starting point ``variant`` sees it (cached per process)."""
    key = (scenario, variant)
    if key in _FLEETS:
        return _FLEETS[key]
    from hetroute.sim.cluster_file import build_fleet
    from hetroute.sim.scenarios import get_scenario

    base = _FLEETS.get((scenario, "prior"))
    if base is None:
        base = _FLEETS[(scenario, "prior")] = build_fleet(get_scenario(scenario).cluster())
    kind = variant.removesuffix("-off")
    if kind in ("prior", "wrr"):
        fleet = base
    elif kind == "profiled":
        fleet = replace(
            base, backends=tuple(replace(b, profile=profiled_profile(b)[0]) for b in base.backends)
        )
    elif kind == "nothing":
        fleet = replace(
            base,
            backends=tuple(
                replace(b, gpu=None, tp=None, labels={}, max_num_seqs=None, profile=None)
                for b in base.backends
            ),
        )
    elif kind == "wrong":
        fleet = replace(
            base,
            backends=tuple(
                replace(b, profile=scaled(roofline_profile(b), wrong_factor(i)))
                for i, b in enumerate(base.backends)
            ),
        )
    else:
        raise ValueError(f"unknown variant {variant!r}")
    _FLEETS[key] = fleet
    return fleet


def hand_weights(scenario: str) -> list[float]:
    """``benchmarks/policies.py``'s hand-tuned WRR weights (TP × FP16 TFLOP/s)."""
    sys.path.insert(0, str(HERE))
    from policies import hand_weights as weights

    return [float(w) for w in weights(scenario)]


# --------------------------------------------------------------------------- simulator runs


@dataclass(frozen=True)
class SimTask:
    """One simulation; ``slowdown`` = (backend index, factor, after_s)."""

    group: str
    scenario: str
    workload: str
    rate: float
    seed: int
    requests: int
    variant: str
    slowdown: tuple[int, float, float] | None = None
    series: bool = False


class _Capture:
    """The learner of the current run and every held-out error, per backend: (finished_at_s, error)."""

    learner: Any = None
    errors: list[list[tuple[float, float]]] = []


def _install_capture() -> None:
    """Wrap the simulator's ``build_live_models`` so the run's learner and its held-out errors are kept."""
    import hetroute.simulation.simulator as simmod
    from hetroute.learning.fit import predict_e2e_s

    if getattr(simmod.build_live_models, "_self_calibration", False):  # type: ignore[attr-defined]
        return
    original = simmod.build_live_models  # type: ignore[attr-defined]

    def build(*args: Any, **kwargs: Any) -> Any:
        lm = original(*args, **kwargs)
        errors: list[list[tuple[float, float]]] = [[] for _ in lm.names]
        _Capture.learner, _Capture.errors = lm, errors
        observe = lm.observe

        def observing(obs: Any) -> None:
            i = obs.backend_index
            caps = getattr(lm, "_caps", None)
            seqs = getattr(lm, "_max_seqs", None)
            if caps is not None and seqs is not None:
                pred = predict_e2e_s(lm.params[i], obs, float(caps[i]), float(seqs[i]))
                if obs.e2e_s > 0 and pred > 0:
                    errors[i].append((obs.finished_at_s, abs(pred / obs.e2e_s - 1.0)))
            observe(obs)

        lm.observe = observing  # type: ignore[method-assign]
        return lm

    build._self_calibration = True  # type: ignore[attr-defined]
    simmod.build_live_models = build  # type: ignore[attr-defined]


def _p99(values: np.ndarray) -> float:
    done = values[~np.isnan(values)]
    return float(np.percentile(done, 99)) if done.size else math.nan


def _window_stats(
    arr: np.ndarray, tok: np.ndarray, ttft: np.ndarray, e2e: np.ndarray, mask: np.ndarray
) -> dict[str, float]:
    done = mask & ~np.isnan(e2e)
    if not done.any():
        return {"throughput": math.nan, "ttft_p99": math.nan, "e2e_p99": math.nan}
    span = float(np.max(arr[done] + e2e[done]) - np.min(arr[mask]))
    return {
        "throughput": float(tok[done].sum()) / span if span > 0 else math.nan,
        "ttft_p99": _p99(ttft[mask]),
        "e2e_p99": _p99(e2e[mask]),
    }


def _rolling_share(index: np.ndarray, backend: int, width: int) -> np.ndarray:
    hit = (index == backend).astype(np.float64)
    c = np.concatenate([[0.0], np.cumsum(hit)])
    k = np.arange(len(hit))
    lo = np.maximum(k + 1 - width, 0)
    share: np.ndarray = (c[k + 1] - c[lo]) / (k + 1 - lo)
    return share


def _time_share(arr: np.ndarray, index: np.ndarray, backend: int, step_s: float = 1.0) -> list[list[float]]:
    """(t, share of requests arriving in (t − SHARE_WINDOW_S, t] routed to ``backend``) every step_s."""
    out = []
    t = float(arr[0]) + SHARE_WINDOW_S
    end = float(arr[-1])
    while t <= end + 1e-9:
        m = (arr > t - SHARE_WINDOW_S) & (arr <= t)
        if m.any():
            out.append([round(t, 3), float(np.mean(index[m] == backend))])
        t += step_s
    return out


def execute(task: SimTask) -> dict[str, Any]:
    """Run one simulation (in a worker process) and summarise it as plain numbers."""
    logging.disable(logging.WARNING)
    from hetroute.learning.settings import LearningConfig
    from hetroute.sim.workload import generate_workload
    from hetroute.simulation.run import Slowdown
    from hetroute.simulation.simulator import run_simulation

    _install_capture()
    _Capture.learner, _Capture.errors = None, []
    fleet = fleet_for(task.scenario, task.variant)
    wl = generate_workload(
        cast(Any, task.workload), task.requests, task.rate, task.seed, fleet.max_model_len()
    )
    learning = LearningConfig() if task.variant in LEARNING_ON else None
    policy, params = "default", {}
    if task.variant == "wrr":
        policy, params = "weighted_round_robin", {"weights": hand_weights(task.scenario)}
    slow = [Slowdown(*task.slowdown)] if task.slowdown else []
    t0 = time.perf_counter()
    r = run_simulation(fleet, wl, policy, params, seed=task.seed, learning=learning, slowdowns=slow)
    wall = time.perf_counter() - t0
    arr = np.array([q.arrival_s for q in wl])
    tok = np.array([q.input_tokens + q.output_tokens for q in wl], dtype=np.float64)
    ttft, e2e, idx = np.asarray(r.ttft_s), np.asarray(r.e2e_s), np.asarray(r.backend_index)
    n_b = len(fleet.backends)
    after = np.arange(len(wl)) >= WARMUP
    out: dict[str, Any] = {
        "group": task.group,
        "scenario": task.scenario,
        "workload": task.workload,
        "rate": "inf" if math.isinf(task.rate) else f"{task.rate:g}",
        "seed": task.seed,
        "requests": task.requests,
        "variant": task.variant,
        "policy": policy,
        "learning": learning is not None,
        "slowdown": list(task.slowdown) if task.slowdown else None,
        "completed": r.completed,
        "rejected": r.rejected,
        "ledger_zero": r.ledger_zero,
        "wall_s": round(wall, 3),
        "whole": {
            "throughput": r.throughput_tokens_per_s,
            "ttft_p99": r.percentile("ttft", 99),
            "e2e_p99": r.percentile("e2e", 99),
        },
        "after_warmup": _window_stats(arr, tok, ttft, e2e, after) if after.any() else None,
        "request_share": [float(np.mean(idx == b)) for b in range(n_b)],
        "share_after_warmup": [
            float(np.mean(idx[after] == b)) if after.any() else math.nan for b in range(n_b)
        ],
    }
    lm = _Capture.learner
    if learning is not None and lm is not None:
        per_backend = []
        for b in range(n_b):
            errs = [e for _, e in _Capture.errors[b]]
            late = errs[ERR_AFTER:]
            per_backend.append(
                {
                    "name": fleet.backends[b].name,
                    "completions": len(errs),
                    "heldout_err_median_all": statistics.median(errs) if errs else math.nan,
                    "heldout_err_median_after_200": statistics.median(late) if late else math.nan,
                    "heldout_after_200_n": len(late),
                    "recent_e2e_errors_len": len(lm.recent_e2e_errors(b)),
                    "e2e_error_ewma": lm.e2e_error(b),
                    "drift_times_s": [round(t, 3) for t in lm.drift_times_s(b)],
                    "prior_kind": lm.prior_of(b).kind,
                    "params": [float(v) for v in lm.params[b]],
                }
            )
        out["learning_stats"] = per_backend
    if task.series:
        focus = FOCUS.get(task.scenario, 0)
        share = _rolling_share(idx, focus, 200)
        series: dict[str, Any] = {"focus_backend": fleet.backends[focus].name, "share_every": 10}
        series["focus_share"] = [round(float(v), 4) for v in share[::10]]
        if lm is not None:
            pooled = sorted((t, e) for errs in _Capture.errors for t, e in errs)
            ev = np.array([e for _, e in pooled])
            if ev.size:
                med = [float(np.median(ev[max(0, k - 99) : k + 1])) for k in range(0, ev.size, 10)]
                series["err_rolling_median"] = [round(v, 4) for v in med]
        out["series"] = series
    if task.slowdown:
        out["time_share"] = _time_share(arr, idx, task.slowdown[0])
    return out


def sim_tasks(args: argparse.Namespace) -> list[SimTask]:
    tasks = []
    variants = STARTS + REFERENCES
    for workload, scenarios in (("sharegpt", args.scenarios), ("azure-conv", args.azure_scenarios)):
        for scenario in scenarios:
            for rate in args.rates:
                for seed in args.seeds:
                    for v in variants:
                        series = workload == "sharegpt" and rate == SLOW_RATE and seed == args.seeds[0]
                        tasks.append(
                            SimTask("matrix", scenario, workload, rate, seed, args.requests, v, None, series)
                        )
    for scenario in args.scenarios:
        b = FOCUS.get(scenario, 0)
        for v in ("prior", "nothing", "prior-off"):
            tasks.append(
                SimTask(
                    "slowdown",
                    scenario,
                    "sharegpt",
                    SLOW_RATE,
                    args.seeds[0],
                    args.slowdown_requests,
                    v,
                    (b, SLOW_FACTOR, SLOW_AFTER_S),
                )
            )
        tasks.append(
            SimTask(
                "slowdown-ref",
                scenario,
                "sharegpt",
                SLOW_RATE,
                args.seeds[0],
                args.slowdown_requests,
                "prior",
                (b, SLOW_FACTOR, 0.0),
            )
        )
    return tasks


# --------------------------------------------------------------------------- gateway runs


async def one_request(
    session: Any, url: str, model: str, req: Any, start: float, speedup: float
) -> tuple[float, float, float, str]:
    """(ttft_s, e2e_s, end_s) in model seconds (end from the run's start) and the backend; NaN on failure."""
    import aiohttp

    from hetroute.sim.emulator_text import filler_prompt

    await asyncio.sleep(max(0.0, start + req.arrival_s / speedup - time.monotonic()))
    sent = time.monotonic()
    body = {
        "model": model,
        "prompt": filler_prompt(req.input_tokens, req.request_id),  # no shared prefix
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    first = math.nan
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
            backend = r.headers.get("x-hetroute-backend", "?")
            if r.status != 200:
                await r.read()
                return math.nan, math.nan, math.nan, backend
            async for _ in r.content.iter_any():
                if math.isnan(first):
                    first = time.monotonic()
    except (TimeoutError, aiohttp.ClientError):
        return math.nan, math.nan, math.nan, "?"
    end = time.monotonic()
    return (first - sent) * speedup, (end - sent) * speedup, (end - start) * speedup, backend


async def gateway_run(scenario: str, variant: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import yaml

    from hetroute.latency import save_profile
    from hetroute.sim.workload import generate_workload

    sys.path.insert(0, str(HERE))
    from policies_gateway import free_port, stop_processes, wait_ready

    fleet = fleet_for(scenario, "prior")
    k = float(args.speedup)
    kind = variant.removesuffix("-off")
    model = "house-llm" if kind == "nothing" else fleet.backends[0].models[0]
    procs: list[asyncio.subprocess.Process] = []
    tmp = Path(tempfile.mkdtemp(prefix="hetroute-selfcal-"))
    try:
        backends = []
        for i, b in enumerate(fleet.backends):
            port = free_port()
            cmd = [*HETROUTE, "emulate", "--gpu", str(b.gpu), "--model", b.models[0], "--tp", str(b.tp)]
            cmd += ["--port", str(port), "--speedup", f"{k:g}", "--seed", str(args.seed + i)]
            if kind == "nothing":
                cmd += ["--served-model-name", model]
            procs.append(
                await asyncio.create_subprocess_exec(
                    *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
                )
            )
            entry: dict[str, Any] = {
                "name": b.name,
                "url": f"http://127.0.0.1:{port}",
                "engine": "vllm",
                "models": [model],
            }
            profile = None
            if kind == "profiled":
                profile = profiled_profile(b)[0]
            elif kind == "wrong":
                profile = scaled(roofline_profile(b), wrong_factor(i))
            elif kind == "prior" and k != 1.0:
                profile = roofline_profile(b)
            elif kind == "prior":
                entry["labels"] = {"gpu": str(b.gpu), "tp": str(b.tp)}
            if profile is not None:
                path = tmp / f"{b.name}.yaml"
                save_profile(scaled(profile, 1.0 / k), path)
                entry["profile"] = str(path)
            backends.append(entry)
        gw_port = free_port()
        config = {
            "seed": args.seed,
            "admin_token": ADMIN_TOKEN,
            "server": {"host": "127.0.0.1", "port": gw_port, "access_log": False},
            "policy": {"type": "default", "params": {}},
            "scrape": {"interval_s": max(0.05, 1.0 / k)},
            "learning": {
                "enabled": variant in LEARNING_ON,
                "refit_interval_s": 1.0 / k,
                "half_life_s": 30.0 / k,
            },
            "backends": backends,
        }
        cfg = tmp / "router.yaml"
        cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
        procs.append(
            await asyncio.create_subprocess_exec(
                *HETROUTE,
                "serve",
                "--config",
                str(cfg),
                "--log-level",
                "ERROR",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        )
        work = generate_workload("sharegpt", args.gateway_requests, rate, args.seed, fleet.max_model_len())
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            for b in backends:
                await wait_ready(session, f"{b['url']}/health")
            base = f"http://127.0.0.1:{gw_port}"
            await wait_ready(session, f"{base}/v1/models")
            start = time.monotonic()
            out = await asyncio.wait_for(
                asyncio.gather(
                    *(one_request(session, f"{base}/v1/completions", model, r, start, k) for r in work)
                ),
                timeout=args.gateway_timeout_s,
            )
            wall = time.monotonic() - start
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with session.get(f"{base}/admin/backends", headers=headers) as r:
                admin = await r.json() if r.status == 200 else {}
    finally:
        await stop_processes(procs)
    names = [b.name for b in fleet.backends]
    ttft = np.array([o[0] for o in out])
    e2e = np.array([o[1] for o in out])
    ok = ~np.isnan(e2e)
    tokens = sum(r.input_tokens + r.output_tokens for r, good in zip(work, ok, strict=True) if good)
    makespan = float(np.nanmax([o[2] for o in out])) if ok.any() else math.nan
    idx = np.array([names.index(o[3]) if o[3] in names else -1 for o in out])
    learned = []
    for entry in admin.get("backends", admin if isinstance(admin, list) else []):
        lm = entry.get("learned_model") if isinstance(entry, dict) else None
        if lm:
            learned.append(
                {
                    "name": entry.get("name"),
                    "prior_kind": (lm.get("prior") or {}).get("kind"),
                    "samples": lm.get("samples"),
                    "observed_total": lm.get("observed_total"),
                    "e2e_error_ewma": lm.get("e2e_error"),
                    "drifts": lm.get("drifts"),
                    "fit_mape": lm.get("fit_mape"),
                }
            )
    return {
        "scenario": scenario,
        "variant": variant,
        "rate": "inf" if math.isinf(rate) else f"{rate:g}",
        "requests": len(work),
        "completed": int(ok.sum()),
        "failed": int((~ok).sum()),
        "wall_s": round(wall, 2),
        "whole": {
            "throughput": tokens / makespan if ok.any() and makespan > 0 else math.nan,
            "ttft_p99": _p99(ttft),
            "e2e_p99": _p99(e2e),
        },
        "request_share": [float(np.mean(idx == b)) for b in range(len(names))],
        "learned": learned,
        "admin_keys": sorted(admin.keys()) if isinstance(admin, dict) else None,
    }


# --------------------------------------------------------------------------- analysis


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return math.nan
    return a / b


def _mean(values: Sequence[float | None]) -> float:
    good = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(good) if good else math.nan


def attach_ratios(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple[str, ...]]) -> None:
    """Add ``vs_profiled`` (whole and after warm-up) to every row, against its group's ``profiled`` run."""
    ref = {key(r): r for r in rows if r["variant"] == "profiled"}
    for r in rows:
        p = ref.get(key(r))
        if p is None:
            continue
        vs: dict[str, Any] = {}
        for part in ("whole", "after_warmup"):
            if r.get(part) and p.get(part):
                vs[part] = {m: _ratio(r[part][m], p[part][m]) for m in ("throughput", "ttft_p99", "e2e_p99")}
        r["vs_profiled"] = vs


def aggregate(rows: list[dict[str, Any]], part: str) -> dict[tuple[str, ...], dict[str, float]]:
    """Mean over seeds of the ratios to profiled, per (scenario, workload, rate, variant)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["workload"], r["rate"], r["variant"]), []).append(r)
    out = {}
    for k, rs in groups.items():
        vs = [r.get("vs_profiled", {}).get(part) for r in rs]
        vs = [v for v in vs if v]
        out[k] = {m: _mean([v[m] for v in vs]) for m in ("throughput", "ttft_p99", "e2e_p99")} | {
            f"abs_{m}": _mean([(r.get(part) or {}).get(m, math.nan) for r in rs])
            for m in ("throughput", "ttft_p99", "e2e_p99")
        }
    return out


def slowdown_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    refs = {r["scenario"]: r for r in rows if r["group"] == "slowdown-ref"}
    for r in rows:
        if r["group"] != "slowdown":
            continue
        b, factor, after = r["slowdown"]
        ref = refs.get(r["scenario"])
        ts = np.array(r["time_share"])
        pre_m = (ts[:, 0] > after - 40) & (ts[:, 0] <= after)
        pre = float(np.mean(ts[pre_m, 1])) if pre_m.any() else math.nan
        target = math.nan
        if ref is not None:
            rt = np.array(ref["time_share"])
            m = rt[:, 0] >= after + SHARE_WINDOW_S
            target = float(np.mean(rt[m, 1])) if m.any() else math.nan
        post_m = ts[:, 0] >= ts[-1, 0] - 60
        post = float(np.mean(ts[post_m, 1]))
        adjust = math.nan
        if math.isfinite(pre) and math.isfinite(target) and pre - target > 0:
            half = pre - 0.5 * (pre - target)
            hit = ts[(ts[:, 0] > after) & (ts[:, 1] <= half)]
            if hit.size:
                adjust = float(hit[0, 0] - after)
        drift = math.nan
        false_drifts = 0
        for s in r.get("learning_stats", []):
            times = s["drift_times_s"]
            false_drifts += sum(1 for t in times if t < after)
        if r.get("learning_stats"):
            later = [t for t in r["learning_stats"][b]["drift_times_s"] if t >= after]
            drift = later[0] - after if later else math.nan
        out.append(
            {
                "scenario": r["scenario"],
                "variant": r["variant"],
                "backend": b,
                "factor": factor,
                "after_s": after,
                "share_before": pre,
                "share_target_slow_from_start": target,
                "share_last_60s": post,
                "detect_delay_s": drift,
                "half_adjust_delay_s": adjust,
                "drifts_before_fault": false_drifts,
                "throughput": r["whole"]["throughput"],
                "e2e_p99": r["whole"]["e2e_p99"],
            }
        )
    return out


def error_summary(rows: list[dict[str, Any]]) -> dict[tuple[str, ...], dict[str, Any]]:
    """Per (scenario, workload, finite rates | ∞, variant), per backend: its held-out median error after
    200 completions in every run where it had more than 200."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in rows:
        if r["group"] != "matrix" or "learning_stats" not in r:
            continue
        k = (r["scenario"], r["workload"], "∞" if r["rate"] == "inf" else "finite", r["variant"])
        d = out.setdefault(k, {})
        for s in r["learning_stats"]:
            if s["heldout_after_200_n"] > 0:
                d.setdefault(s["name"], []).append(s["heldout_err_median_after_200"])
    return out


# --------------------------------------------------------------------------- output


def _git_state() -> dict[str, Any]:
    """The commit this checkout is at and whether it has uncommitted changes (None: not a git checkout)."""
    import subprocess

    def git(*cmd: str) -> str | None:
        try:
            done = subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"git_head": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def _rounded(obj: Any) -> Any:
    """``obj`` with every float rounded to 6 significant digits (a smaller JSON file)."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def fmt(v: float, nd: int = 3) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.{nd}f}"


def plot(
    rows: list[dict[str, Any]], slow: list[dict[str, Any]], sim_rows: list[dict[str, Any]], out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [r for r in rows if r.get("series")]
    scenarios = sorted({r["scenario"] for r in series})
    if scenarios:
        fig, axes = plt.subplots(len(scenarios), 2, figsize=(12, 3.4 * len(scenarios)), squeeze=False)
        for row, scen in enumerate(scenarios):
            ax_s, ax_e = axes[row]
            for r in series:
                if r["scenario"] != scen:
                    continue
                s = r["series"]
                x = np.arange(len(s["focus_share"])) * s["share_every"]
                ax_s.plot(x, s["focus_share"], label=r["variant"], lw=1)
                if "err_rolling_median" in s:
                    xe = np.arange(len(s["err_rolling_median"])) * 10
                    ax_e.plot(xe, s["err_rolling_median"], label=r["variant"], lw=1)
                ax_s.set_title(
                    f"{scen}, {r['rate']} req/s: share of {s['focus_backend']} (last 200 requests)"
                )
            ax_e.set_title(f"{scen}: held-out |pred/obs e2e − 1|, rolling median of 100")
            ax_s.axvline(WARMUP, color="grey", ls=":")
            ax_e.axhline(ERR_TARGET, color="grey", ls=":")
            ax_s.set_xlabel("request (arrival order)")
            ax_e.set_xlabel("completion (all backends, in order)")
            ax_e.set_ylim(0, 1)
            ax_s.legend(fontsize=7)
            ax_e.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "self_calibration_convergence.png", dpi=110)
        plt.close(fig)
    slow_rows = [r for r in sim_rows if r["group"] in ("slowdown", "slowdown-ref")]
    scen_s = sorted({r["scenario"] for r in slow_rows})
    if scen_s:
        fig, axes = plt.subplots(1, len(scen_s), figsize=(5 * len(scen_s), 3.4), squeeze=False)
        for ax, scen in zip(axes[0], scen_s, strict=True):
            for r in slow_rows:
                if r["scenario"] != scen:
                    continue
                ts = np.array(r["time_share"])
                label = r["variant"] + (" (slow from t=0)" if r["group"] == "slowdown-ref" else "")
                ax.plot(ts[:, 0], ts[:, 1], label=label, lw=1)
            for s in slow:
                if s["scenario"] == scen and s["variant"] == "prior" and math.isfinite(s["detect_delay_s"]):
                    ax.axvline(
                        s["after_s"] + s["detect_delay_s"], color="red", ls=":", lw=1, label="drift detected"
                    )
            ax.axvline(SLOW_AFTER_S, color="black", ls="--", lw=1, label="2× slow-down")
            ax.set_title(f"{scen}: share of backend {FOCUS.get(scen, 0)} ({SHARE_WINDOW_S:g} s window)")
            ax.set_xlabel("modelled time (s)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "self_calibration_slowdown.png", dpi=110)
        plt.close(fig)


def ratio_table(
    agg: dict[tuple[str, ...], dict[str, float]],
    workload: str,
    scenarios: Sequence[str],
    rates: Sequence[str],
) -> list[str]:
    variants = STARTS + REFERENCES
    lines = [
        "| scenario | rate | start | thr / prof | p99 TTFT / prof | p99 e2e / prof | thr tok/s | "
        "p99 TTFT s | p99 e2e s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scen in scenarios:
        for rate in rates:
            for v in variants:
                a = agg.get((scen, workload, rate, v))
                if a is None:
                    continue
                lines.append(
                    f"| {scen} | {rate} | {v} | {fmt(a['throughput'])} | {fmt(a['ttft_p99'], 2)} | "
                    f"{fmt(a['e2e_p99'], 2)} | {fmt(a['abs_throughput'], 0)} | {fmt(a['abs_ttft_p99'], 3)} | "
                    f"{fmt(a['abs_e2e_p99'], 2)} |"
                )
    return lines


def targets(
    agg_w: dict[tuple[str, ...], dict[str, float]],
    agg_a: dict[tuple[str, ...], dict[str, float]],
    scenarios: Sequence[str],
    rates: Sequence[str],
    slow: list[dict[str, Any]],
    errs: dict[tuple[str, ...], dict[str, Any]],
    errs_recent_seen: Sequence[bool],
    false_drifts: dict[tuple[str, ...], tuple[int, int]],
) -> tuple[list[str], dict[str, Any]]:
    lines = ["## Done-when targets", ""]
    verdict: dict[str, Any] = {}
    lines += [
        "### 1. Nothing known + learning vs profiled (ShareGPT-like), and vs hand-tuned WRR",
        "",
        f"Met when throughput ≥ {THR_TARGET:.2f}× profiled and p99 TTFT and p99 e2e ≤ {LAT_TARGET}× profiled "
        f"over the requests after the first {WARMUP:,} (the whole run in brackets), and it beats WRR: "
        "throughput above WRR's with p99 TTFT and e2e no worse (``yes``); ``tie`` when the throughput is "
        f"within ±{TIE:.1%} of WRR's (both carry the offered load) with p99 TTFT and e2e no worse. "
        "Means over seeds.",
        "",
        "| scenario | rate | thr | p99 TTFT | p99 e2e | vs profiled | thr vs WRR | p99 TTFT vs WRR | "
        "p99 e2e vs WRR | beats WRR |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    met_all = True
    cells: list[dict[str, Any]] = []
    for scen in scenarios:
        for rate in rates:
            a = agg_a.get((scen, "sharegpt", rate, "nothing"))
            w = agg_w.get((scen, "sharegpt", rate, "nothing"))
            wa = agg_a.get((scen, "sharegpt", rate, "wrr"))
            if a is None or w is None or wa is None:
                continue
            ok = a["throughput"] >= THR_TARGET and a["ttft_p99"] <= LAT_TARGET and a["e2e_p99"] <= LAT_TARGET
            thr_w = _ratio(a["abs_throughput"], wa["abs_throughput"])
            ttft_w = _ratio(a["abs_ttft_p99"], wa["abs_ttft_p99"])
            e2e_w = _ratio(a["abs_e2e_p99"], wa["abs_e2e_p99"])
            tails = ttft_w <= 1.0 and e2e_w <= 1.0
            beats = thr_w > 1.0 + TIE and tails
            tie = abs(thr_w - 1.0) <= TIE and tails
            met_all = met_all and ok and beats
            cells.append(
                {
                    "scenario": scen,
                    "rate": rate,
                    "met": ok,
                    "beats_wrr": beats,
                    "ties_wrr": tie,
                    "vs_wrr": {"throughput": thr_w, "ttft_p99": ttft_w, "e2e_p99": e2e_w},
                    "after": a,
                    "whole": w,
                }
            )
            lines.append(
                f"| {scen} | {rate} | {fmt(a['throughput'])} ({fmt(w['throughput'])}) | "
                f"{fmt(a['ttft_p99'], 2)} ({fmt(w['ttft_p99'], 2)}) | "
                f"{fmt(a['e2e_p99'], 2)} ({fmt(w['e2e_p99'], 2)}) | "
                f"{'met' if ok else 'MISSED'} | {fmt(thr_w)} | {fmt(ttft_w, 2)} | {fmt(e2e_w, 2)} | "
                f"{'yes' if beats else ('tie' if tie else 'NO')} |"
            )
    finite = [c for c in cells if c["rate"] != "inf"]
    met_finite = all(c["met"] and c["beats_wrr"] for c in finite)
    met_finite_ties = all(c["met"] and (c["beats_wrr"] or c["ties_wrr"]) for c in finite)
    whole_finite = all(
        c["whole"]["throughput"] >= THR_TARGET
        and c["whole"]["ttft_p99"] <= LAT_TARGET
        and c["whole"]["e2e_p99"] <= LAT_TARGET
        for c in finite
    )
    verdict["nothing_known"] = {
        "met_everywhere": met_all,
        "met_at_finite_rates": met_finite,
        "met_at_finite_rates_counting_ties_with_wrr": met_finite_ties,
        "vs_profiled_whole_run_at_finite_rates": whole_finite,
        "cells": cells,
    }
    lines += [
        "",
        f"**Target 1: {'met' if met_all else 'MISSED'}** at every rate (cells marked MISSED / NO); "
        f"at the finite rates only: {'met' if met_finite else 'MISSED'} "
        f"({'met' if met_finite_ties else 'MISSED'} when a tie with WRR counts); "
        "vs profiled over the whole run (warm-up included) at the finite rates: "
        f"{'met' if whole_finite else 'MISSED'}. "
        "At rate ∞ every request is routed at t = 0, "
        "before any request has finished, so nothing can be learned in time: that run shows the prior alone.",
        "",
    ]
    lines += [
        f"### 2. 2× slow-down of one backend at t = {SLOW_AFTER_S:g} s, {SLOW_RATE:g} req/s",
        "",
        "Detection: first ``drift_times_s`` of the slowed backend after the fault. Share adjusted: the "
        f"backend's request share ({SHARE_WINDOW_S:g} s trailing window, so up to {SHARE_WINDOW_S:g} s "
        "of lag "
        "is the window's) first crosses half-way from its pre-fault share to its share in a run where it was "
        f"slow from t = 0 (catalog prior, learning on). Target: both ≤ {DELAY_TARGET_S:g} s.",
        "",
        "| scenario | start | backend | share before | share target | share last 60 s | detected after s | "
        "half-adjusted after s | drifts before fault | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    slow_ok = True
    for s in slow:
        learning = s["variant"] != "prior-off"
        ok = (
            math.isfinite(s["detect_delay_s"])
            and s["detect_delay_s"] <= DELAY_TARGET_S
            and math.isfinite(s["half_adjust_delay_s"])
            and s["half_adjust_delay_s"] <= DELAY_TARGET_S
        )
        if learning:
            slow_ok = slow_ok and ok
        lines.append(
            f"| {s['scenario']} | {s['variant']} | {s['backend']} | {fmt(s['share_before'])} | "
            f"{fmt(s['share_target_slow_from_start'])} | {fmt(s['share_last_60s'])} | "
            f"{fmt(s['detect_delay_s'], 1)} | "
            f"{fmt(s['half_adjust_delay_s'], 1)} | {s['drifts_before_fault']} | "
            f"{('met' if ok else 'MISSED') if learning else 'reference'} |"
        )
    verdict["slowdown"] = {"met": slow_ok}
    lines += ["", f"**Target 2: {'met' if slow_ok else 'MISSED'}**.", ""]
    lines += [
        "False alarms: drifts detected in the simulator runs that have no fault (the matrix runs with "
        "learning on), summed over backends, starting points and seeds; rows with none are left out.",
        "",
        "| scenario | workload | rate | runs | drifts | drifts per run |",
        "|---|---|---|---|---|---|",
    ]
    for (scen, wl, rate), (runs, n) in sorted(false_drifts.items()):
        if n:
            lines.append(f"| {scen} | {wl} | {rate} | {runs} | {n} | {n / runs:.1f} |")
    verdict["false_drifts"] = {"/".join(k): v for k, v in false_drifts.items()}
    lines.append("")
    lines += [
        "### 3. Held-out e2e error once a backend has had 200 completions",
        "",
        "Per backend and run: median |predicted / observed e2e − 1| over its completions after the 200th, "
        "each predicted before the model had seen it (backends with ≤ 200 completions in a run do not "
        "count). Per row: the worst backend-run, the median over backend-runs, and how many there were; "
        f"finite rates (8, 16, 24) and ∞ apart. Target: ≤ {ERR_TARGET:.0%}.",
        "",
        "| scenario | workload | rates | start | worst (backend) | median | backend-runs | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    err_ok = True
    err_finite_ok = True
    err_finite_sharegpt_ok = True
    bad: list[str] = []
    for (scen, wl, rates_class, v), raw in sorted(errs.items()):
        d = {n: (max(x), statistics.median(x), len(x)) for n, x in raw.items() if x}
        if not d:
            continue
        worst_name = max(d, key=lambda n: d[n][0])
        worst = d[worst_name][0]
        n_runs = sum(x[2] for x in d.values())
        med = statistics.median(x for values in raw.values() for x in values)
        ok = worst <= ERR_TARGET
        err_ok = err_ok and ok
        if rates_class == "finite":
            err_finite_ok = err_finite_ok and ok
            if wl == "sharegpt":
                err_finite_sharegpt_ok = err_finite_sharegpt_ok and ok
        if not ok:
            bad.extend(f"{scen}/{wl}/{rates_class}/{v}/{n}" for n in d if d[n][0] > ERR_TARGET)
        lines.append(
            f"| {scen} | {wl} | {rates_class} | {v} | {fmt(worst)} ({worst_name}) | {fmt(med)} | {n_runs} | "
            f"{'met' if ok else 'MISSED'} |"
        )
    verdict["heldout_error"] = {
        "met": err_ok,
        "met_at_finite_rates": err_finite_ok,
        "met_at_finite_rates_sharegpt": err_finite_sharegpt_ok,
        "missed": bad,
    }
    if not any(errs_recent_seen):
        lines += [
            "",
            "Note: ``LiveModels.recent_e2e_errors`` returned nothing in every run (its deque is never "
            "appended to in ``hetroute/learning/live.py`` at the time of this run); the errors above come "
            "from the "
            "benchmark's wrapper of ``observe``, which makes the same prediction ``observe`` makes.",
        ]
    lines += [
        "",
        f"**Target 3: {'met' if err_ok else 'MISSED'}** over all runs; at the finite rates: "
        f"{'met' if err_finite_ok else 'MISSED'}; at the finite rates with the ShareGPT-like workload: "
        f"{'met' if err_finite_sharegpt_ok else 'MISSED'}.",
        "",
    ]
    return lines, verdict


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--rates", default="8,16,24,inf")
    ap.add_argument("--scenarios", default="paper-a,paper-b,mixed")
    ap.add_argument("--azure-scenarios", default="paper-a,mixed")
    ap.add_argument("--slowdown-requests", type=int, default=3200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gateway-scenarios", default="paper-a,mixed")
    ap.add_argument("--gateway-rates", default="16,24")
    ap.add_argument("--gateway-requests", type=int, default=800)
    ap.add_argument("--gateway-variants", default="profiled,prior,nothing,wrong,nothing-off")
    ap.add_argument("--gateway-timeout-s", type=float, default=240.0)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1, help="gateway workload seed")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--skip-gateway", action="store_true")
    ap.add_argument("--code-note", default="", help="free text on the code version, kept in the results")
    ap.add_argument(
        "--also-gateway",
        type=Path,
        nargs="*",
        default=[],
        help="other self_calibration.json files whose gateway runs are added as further passes "
        "(a repeat of some cells, to show run-to-run noise)",
    )
    ap.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="an earlier self_calibration.json: take its simulator runs and its successful gateway runs, "
        "run only the gateway runs that are missing or failed there",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.rates = [math.inf if r == "inf" else float(r) for r in args.rates.split(",")]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.azure_scenarios = [s for s in args.azure_scenarios.split(",") if s]
    rate_labels = ["inf" if math.isinf(r) else f"{r:g}" for r in args.rates]
    logging.disable(logging.WARNING)
    started = time.perf_counter()
    sim_rows: list[dict[str, Any]] = []
    old: dict[str, Any] = {}
    if args.reuse is not None:
        old = json.loads(args.reuse.read_text(encoding="utf-8"))
        sim_rows = list(old.get("simulator", []))
        st = old.get("settings", {})
        args.requests = st.get("requests", args.requests)
        args.seeds = st.get("seeds", args.seeds)
        args.scenarios = st.get("scenarios", args.scenarios)
        args.azure_scenarios = st.get("azure_scenarios", args.azure_scenarios)
        args.slowdown_requests = st.get("slowdown", {}).get("requests", args.slowdown_requests)
        rate_labels = st.get("rates", rate_labels)
        print(f"reusing {len(sim_rows)} simulator runs from {args.reuse}", flush=True)
    elif not args.skip_sim:
        tasks = sim_tasks(args)
        print(f"simulator: {len(tasks)} runs on {args.workers} workers", flush=True)
        with ProcessPoolExecutor(max_workers=max(1, min(args.workers, 2))) as pool:
            for n, row in enumerate(pool.map(execute, tasks, chunksize=1), 1):
                sim_rows.append(row)
                if n % 20 == 0 or n == len(tasks):
                    print(f"  {n}/{len(tasks)} ({time.perf_counter() - started:.0f} s)", flush=True)
    sim_elapsed = time.perf_counter() - started + float(old.get("elapsed_s", {}).get("simulator", 0.0))
    matrix = [r for r in sim_rows if r["group"] == "matrix"]
    attach_ratios(matrix, lambda r: (r["scenario"], r["workload"], r["rate"], r["seed"]))
    agg_w, agg_a = aggregate(matrix, "whole"), aggregate(matrix, "after_warmup")
    slow = slowdown_summary(sim_rows)
    errs = error_summary(sim_rows)

    gw_rows: list[dict[str, Any]] = []
    gw_started = time.perf_counter()
    if not args.skip_gateway:
        for scen in [s for s in args.gateway_scenarios.split(",") if s]:
            for rate in [math.inf if r == "inf" else float(r) for r in args.gateway_rates.split(",")]:
                for v in args.gateway_variants.split(","):
                    done = [
                        r
                        for r in old.get("gateway", [])
                        if (r["scenario"], r["variant"], r["rate"]) == (scen, v, f"{rate:g}")
                        and "error" not in r
                    ]
                    if done:
                        gw_rows.append(done[0])
                        continue
                    row = {}
                    for attempt in range(2):  # a port taken between free_port() and bind: try once more
                        try:
                            row = asyncio.run(gateway_run(scen, v, rate, args))
                            if old:
                                row["rerun"] = "run again with --reuse: missing or failed in the reused file"
                            break
                        except (TimeoutError, OSError) as exc:
                            row = {"scenario": scen, "variant": v, "rate": f"{rate:g}", "error": repr(exc)}
                            row["attempts"] = attempt + 1
                    gw_rows.append(row)
                    w = row.get("whole", {})
                    print(
                        f"gateway {scen:8s} {row['rate']:>4} {v:12s} "
                        f"thr {fmt(w.get('throughput', math.nan), 0)} "
                        f"p99 TTFT {fmt(w.get('ttft_p99', math.nan), 3)} "
                        f"p99 e2e {fmt(w.get('e2e_p99', math.nan), 2)} "
                        f"done {row.get('completed')} failed {row.get('failed')} wall {row.get('wall_s')} s",
                        flush=True,
                    )
    for r in gw_rows:
        r.setdefault("pass", 1)
    for n, extra in enumerate(args.also_gateway, 2):
        more = json.loads(extra.read_text(encoding="utf-8")).get("gateway", [])
        print(f"adding {len(more)} gateway runs from {extra} as pass {n}", flush=True)
        gw_rows.extend(r | {"pass": n, "from": str(extra)} for r in more)
    attach_ratios(gw_rows, lambda r: (r["scenario"], r["rate"], str(r["pass"])))
    gw_elapsed = time.perf_counter() - gw_started + float(old.get("elapsed_s", {}).get("gateway", 0.0))

    args.out.mkdir(parents=True, exist_ok=True)
    if sim_rows:
        plot(matrix, slow, sim_rows, args.out)
    profiles = {}
    for scen in sorted(set(args.scenarios) | set(args.azure_scenarios)):
        fleet = fleet_for(scen, "prior")
        profiles[scen] = {b.name: profiled_profile(b)[1] for b in fleet.backends}
    recent_seen = [s["recent_e2e_errors_len"] > 0 for r in sim_rows for s in r.get("learning_stats", [])]
    false_drifts: dict[tuple[str, ...], tuple[int, int]] = {}
    for r in matrix:
        if "learning_stats" in r:
            k = (r["scenario"], r["workload"], r["rate"])
            runs, n = false_drifts.get(k, (0, 0))
            false_drifts[k] = (runs + 1, n + sum(len(s["drift_times_s"]) for s in r["learning_stats"]))
    target_lines, verdict = targets(
        agg_w, agg_a, args.scenarios, rate_labels, slow, errs, recent_seen, false_drifts
    )
    doc = {
        "benchmark": "self_calibration",
        "settings": {
            "requests": args.requests,
            "seeds": args.seeds,
            "rates": rate_labels,
            "scenarios": args.scenarios,
            "azure_scenarios": args.azure_scenarios,
            "warmup_requests": WARMUP,
            "slowdown": {
                "factor": SLOW_FACTOR,
                "after_s": SLOW_AFTER_S,
                "rate": SLOW_RATE,
                "requests": args.slowdown_requests,
                "backend": FOCUS,
            },
            "gateway": {
                "scenarios": args.gateway_scenarios,
                "rates": args.gateway_rates,
                "requests": args.gateway_requests,
                "speedup": args.speedup,
                "variants": args.gateway_variants,
                "seed": args.seed,
            },
            "profiled_sources": profiles,
            "wrr_weights": {s: hand_weights(s) for s in args.scenarios},
        },
        "elapsed_s": {"simulator": round(sim_elapsed, 1), "gateway": round(gw_elapsed, 1)},
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "gpu": None,
        },
        "code": _git_state()
        | {"note": args.code_note}
        | ({"reused_runs_code": old.get("code")} if old else {}),
        "verdict": verdict,
        "slowdown": slow,
        "heldout_error": {"/".join(k): v for k, v in errs.items()},
        "simulator": sim_rows,
        "gateway": gw_rows,
    }
    clean = _rounded(
        json.loads(json.dumps(doc, default=str).replace("NaN", "null").replace("Infinity", "null"))
    )
    (args.out / "self_calibration.json").write_text(json.dumps(clean, indent=1) + "\n", encoding="utf-8")
    md = [
        "# Self-calibration: live latency learning from four starting points",
        "",
        f"Simulator: {args.requests} requests per run, seeds {args.seeds}, "
        f"rates {', '.join(rate_labels)} req/s; code: {args.code_note or _git_state()}; "
        f"{len(sim_rows)} runs in {sim_elapsed:.0f} s. Machine: {os.cpu_count()} cores, no GPU. "
        "Starting points (all with learning on): profiled, prior (catalog roofline), nothing (neutral), "
        "wrong (roofline × 0.5 / × 2); references: profiled-off, nothing-off (no learning), wrr "
        "(hand-tuned weights). Ratios are to the profiled run (learning on) of the same seed, then averaged "
        "over seeds. Profiled sources: "
        + "; ".join(f"{s}: " + ", ".join(f"{n} ← {p}" for n, p in d.items()) for s, d in profiles.items())
        + ".",
        "",
        *target_lines,
        f"## Simulator, ShareGPT-like, after the first {WARMUP:,} requests",
        "",
        *ratio_table(agg_a, "sharegpt", args.scenarios, rate_labels),
        "",
        "## Simulator, ShareGPT-like, whole run",
        "",
        *ratio_table(agg_w, "sharegpt", args.scenarios, rate_labels),
        "",
    ]
    if args.azure_scenarios:
        md += [
            f"## Simulator, azure-conv, after the first {WARMUP:,} requests",
            "",
            *ratio_table(agg_a, "azure-conv", args.azure_scenarios, rate_labels),
            "",
            "## Simulator, azure-conv, whole run",
            "",
            *ratio_table(agg_w, "azure-conv", args.azure_scenarios, rate_labels),
            "",
        ]
    if gw_rows:
        md += [
            f"## Gateway + emulators ({args.gateway_requests} requests, speedup {args.speedup:g}, "
            f"seed {args.seed}, "
            f"{gw_elapsed:.0f} s)",
            "",
            "Real HTTP on a shared 2-core machine: the emulators, the gateway and the client compete for the "
            "CPU, which adds latency the simulator does not have. Whole run only (fewer than "
            f"{WARMUP:,} requests). Times in model seconds.",
            "",
            "Pass 1 is the full grid; further passes repeat some cells later (``--also-gateway``), ratios "
            "within a pass; ``(re-run)``: a cell that failed in the first go and ran again later. "
            "Drifts: ``/admin/backends`` ``learned_model.drifts`` per backend.",
            "",
            "| pass | scenario | rate | start | thr / prof | p99 TTFT / prof | p99 e2e / prof | thr tok/s | "
            "p99 TTFT s | p99 e2e s | done | failed | share | learned e2e error (EWMA) | drifts |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in gw_rows:
            if "error" in r:
                md.append(
                    f"| {r['pass']} | {r['scenario']} | {r['rate']} | {r['variant']} | error: {r['error']} |"
                )
                continue
            vs = r.get("vs_profiled", {}).get("whole", {})
            w = r["whole"]
            errs_txt = ", ".join(
                f"{x['name']}: {fmt(x['e2e_error_ewma'] if x['e2e_error_ewma'] is not None else math.nan, 2)}"
                for x in r["learned"]
            )
            md.append(
                f"| {r['pass']} | {r['scenario']} | {r['rate']} | "
                f"{r['variant']}{' (re-run)' if 'rerun' in r else ''} | "
                f"{fmt(vs.get('throughput', math.nan))} | "
                f"{fmt(vs.get('ttft_p99', math.nan), 2)} | {fmt(vs.get('e2e_p99', math.nan), 2)} | "
                f"{fmt(w['throughput'], 0)} | {fmt(w['ttft_p99'], 3)} | {fmt(w['e2e_p99'], 2)} | "
                f"{r['completed']} | "
                f"{r['failed']} | {' / '.join(f'{s:.2f}' for s in r['request_share'])} | {errs_txt or '–'} | "
                f"{' / '.join(str(x['drifts']) for x in r['learned']) or '–'} |"
            )
        md.append("")
    md += [
        "Plots: `self_calibration_convergence.png` (per scenario at 16 req/s, seed "
        f"{args.seeds[0]}: rolling share of the fastest backend and rolling held-out e2e error per starting "
        "point) and `self_calibration_slowdown.png` (share of the slowed backend over time).",
        "",
    ]
    (args.out / "self_calibration.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
