"""Admission control through the real gateway: ``hetroute serve`` in front of ``hetroute emulate`` servers.

Usage: ``python benchmarks/admission_gateway.py [--requests 400] [--speedup 2] [--overload-s 40]``.
Writes ``benchmarks/results/<--name, default admission_gateway>.{json,md}``.

On ``--scenario`` (default paper-a: two emulated vLLM servers, Llama-3-8B on V100-SXM2-32GB at TP4
and TP1; paper-b and mixed: one emulator per instance; fresh processes per run; the process set-up
is ``policies_gateway.py``'s). Runs:

- **rate ∞**: ``--requests`` streamed ShareGPT-like requests at t = 0 (``max_tokens`` = the true
  length, ``ignore_eos``), the default policy with the queue on and off, and the paper's scheduler
  (``workload_minmax``) without it; then the default with and without the queue with nothing known
  (the emulators serve ``house-llm``, which no catalog entry matches, and the config names no GPU or
  TP: the neutral default, learning on); throughput against the simulator's capacity bound for the
  same requests (Σ standalone, ``single`` policy). The "known" runs name GPU and TP, so the router
  starts from the catalog's roofline prior, which at ``--speedup`` k is k× too slow until learning
  corrects it;
- **1.5× overload** for ``--overload-s`` model seconds with two classes (20 % interactive, header
  ``x-hetroute-priority``) and two tenants (``x-hetroute-tenant`` a/b, weights 3:1), queue on and
  off: interactive p99 TTFT against an unloaded run (0.3×), batch max wait, tenant shares of
  completed batch tokens, 429s (each with ``Retry-After``), and that every request either
  completed or got a 429.

Times are model seconds (wall × speedup). Caveat: gateway, emulators and client share 2 cores with
other jobs; CPU contention shows up as latency the simulator does not have.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policies_gateway import (  # noqa: E402
    ADMIN_TOKEN,
    HETROUTE,
    MODEL,
    free_port,
    stop_processes,
    wait_ready,
)

from hetroute.sim.emulator_text import filler_prompt  # noqa: E402
from hetroute.sim.workload import SimRequest, generate_workload  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CLASSES = [
    {"name": "interactive", "max_queue_len": 1024, "max_queue_wait_s": 10.0, "placement": "first_token"},
    {"name": "batch", "max_queue_len": 4096, "max_queue_wait_s": 30.0, "ageing_s": 5.0},
]


UNKNOWN_MODEL = "house-llm"
"""The served-model name of the "nothing known" runs: no catalog entry matches it."""


async def one(
    session: aiohttp.ClientSession,
    url: str,
    req: SimRequest,
    headers: dict[str, str],
    start: float,
    k: float,
    model: str = MODEL,
    stream: bool = True,
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start + req.arrival_s / k - time.monotonic()))
    sent = time.monotonic()
    body = {
        "model": model,
        "prompt": filler_prompt(req.input_tokens, req.request_id),  # no shared prefix
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    first = math.nan
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=900)
        ) as r:
            if r.status != 200:
                raw = await r.read()
                code = json.loads(raw).get("error", {}).get("code") if r.status == 429 else None
                return {
                    "status": r.status,
                    "code": code,
                    "retry_after": r.headers.get("Retry-After"),
                    "wait_s": (time.monotonic() - sent) * k,
                }
            async for _ in r.content.iter_any():
                if math.isnan(first) and stream:
                    first = time.monotonic()
    except (TimeoutError, aiohttp.ClientError) as exc:
        return {"status": -1, "error": type(exc).__name__}
    return {"status": 200, "ttft_s": (first - sent) * k, "end_s": (time.monotonic() - start) * k}


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *HETROUTE, *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )


async def _start_stack(
    procs: list[asyncio.subprocess.Process],
    policy: str,
    admission: dict[str, Any],
    k: float,
    known: bool,
    scenario: str = "paper-a",
) -> tuple[list[dict[str, Any]], int]:
    """Start one emulator per backend of ``scenario`` and the gateway (appended to ``procs``);
    (backends, gateway port). ``known``: the config names each backend's GPU and TP (the catalog's
    roofline prior); otherwise the emulators serve :data:`UNKNOWN_MODEL` and the config names
    nothing (the neutral default)."""
    backends: list[dict[str, Any]] = []
    for b in fleet_of(scenario).backends:
        port = free_port()
        model = b.models[0]
        served = [] if known else ["--served-model-name", UNKNOWN_MODEL]
        procs.append(
            await _spawn("emulate", "--gpu", str(b.gpu), "--model", model, "--tp", str(b.tp), "--port",
                         str(port), "--speedup", str(k), "--seed", "1", *served)
        )  # fmt: skip
        entry: dict[str, Any] = {"name": b.name, "url": f"http://127.0.0.1:{port}", "engine": "vllm"}
        entry.update({"models": [model], "gpu": b.gpu, "tp": b.tp} if known else {"models": [UNKNOWN_MODEL]})
        backends.append(entry)
    gw_port = free_port()
    config = {
        "seed": 1,
        "admin_token": ADMIN_TOKEN,
        "policy": {"type": policy},
        "backends": backends,
        # every rate-∞ request is one client connection (and, pushed, one to an engine)
        "server": {"host": "127.0.0.1", "port": gw_port, "access_log": False, "max_connections": 65536},
        "scrape": {"interval_s": max(0.05, 1.0 / k)},
        "admission": admission,
    }
    cfg = Path(tempfile.mkdtemp(prefix="hetroute-adm-")) / "router.yaml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    procs.append(await _spawn("serve", "--config", str(cfg), "--log-level", "WARNING"))
    return backends, gw_port


async def run(
    label: str,
    policy: str,
    admission: dict[str, Any],
    work: Sequence[SimRequest],
    heads: Sequence[dict[str, str]],
    k: float,
    known: bool = True,
    scenario: str = "paper-a",
    stream: bool = True,
    client_connections: int = 0,
) -> dict[str, Any]:
    """Replay ``work`` (with ``heads``) through fresh processes; per-request results and the
    gateway's ledger and queue after the run. ``client_connections`` > 0 caps the client's open
    connections (the rest wait in the client); 0: one connection per request."""
    procs: list[asyncio.subprocess.Process] = []
    model = fleet_of(scenario).backends[0].models[0] if known else UNKNOWN_MODEL
    try:
        backends, gw_port = await _start_stack(procs, policy, admission, k, known, scenario)
        connector = aiohttp.TCPConnector(limit=client_connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            for b in backends:
                await wait_ready(session, f"{b['url']}/health")
            base = f"http://127.0.0.1:{gw_port}"
            await wait_ready(session, f"{base}/v1/models")
            start = time.monotonic()
            url = f"{base}/v1/completions"
            out = await asyncio.gather(
                *(one(session, url, r, h, start, k, model, stream) for r, h in zip(work, heads, strict=True))
            )
            auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            async with session.get(f"{base}/admin/backends", headers=auth) as r:
                admin = await r.json()
            async with session.get(f"{base}/metrics") as r:
                metrics = await r.text()
        queued = [line for line in metrics.splitlines() if line.startswith("hetroute_queue_length{")]
        return {
            "label": label,
            "results": out,
            "in_flight_after": admin["in_flight"],
            "queue_length_after": sum(float(line.split()[-1]) for line in queued),
        }
    finally:
        await stop_processes(procs)


def fleet_of(scenario: str) -> Any:
    """The simulator's fleet of ``scenario`` (the emulators' GPUs, models and TPs)."""
    from hetroute.sim.cluster_file import build_fleet
    from hetroute.sim.scenarios import get_scenario

    return build_fleet(get_scenario(scenario).cluster())


def sim_bound(work: Sequence[SimRequest], scenario: str = "paper-a") -> float:
    """Σ standalone throughput of each instance of ``scenario`` on these requests (the simulator's
    bound)."""
    from hetroute.simulation.simulator import run_simulation

    fleet = fleet_of(scenario)
    return sum(  # ``work`` is at rate ∞ (every arrival at 0)
        run_simulation(fleet, work, "single", {"backend": b.name}, seed=1).throughput_tokens_per_s
        for b in fleet.backends
    )


def summarise(
    row: dict[str, Any], work: Sequence[SimRequest], heads: Sequence[dict[str, str]], horizon_s: float = 0.0
) -> dict[str, Any]:
    res = row.pop("results")
    ok = [i for i, r in enumerate(res) if r["status"] == 200]
    shed = [i for i, r in enumerate(res) if r["status"] == 429]
    other = [r for r in res if r["status"] not in (200, 429)]
    row["other_statuses"] = {
        str(st): sum(1 for r in other if r["status"] == st) for st in {r["status"] for r in other}
    }
    tokens = sum(work[i].input_tokens + work[i].output_tokens for i in ok)
    makespan = max((res[i]["end_s"] for i in ok), default=math.nan)
    out = {
        **row,
        "sent": len(res),
        "completed": len(ok),
        "shed_429": len(shed),
        "other": len(other),
        "retry_after_on_every_429": all(res[i]["retry_after"] for i in shed),
        "throughput_tokens_s": tokens / makespan if ok else math.nan,
    }
    inter = [i for i in ok if heads[i].get("x-hetroute-priority") == "interactive"]
    batch = [i for i in ok if heads[i].get("x-hetroute-priority") != "interactive"]
    for name, idx in (("interactive", inter), ("batch", batch), ("all", ok)):
        t = np.array([res[i]["ttft_s"] for i in idx])
        out[f"{name}_ttft_p99_s"] = float(np.percentile(t, 99)) if t.size else math.nan
    out["batch_max_wait_s"] = max(
        [res[i]["ttft_s"] for i in batch] + [res[i]["wait_s"] for i in shed], default=0.0
    )
    # shares of batch tokens dispatched (≈ arrival + TTFT) while both tenants were backlogged:
    # from a quarter of the overload window to its end, as in benchmarks/admission.py
    window = [i for i in batch if 0.25 * horizon_s <= work[i].arrival_s + res[i]["ttft_s"] <= horizon_s]
    a = sum(
        work[i].input_tokens + work[i].output_tokens
        for i in window
        if heads[i].get("x-hetroute-tenant") == "a"
    )
    b = sum(
        work[i].input_tokens + work[i].output_tokens
        for i in window
        if heads[i].get("x-hetroute-tenant") == "b"
    )
    out["shed_by_code"] = {
        c: sum(1 for i in shed if res[i]["code"] == c) for c in ("queue_full", "wait_timeout")
    }
    out["tenant_a_share"] = a / (a + b) if a + b else math.nan
    return out


OFF: dict[str, Any] = {"enabled": False}


def _inf_rows(args: argparse.Namespace, full: dict[str, float]) -> list[dict[str, Any]]:
    work = generate_workload("sharegpt", args.requests, math.inf, args.seed, 2048, send_max_tokens=True)
    bound = sim_bound(work, args.scenario)  # the bound of exactly these requests
    none: list[dict[str, str]] = [{} for _ in work]
    # one class, unbounded (as in the simulator's rate-∞ runs): a 429 would take requests out of the
    # throughput instead of measuring it
    queue = {"classes": [{"name": "default", "max_queue_len": 10**6, "max_queue_wait_s": 1e6}], "full": full}
    runs = [
        ("default + queue", "default", queue, True),
        ("default", "default", OFF, True),
        ("paper (workload_minmax)", "workload_minmax", OFF, True),
        ("default + queue, nothing known", "default", queue, False),
        ("default, nothing known", "default", OFF, False),
    ]
    if args.inf_runs:
        wanted = set(args.inf_runs.split(";"))
        runs = [r for r in runs if r[0] in wanted]
    rows = []
    for label, policy, adm, known in runs:
        sim = sim_run(work, args.scenario, policy, adm, known, args.stream, args.client_connections)
        if args.sim_only:
            row: dict[str, Any] = {"label": label, "throughput_tokens_s": math.nan}
        else:
            result = asyncio.run(
                run(
                    label,
                    policy,
                    adm,
                    work,
                    none,
                    args.speedup,
                    known,
                    args.scenario,
                    args.stream,
                    args.client_connections,
                )
            )
            row = summarise(result, work, none)
        row.update(kind="inf", bound_tokens_s=bound, pct_bound=100 * row["throughput_tokens_s"] / bound)
        row.update(sim_tokens_s=sim, sim_pct_bound=100 * sim / bound)
        rows.append(row)
        print(
            f"inf {label:32s} {row['throughput_tokens_s']:8.0f} tok/s ({row['pct_bound']:.1f} % of "
            f"{bound:.0f}; simulator {row['sim_pct_bound']:.1f} %)",
            flush=True,
        )
    return rows


def sim_run(
    work: Sequence[SimRequest],
    scenario: str,
    policy: str,
    admission: dict[str, Any],
    known: bool,
    stream: bool = True,
    client_connections: int = 0,
) -> float:
    """The simulator's throughput for the same requests and the same router set-up: the fleet with
    its GPUs and TPs named (``known``) or stripped of them, learning on (the gateway's default);
    ``stream`` False: non-streaming clients (the router sees each answer only whole);
    ``client_connections``: the client's connection pool, as in the gateway run (0: none)."""
    from hetroute.admission.config import parse_admission
    from hetroute.learning.settings import LearningConfig
    from hetroute.sim.cluster_file import blind_fleet
    from hetroute.simulation.admission_run import SimAdmission
    from hetroute.simulation.simulator import run_simulation

    fleet = fleet_of(scenario) if known else blind_fleet(fleet_of(scenario), keep_kv_capacity=False)
    if not stream:
        work = [replace(r, stream=False) for r in work]
    adm = SimAdmission(parse_admission(admission)) if admission.get("enabled", True) else None
    logging.disable(logging.WARNING)  # the simulated router's drift notices are not this benchmark's output
    try:
        r = run_simulation(
            fleet,
            work,
            policy,
            seed=1,
            admission=adm,
            learning=LearningConfig(),
            client_connections=client_connections,
        )
    finally:
        logging.disable(logging.NOTSET)
    return float(r.throughput_tokens_per_s)


def _overload_rows(args: argparse.Namespace, full: dict[str, float]) -> list[dict[str, Any]]:
    # steady-state capacity from 4,000 requests (400 have a heavy drain tail that understates it)
    big = generate_workload("sharegpt", 4000, math.inf, args.seed, 2048)
    cap_rps = sim_bound(big, args.scenario) / float(np.mean([r.input_tokens + r.output_tokens for r in big]))
    rng = np.random.default_rng(args.seed + 1000)
    rows = []
    for kind, mult in (("unloaded", 0.3), ("overload", 1.5)):
        n = int(mult * cap_rps * args.overload_s)
        w = generate_workload("sharegpt", n, mult * cap_rps, args.seed, 2048, send_max_tokens=True)
        heads = [
            {
                "x-hetroute-priority": "interactive" if rng.random() < 0.2 else "batch",
                "x-hetroute-tenant": "a" if rng.random() < 0.5 else "b",
            }
            for _ in w
        ]
        adm = {"classes": CLASSES, "tenants": {"a": 3, "b": 1}, "full": full}
        runs = [("default + queue", adm)] + ([("default", OFF)] if kind == "overload" else [])
        for label, a in runs:
            result = asyncio.run(
                run(label, "default", a, w, heads, args.overload_speedup, scenario=args.scenario)
            )
            row = summarise(result, w, heads, args.overload_s)
            row.update(kind=kind, rate_rps=mult * cap_rps)
            rows.append(row)
            print(
                f"{kind} {label:20s} int p99 TTFT {row['interactive_ttft_p99_s']:.2f} s, batch max wait "
                f"{row['batch_max_wait_s']:.1f} s, share a {row['tenant_a_share']:.3f}, "
                f"429 {row['shed_429']}, done {row['completed']}/{row['sent']}, other {row['other']}",
                flush=True,
            )
    return rows


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], elapsed_s: float) -> str:
    doc = {
        "benchmark": "admission_gateway",
        "args": {k: str(v) for k, v in vars(args).items()},
        "load_average": os.getloadavg(),
        "elapsed_s": elapsed_s,
        "machine": platform.platform(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1, default=str).replace("NaN", "null")
    (args.out / f"{args.name}.json").write_text(text + "\n", encoding="utf-8")
    md = markdown(args, rows, elapsed_s)
    (args.out / f"{args.name}.md").write_text(md, encoding="utf-8")
    return md


def markdown(args: argparse.Namespace, rows: list[dict[str, Any]], elapsed_s: float) -> str:
    """The results table of one invocation (what ran, then one row per run)."""
    runs = []
    stream = "streamed" if args.stream else "non-streamed"
    if not args.skip_inf and args.sim_only:
        runs.append(
            f"rate ∞ on {args.scenario}: {args.requests} {stream} requests, simulator only (no processes)"
        )
    elif not args.skip_inf:
        runs.append(f"rate ∞ on {args.scenario}: {args.requests} {stream} requests, speedup {args.speedup:g}")
    if not args.skip_inf and args.client_connections:
        runs.append(
            f"the client holds at most {args.client_connections} connections open (the rest wait in it)"
        )
    if not args.skip_overload:
        runs.append(
            f"overload on {args.scenario}: 1.5× capacity for {args.overload_s:g} model s, speedup "
            f"{args.overload_speedup:g}"
        )
    lines = [
        "# Admission control through the gateway (emulators)",
        "",
        f"{'; '.join(runs)}; {elapsed_s:.0f} s wall.",
        "",
        "| run | policy | tok/s | % bound | simulator % bound | int. p99 TTFT s | batch max wait s "
        "| share a (0.75) | 429 | done/sent | other | ledger, queue after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g = {k: r.get(k, math.nan) for k in ("interactive_ttft_p99_s", "batch_max_wait_s", "tenant_a_share")}
        g.update({k: r.get(k, "-") for k in ("shed_429", "completed", "sent", "other", "in_flight_after")})
        lines.append(
            f"| {r['kind']} | {r['label']} | {r['throughput_tokens_s']:.0f} | "
            f"{r.get('pct_bound', math.nan):.1f} | {r.get('sim_pct_bound', math.nan):.1f} | "
            f"{g['interactive_ttft_p99_s']:.2f} | {g['batch_max_wait_s']:.1f} | {g['tenant_a_share']:.3f} | "
            f"{g['shed_429']} | {g['completed']}/{g['sent']} | {g['other']} | {g['in_flight_after']}, "
            f"{r.get('queue_length_after', math.nan):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--speedup", type=float, default=2.0, help="emulator speed-up for the rate-∞ runs")
    ap.add_argument("--overload-speedup", type=float, default=0.5, help="(< 1 slows the emulators: less CPU)")
    ap.add_argument("--overload-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--full", default="", help="admission.full overrides: seqs_high_water_frac=1.1,...")
    ap.add_argument("--skip-overload", action="store_true")
    ap.add_argument("--skip-inf", action="store_true")
    ap.add_argument("--scenario", default="paper-a", help="the fleet: paper-a, paper-b or mixed")
    ap.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="rate-∞ runs: non-streaming requests (in the simulator's column too)",
    )
    ap.add_argument(
        "--sim-only", action="store_true", help="rate-∞ runs: only the simulator's figures (no processes)"
    )
    ap.add_argument(
        "--client-connections",
        type=int,
        default=0,
        help="rate-∞ runs: at most this many open client connections, the rest wait in the client "
        "(0: one per request; a 20,000-request run needs a cap below the open-file limit); the "
        "simulator's column models the same client",
    )
    ap.add_argument("--inf-runs", default="", help="only these rate-∞ runs (labels, separated by ;)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="admission_gateway", help="results file stem (.json and .md)")
    args = ap.parse_args(argv)
    full = {k: float(v) for k, v in (kv.split("=") for kv in args.full.split(",") if kv)}
    started = time.perf_counter()
    rows = [] if args.skip_inf else _inf_rows(args, full)
    rows += [] if args.skip_overload else _overload_rows(args, full)
    print(_write(args, rows, time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
