"""Router overhead on loopback: hetroute vs a bare aiohttp reverse proxy vs direct.

Usage: ``python benchmarks/overhead.py [--quick]``. Writes ``benchmarks/results/overhead.json``.

Processes (two cores): the proxy under test (hetroute via ``hetroute serve``, or the bare
proxy below) runs alone on core 0 (``os.sched_setaffinity``); the instant fake backend and
this load generator share core 1. Measured per proxy, with the same load:

- added latency p50/p99 of a non-streaming request at concurrency 1 and 64
  (proxied − direct);
- requests/s at concurrency 64 and the proxy's CPU time per request (utime+stime of the
  proxy process from /proc, divided by requests);
- streaming: relayed SSE events/s and proxy CPU µs per event, once paced (the backend
  sleeps between events, so nearly every chunk holds one event, like a real engine) and
  once in bursts (events coalesce into large chunks).

The same file provides the fake backend (``--role backend``) and the ~50-line bare proxy
(``--role bare``) so the baseline is measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

HERE = Path(__file__).resolve().parent
MODEL = "bench-model"
EVENT = (
    b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" tok",'
    b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
)
USAGE = b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":%d,"total_tokens":%d}}\n\n'  # noqa: E501


# ------------------------------------------------------------------ fake backend


async def _backend_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response(
            {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
             "choices": [{"index": 0, "text": " hello", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}}
        )  # fmt: skip
    n = int(body.get("max_tokens") or 16)
    gap_s = float(body.get("bench_gap_s") or 0.0)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(n):
        await resp.write(EVENT)
        if gap_s:
            await asyncio.sleep(gap_s)
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(USAGE % (n, n + 12))
    await resp.write(b"data: [DONE]\n\n")
    return resp


def run_backend(port: int) -> None:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL, "owned_by": "vllm"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    app = web.Application()
    app.router.add_post("/v1/completions", _backend_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=_uvloop())


# ------------------------------------------------------------------ bare proxy (the baseline)


def run_bare_proxy(port: int, upstream: str) -> None:
    hop = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te"}

    async def handle(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with session.request(
            request.method, upstream + request.path, data=await request.read(), headers=headers
        ) as up:
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in hop}
            if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            return web.Response(status=up.status, body=await up.read(), headers=out_headers)

    async def session_ctx(app: web.Application) -> Any:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=_uvloop())


def _uvloop() -> asyncio.AbstractEventLoop:
    import uvloop

    return uvloop.new_event_loop()


# ------------------------------------------------------------------ load generator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_up(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def _load(url: str, concurrency: int, n: int, body: dict[str, Any]) -> tuple[np.ndarray, float, int]:
    """n requests at fixed concurrency: (latencies s, elapsed s, SSE data events received)."""
    payload = json.dumps(body).encode()
    lat: list[float] = []
    events = 0
    todo = iter(range(n))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, headers={"Content-Type": "application/json"}) as s:

        async def worker() -> None:
            nonlocal events
            for _ in todo:
                t0 = time.perf_counter()
                async with s.post(url + "/v1/completions", data=payload) as r:
                    data = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"status {r.status}: {data[:200]!r}")
                lat.append(time.perf_counter() - t0)
                events += data.count(b"data: {")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return np.array(lat), elapsed, events


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q) * 1e6)


async def _measure(target: str, pid: int | None, quick: bool) -> dict[str, Any]:
    scale = 0.25 if quick else 1.0
    ns = {"model": MODEL, "prompt": "hello world, how are you today?", "max_tokens": 16}
    out: dict[str, Any] = {}
    await _load(target, 8, int(400 * scale), ns)  # warm-up (connections, caches)
    for c, n in ((1, int(2000 * scale)), (64, int(10000 * scale))):
        cpu0 = _cpu_s(pid) if pid else 0.0
        lat, elapsed, _ = await _load(target, c, n, ns)
        cpu = (_cpu_s(pid) - cpu0) if pid else None
        out[f"c{c}"] = {
            "requests": n,
            "p50_us": _pct(lat, 50),
            "p99_us": _pct(lat, 99),
            "req_per_s": n / elapsed,
            "proxy_cpu_us_per_request": None if cpu is None else cpu / n * 1e6,
        }
    for mode, gap_s, c, n in (("paced", 0.002, 16, int(400 * scale)), ("burst", 0.0, 16, int(600 * scale))):
        body = {**ns, "stream": True, "max_tokens": 100, "bench_gap_s": gap_s}
        cpu0 = _cpu_s(pid) if pid else 0.0
        lat, elapsed, events = await _load(target, c, n, body)
        cpu = (_cpu_s(pid) - cpu0) if pid else None
        out[f"stream_{mode}"] = {
            "streams": n,
            "events": events,
            "events_per_s": events / elapsed,
            "proxy_cpu_us_per_event": None if cpu is None else cpu / events * 1e6,
            "stream_p50_ms": _pct(lat, 50) / 1e3,
        }
    return out


# `hetroute serve` exactly, without importing the other sub-commands.
_SERVE = (
    "import argparse, sys; from hetroute.commands import serve; p = argparse.ArgumentParser(); "
    "serve.add_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)


def _spawn(args: list[str], core: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.sched_setaffinity(proc.pid, {core})
    return proc


async def main_async(quick: bool) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, load_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {load_core})
    be_port, bare_port, hr_port = _free_port(), _free_port(), _free_port()
    backend = f"http://127.0.0.1:{be_port}"
    procs = [_spawn([sys.executable, __file__, "--role", "backend", "--port", str(be_port)], load_core)]
    results: dict[str, Any] = {}
    try:
        await _wait_up(backend)
        results["direct"] = await _measure(backend, None, quick)
        bare = _spawn(
            [sys.executable, __file__, "--role", "bare", "--port", str(bare_port), "--upstream", backend],
            proxy_core,
        )
        procs.append(bare)
        await _wait_up(f"http://127.0.0.1:{bare_port}")
        results["bare_proxy"] = await _measure(f"http://127.0.0.1:{bare_port}", bare.pid, quick)
        bare.terminate()
        bare.wait(10)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "router.yaml"
            cfg.write_text(
                f"policy: {{type: round_robin}}\nserver: {{host: 127.0.0.1, port: {hr_port}}}\n"
                f"backends:\n  - {{name: fake, url: '{backend}', engine: vllm, models: [{MODEL}]}}\n"
            )
            serve = [sys.executable, "-c", _SERVE, "serve", "--config", str(cfg), "--log-level", "WARNING"]
            hr = _spawn(serve, proxy_core)
            procs.append(hr)
            await _wait_up(f"http://127.0.0.1:{hr_port}")
            results["hetroute"] = await _measure(f"http://127.0.0.1:{hr_port}", hr.pid, quick)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    return results


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    d, b, h = res["direct"], res["bare_proxy"], res["hetroute"]
    summary: dict[str, Any] = {}
    for c in ("c1", "c64"):
        for name, r in (("bare_proxy", b), ("hetroute", h)):
            summary[f"{name}_{c}_added_p50_us"] = r[c]["p50_us"] - d[c]["p50_us"]
            summary[f"{name}_{c}_added_p99_us"] = r[c]["p99_us"] - d[c]["p99_us"]
    summary["cpu_per_request_ratio"] = (
        h["c64"]["proxy_cpu_us_per_request"] / b["c64"]["proxy_cpu_us_per_request"]
    )
    summary["hetroute_cpu_us_per_request"] = h["c64"]["proxy_cpu_us_per_request"]
    summary["hetroute_cpu_us_per_event_paced"] = h["stream_paced"]["proxy_cpu_us_per_event"]
    summary["hetroute_cpu_us_per_event_burst"] = h["stream_burst"]["proxy_cpu_us_per_event"]
    summary["targets"] = {"cpu_ratio_max": 1.25, "cpu_us_per_request_max": 175, "cpu_us_per_event_max": 25}
    return summary


def print_table(res: dict[str, Any], summary: dict[str, Any]) -> None:
    print(f"{'':12} {'c1 p50/p99 µs':>18} {'c64 p50/p99 µs':>18} {'req/s c64':>10} {'CPU µs/req':>10}"
          f" {'ev/s paced':>10} {'µs/ev paced':>11} {'ev/s burst':>10} {'µs/ev burst':>11}")  # fmt: skip
    for name in ("direct", "bare_proxy", "hetroute"):
        r = res[name]

        def f(v: float | None, w: int, p: int = 0) -> str:
            return f"{'-':>{w}}" if v is None else f"{v:>{w}.{p}f}"

        c1, c64, paced, burst = r["c1"], r["c64"], r["stream_paced"], r["stream_burst"]
        print(
            f"{name:12} {c1['p50_us']:>8.0f}/{c1['p99_us']:<9.0f} {c64['p50_us']:>8.0f}/{c64['p99_us']:<9.0f}"
            f" {c64['req_per_s']:>10.0f} {f(c64['proxy_cpu_us_per_request'], 10)}"
            f" {paced['events_per_s']:>10.0f} {f(paced['proxy_cpu_us_per_event'], 11, 1)}"
            f" {burst['events_per_s']:>10.0f} {f(burst['proxy_cpu_us_per_event'], 11, 1)}"
        )
    print(json.dumps(summary, indent=1))


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "aiohttp": aiohttp.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("bench", "backend", "bare"), default="bench")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--upstream", default="")
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--out", default=str(HERE / "results" / "overhead.json"))
    args = ap.parse_args()
    if args.role == "backend":
        run_backend(args.port)
        return 0
    if args.role == "bare":
        run_bare_proxy(args.port, args.upstream)
        return 0
    res = asyncio.run(main_async(args.quick))
    summary = summarise(res)
    print_table(res, summary)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"machine": machine(), "results": res, "summary": summary}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
