"""Router replicas through real gateways: R ``hetroute serve`` processes in front of the same
``hetroute emulate`` servers, the client spreading requests round robin across them.

Usage: ``python benchmarks/replicas_gateway.py [--requests 400] [--rates 24,inf] [--replicas 1,2,4]
[--modes off,scaled_excess] [--speedup 2] [--seeds 1] [--out benchmarks/results] [--tag T]``.
Writes ``replicas_gateway.json`` and ``replicas_gateway.md`` (``replicas_gateway_peer_hint.*`` with
``--peer-hint``, ``replicas_gateway_peers.*`` with ``--peers``, ``replicas_gateway_peers_hint.*`` with
both).

The workload and client are ``policies_gateway.py``'s (a seeded ShareGPT-like workload replayed
open-loop at ``--speedup``); ``--scenarios`` picks the fleets (one ``hetroute emulate`` per instance of
the simulator's scenario: paper-a, Llama-3-8B on V100 TP4 and TP1; paper-b, a 14B model on four V100
TP2 and one A800; mixed, Llama-3-8B on H100, 2 A100, 2 L4 and a T4 TP2). ``--known``: ``prior``, the
gateways' config names each backend's GPU and TP (the catalog's roofline prior); ``nothing``, the
emulators serve an uncatalogued model name and the config names no GPU or TP (the neutral default,
live learning on as by default). Every gateway runs the
``default`` policy with the given ``scrape.foreign_load`` mode (``server.replicas`` left at 1, the
default a user gets; ``--peer-hint`` sets it to R) and scrapes every ``1 / speedup`` s.
With ``--peers`` the gateways also exchange summaries over UDP on 127.0.0.1 (``peers``,
``interval_s`` = ``--peer-interval`` (default 0.005) / speedup, a shared ``HETROUTE_PEER_KEY``;
``--no-peer-mirror`` sets ``peers.mirror`` false and adds ``_nomirror`` to the file names).
Request k goes to gateway k mod R. Reported: throughput and p99 TTFT (model seconds), and their ratios
to one gateway at the same rate and seed (issue 14's bars: ≥ 0.97 and ≤ 1.2). With several ``--seeds``
(workloads; ``1-6`` is a range) every seed runs every R, the order of R alternating from seed to seed,
and the ratios are also given as mean ± standard error over the seeds: a 400-request burst at rate ∞
ends when its last long answers do, so one workload's ratio moves by several per cent from run to run.

Each run also records the backend each request was sent to (``x-hetroute-backend``; counted over the
completed requests, the run's requests per backend) and replays that
dispatch through the engine model of each instance with nothing else running (``replay``): the
"replayed" throughput is what the dispatch itself gives, so a ratio that moves with this machine's load
can be told from one the routing caused. ``--pool A.json B.json ...`` runs nothing and writes the
per-cell table over the runs of several result files (``replicas_gateway_pooled[_TAG].md``), each run
compared with the one-gateway run of its own file and seed.

Caveat: on a 2-core machine the gateways, both emulators and this client share the CPU, and more
gateways mean more processes competing for it: say so with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from admission_gateway import UNKNOWN_MODEL, fleet_of  # noqa: E402
from policies_gateway import (  # noqa: E402
    HETROUTE,
    MODEL,
    free_port,
    one_request,
    stop_processes,
    summarise,
    wait_ready,
)
from replicas import parse_seeds  # noqa: E402

from hetroute.sim.workload import SimRequest, generate_workload  # noqa: E402
from profiling.emulated import emulated_engine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
THROUGHPUT_BAR = 0.97
P99_BAR = 1.2


async def _spawn(*cmd: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=env
    )


def _udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def fleet_instances(scenario: str) -> list[tuple[str, str, str, int]]:
    """(name, GPU, model, TP) of every instance of the simulator's ``scenario``."""
    return [(b.name, str(b.gpu), b.models[0], int(b.tp or 1)) for b in fleet_of(scenario).backends]


def replay(scenario: str, work: Sequence[SimRequest], routed: Mapping[str, str]) -> dict[str, float]:
    """The engines' own model run on the gateways' actual dispatch, with nothing else: each instance of
    ``scenario`` a fresh engine model as ``hetroute emulate`` builds it, given the requests ``routed`` to
    it (request id -> backend name) at their arrival times in workload order and stepped until done (no
    router, HTTP or CPU). Returns throughput ((I + O) / makespan) and p99 TTFT in model seconds, as
    :func:`summarise` computes them: how good the dispatch was, apart from what this machine's shared
    cores did to the emulators' pace."""
    ttft: dict[str, float] = {}
    end: dict[str, float] = {}
    for name, gpu, model, tp in fleet_instances(scenario):
        engine = emulated_engine(gpu, model, tp)
        queue = deque(
            sorted((r for r in work if routed.get(r.request_id) == name), key=lambda r: r.arrival_s)
        )
        arrival = {r.request_id: r.arrival_s for r in queue}
        now = 0.0
        while queue or engine.has_work():
            while queue and queue[0].arrival_s <= now:
                r = queue.popleft()
                engine.submit(r.request_id, r.input_tokens, r.output_tokens, now)
            if not engine.has_work():
                now = queue[0].arrival_s
                continue
            step = engine.step(now)
            if step.duration_s <= 0 and not step.emitted and not step.finished:
                if not queue:
                    raise RuntimeError(f"{name}: the engine model holds requests it never schedules")
                now = max(now, queue[0].arrival_s)
                continue
            now += step.duration_s
            for event in step.emitted:
                if event.first:
                    ttft[event.request_id] = now - arrival[event.request_id]
            for rid in step.finished:
                end[rid] = now
    done = [r for r in work if r.request_id in end]
    if not done:
        return {"throughput_tokens_s": math.nan, "ttft_p99_s": math.nan}
    tokens = sum(r.input_tokens + r.output_tokens for r in done)
    return {
        "throughput_tokens_s": tokens / max(end.values()),
        "ttft_p99_s": float(np.percentile([ttft[r.request_id] for r in done], 99)),
    }


async def run_one(
    scenario: str, known: str, replicas: int, mode: str, rate: float, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One run: fresh emulators and ``replicas`` gateways; the workload spread round robin."""
    procs: list[asyncio.subprocess.Process] = []
    tmp = Path(tempfile.mkdtemp(prefix="hetroute-replicas-"))
    try:
        backends = []
        served = MODEL
        for name, gpu, model, tp in fleet_instances(scenario):
            port = free_port()
            served = model if known == "prior" else UNKNOWN_MODEL
            rename = [] if known == "prior" else ["--served-model-name", UNKNOWN_MODEL]
            procs.append(
                await _spawn(*HETROUTE, "emulate", "--gpu", gpu, "--model", model, "--tp", str(tp),
                             "--port", str(port), "--speedup", str(args.speedup), "--seed", "1", *rename)
            )  # fmt: skip
            entry: dict[str, Any] = {"name": name, "url": f"http://127.0.0.1:{port}", "engine": "vllm"}
            entry["models"] = [served]
            if known == "prior":
                entry.update(gpu=gpu, tp=tp)
            backends.append(entry)
        gateways = []
        udp = [_udp_port() for _ in range(replicas)]
        env = {**os.environ, "HETROUTE_PEER_KEY": "replicas-gateway-benchmark"}
        for r in range(replicas):
            port = free_port()
            config: dict[str, Any] = {
                "seed": 1 + r,
                "server": {
                    "host": "127.0.0.1",
                    "port": port,
                    "access_log": False,
                    "replicas": replicas if args.peer_hint else 1,
                },
                "policy": {"type": "default"},
                "scrape": {"interval_s": max(0.05, 1.0 / args.speedup), "foreign_load": mode},
                "backends": backends,
            }
            if args.peers and replicas > 1:
                config["peers"] = {
                    "addresses": [f"127.0.0.1:{p}" for p in udp],
                    "listen_host": "127.0.0.1",
                    "listen_port": udp[r],
                    "interval_s": args.peer_interval / args.speedup,
                    "stale_after_s": 0.25 / args.speedup,
                    "mirror": not args.no_peer_mirror,
                }
            path = tmp / f"router{r}.yaml"
            path.write_text(yaml.safe_dump(config), encoding="utf-8")
            serve = (*HETROUTE, "serve", "--config", str(path), "--log-level", "WARNING")
            procs.append(await _spawn(*serve, env=env))
            gateways.append(f"http://127.0.0.1:{port}")
        work = generate_workload("sharegpt", args.requests, rate, seed, 2048)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for b in backends:
                await wait_ready(session, f"{b['url']}/health")
            for g in gateways:
                await wait_ready(session, f"{g}/ready")  # a gateway's own route, which emulators lack
            start = time.monotonic()
            routed: dict[str, str] = {}
            out = await asyncio.gather(
                *(
                    one_request(
                        session,
                        f"{gateways[k % replicas]}/v1/completions",
                        req,
                        start,
                        args.speedup,
                        served,
                        routed,
                    )
                    for k, req in enumerate(work)
                )
            )
        summary = summarise(work, out)
        done = [r for r, o in zip(work, out, strict=True) if o[2]]
        split = Counter(routed[r.request_id] for r in done)
        if "" in split:  # answered by something other than a gateway: the run measures nothing
            raise RuntimeError(f"{split['']} requests answered without x-hetroute-backend")
        return {
            "scenario": scenario,
            "known": known,
            "replicas": replicas,
            "mode": mode,
            "rate": "inf" if math.isinf(rate) else f"{rate:g}",
            "seed": seed,
            **{k: summary[k] for k in ("completed", "failed", "throughput_tokens_s", "ttft_p99_s")},
            "requests_by_backend": dict(sorted(split.items())),
            "replayed": replay(scenario, done, routed),
        }
    finally:
        await stop_processes(procs)


def _cell(row: dict[str, Any]) -> tuple[str, str, str]:
    return row.get("scenario", "paper-a"), row.get("known", "prior"), row["rate"]


def _one(rows: Sequence[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    """The one-gateway run of ``row``'s scenario, starting point, rate and seed (in the same file when
    ``--pool`` gathered several: its ``batch``)."""
    return next(
        r
        for r in rows
        if _cell(r) == _cell(row)
        and r["seed"] == row["seed"]
        and r["replicas"] == 1
        and r.get("batch", 0) == row.get("batch", 0)
    )


def markdown(rows: Sequence[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> str:
    seeds = ", ".join(str(s) for s in args.seeds)
    lines = [
        f"# Router replicas through real gateways ({', '.join(args.scenarios)}; {args.requests} requests, "
        f"speedup {args.speedup:g}, seed{'s' if len(args.seeds) > 1 else ''} {seeds})",
        "",
        f"{platform.machine()}, {os.cpu_count()} cores, no GPU; {wall_s:.0f} s. Ratios to one gateway on the "
        "same fleet, starting point, rate and seed (bars: throughput ≥ 0.97, p99 TTFT ≤ 1.2). `prior`: "
        "the config names each backend's GPU and TP; `nothing`: an uncatalogued model name, no GPU or TP, "
        "live learning on. Every gateway, the emulators and the client share this machine's cores.",
        "",
        f"Peers exchanging summaries: {'yes' if args.peers else 'no'}"
        f"{' (mirror off)' if args.peers and args.no_peer_mirror else ''}.",
        "",
        "| scenario | known | rate | seed | R | foreign_load | throughput tok/s | × one | p99 TTFT s | × one "
        "| failed | requests per backend | replayed tok/s | × one |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        one = _one(rows, row)
        scenario, known, rate = _cell(row)
        lines.append(
            f"| {scenario} | {known} | {rate} | {row['seed']} | {row['replicas']} | {row['mode']} "
            f"| {row['throughput_tokens_s']:.0f} | "
            f"{row['throughput_tokens_s'] / one['throughput_tokens_s']:.3f} | {row['ttft_p99_s']:.2f} | "
            f"{row['ttft_p99_s'] / one['ttft_p99_s']:.2f} | {row['failed']} "
            f"| {', '.join(f'{b} {n}' for b, n in row.get('requests_by_backend', {}).items())} "
            f"| {_replayed(row):.0f} | {_replayed(row) / _replayed(one):.3f} |"
        )
    lines += ["", *cell_table(rows)]
    return "\n".join(lines) + "\n"


def cell_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per cell (fleet, starting point, rate, R, mode): the per-seed ratios to one gateway over the
    runs in ``rows``, as mean ± standard error and min–max, and whether the means meet the bars."""
    lines = [
        "Per cell over the seeds (per-seed ratios to one gateway: mean ± standard error, min–max; "
        "✗ where a mean misses a bar):",
        "",
        "| scenario | known | rate | R | foreign_load | seeds | throughput × one | min–max | p99 TTFT × one "
        "| min–max | replayed throughput × one |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = dict.fromkeys((*_cell(r), r["replicas"], r["mode"]) for r in rows if r["replicas"] > 1)
    met = 0
    for scenario, known, rate, replicas, mode in keys:
        mine = [
            r
            for r in rows
            if (*_cell(r), r["replicas"], r["mode"]) == (scenario, known, rate, replicas, mode)
        ]
        thr = [r["throughput_tokens_s"] / _one(rows, r)["throughput_tokens_s"] for r in mine]
        p99 = [r["ttft_p99_s"] / _one(rows, r)["ttft_p99_s"] for r in mine]
        replayed = [x for r in mine if math.isfinite(x := _replayed(r) / _replayed(_one(rows, r)))]
        ok = statistics.mean(thr) >= THROUGHPUT_BAR and statistics.mean(p99) <= P99_BAR
        met += ok
        lines.append(
            f"| {scenario} | {known} | {rate} | {replicas} | {mode} | {len(mine)} | {_mean_se(thr)} "
            f"| {min(thr):.3f}–{max(thr):.3f} | {_mean_se(p99)} | {min(p99):.2f}–{max(p99):.2f}"
            f"{'' if ok else ' ✗'} | {_mean_se(replayed) if replayed else 'not recorded'}"
            f"{f' ({len(replayed)} runs)' if replayed and len(replayed) < len(mine) else ''} |"
        )
    failed = sum(r["failed"] for r in rows)
    lines += [
        "",
        f"- {met}/{len(keys)} cells meet both bars; {failed} requests failed in all.",
        "- Replayed: the engine model of each instance run on the requests the gateways sent it, with "
        "nothing else (`replay`): the throughput the dispatch itself gives, apart from this machine's "
        "shared cores (files written before it was recorded have none).",
    ]
    return lines


def pooled(paths: Sequence[Path]) -> str:
    """``cell_table`` over the runs of several result files (``--pool``), each file's runs compared
    with its own one-gateway runs."""
    rows: list[dict[str, Any]] = []
    lines = ["# Router replicas through real gateways: runs pooled over several files", ""]
    for k, path in enumerate(paths):
        doc = json.loads(path.read_text(encoding="utf-8"))
        a = doc["args"]
        lines.append(
            f"- `{path.name}`: {len(doc['results'])} runs; {', '.join(a['scenarios'])}, rates {a['rates']}, "
            f"seeds {a['seeds']}, speedup {a['speedup']:g}, peers {'on' if a['peers'] else 'off'}"
        )
        rows += [r | {"batch": k} for r in doc["results"]]
    return "\n".join([*lines, "", *cell_table(rows)]) + "\n"


def _replayed(row: Mapping[str, Any]) -> float:
    return float(row.get("replayed", {}).get("throughput_tokens_s", math.nan))


def _mean_se(values: Sequence[float]) -> str:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {se:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--scenarios", default="paper-a", help="fleets: paper-a, paper-b, mixed (default: paper-a)"
    )
    ap.add_argument("--known", default="prior", help="starting points: prior, nothing (default: prior)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rates", default="24,inf")
    ap.add_argument("--replicas", default="1,2,4")
    ap.add_argument("--peer-hint", action="store_true", help="set server.replicas = R in every gateway")
    ap.add_argument("--peers", action="store_true", help="the gateways exchange summaries (peers)")
    ap.add_argument(
        "--peer-interval", type=float, default=0.005, help="with --peers: peers.interval_s in model seconds"
    )
    ap.add_argument(
        "--no-peer-mirror",
        action="store_true",
        help="with --peers: peers.mirror false (no mirroring of own changes between summaries); "
        "the files get _nomirror",
    )
    ap.add_argument("--modes", default="off,scaled_excess")
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument(
        "--seeds", type=parse_seeds, default="1", help="workload seeds: 1,2,3 or a range 1-6 (default: 1)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", default="", help="appended to the output files' stem")
    ap.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="run nothing: the per-cell table over the runs of these result files, each run compared "
        "with the one-gateway run of its own file and seed; written to --out as "
        "replicas_gateway_pooled[_TAG].md",
    )
    args = ap.parse_args(argv)
    if args.pool:
        text = pooled(args.pool)
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"replicas_gateway_pooled{'_' + args.tag if args.tag else ''}.md").write_text(text)
        return 0
    args.scenarios = args.scenarios.split(",")
    args.known = args.known.split(",")
    if bad := [k for k in args.known if k not in ("prior", "nothing")]:
        raise SystemExit(f"--known: {bad[0]!r} is neither prior nor nothing")
    for scenario in args.scenarios:
        fleet_instances(scenario)  # an unknown scenario fails here, before anything starts
    rates = [math.inf if r == "inf" else float(r) for r in args.rates.split(",")]
    counts = [int(r) for r in args.replicas.split(",")]
    if 1 not in counts:
        raise SystemExit("--replicas must include 1 (the reference)")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    stem = "replicas_gateway_peer_hint" if args.peer_hint else "replicas_gateway"
    if args.peers:
        stem = "replicas_gateway_peers_hint" if args.peer_hint else "replicas_gateway_peers"
        if args.no_peer_mirror:
            stem += "_nomirror"
    if args.tag:
        stem += f"_{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """Every run so far, written after each one: a batch stopped early keeps what it measured."""
        doc = {"benchmark": "replicas_gateway", "args": vars(args) | {"out": str(args.out)}, "results": rows}
        (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")

    cells = [(s, k, r) for s in args.scenarios for k in args.known for r in rates]
    for scenario, known, rate in cells:
        for k, seed in enumerate(args.seeds):
            for replicas in counts if k % 2 == 0 else counts[::-1]:
                for mode in ["off"] if replicas == 1 else args.modes.split(","):
                    row = asyncio.run(run_one(scenario, known, replicas, mode, rate, seed, args))
                    rows.append(row)
                    save()
                    print(
                        f"{scenario} {known} {row['rate']:>4} seed {seed} R={replicas} {mode:14s} "
                        f"{row['throughput_tokens_s']:8.0f} tok/s  p99 TTFT {row['ttft_p99_s']:.2f} s  "
                        f"(replayed {row['replayed']['throughput_tokens_s']:.0f} tok/s, "
                        f"p99 TTFT {row['replayed']['ttft_p99_s']:.2f} s)  failed {row['failed']}",
                        flush=True,
                    )
    wall_s = time.perf_counter() - started
    text = markdown(rows, args, wall_s)
    print(text)
    (args.out / f"{stem}.md").write_text(text)  # the JSON was written after the last run
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
