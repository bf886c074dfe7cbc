"""Router overhead on loopback: hetroute vs a bare aiohttp reverse proxy vs direct.

Usage: ``python benchmarks/overhead.py [--quick] [--runs N]``. Writes ``benchmarks/results/overhead.json``:
every run's measurements (``runs``, each with the machine's load average before and after it) and the
medians over the runs (``median``; a ratio's median is the median of the per-run ratios, each from one
run's pair of measurements, so that drift in the machine's other load cancels within a pair).

Processes (two cores): the proxy under test (hetroute via ``hetroute serve``, or the bare
proxy below) runs alone on core 0 (``os.sched_setaffinity``); the instant fake backend and
this load generator share core 1. hetroute runs as a user's quick start does, ``hetroute serve --backend
URL`` with every default (the default policy, access log, probes, scraping, live learning, prefix index;
``--ceiling`` below keeps a config file with round robin, as its committed results were measured).
Measured per proxy, with the same load:

- added latency p50/p99 of a non-streaming request at concurrency 1 and 64
  (proxied − direct);
- requests/s at concurrency 64 and the proxy's CPU time per request (utime+stime of the
  proxy process from /proc, divided by requests);
- streaming: relayed SSE events/s and proxy CPU µs per event, once paced (the backend
  sleeps between events, so nearly every chunk holds one event, like a real engine) and
  once in bursts (events coalesce into large chunks).

The same file provides the fake backend (``--role backend``) and the ~50-line bare proxy
(``--role bare``) so the baseline is measured in the same run.

``--workers N`` runs hetroute as ``hetroute serve --workers N``: its CPU is summed over the worker
processes, and with N > 1 worker k is pinned to core k mod (cores) (N processes cannot share one
core meaningfully), so the proxy no longer runs alone; the default output is then
``overhead_w<N>.json``.

``--backends N`` gives hetroute N instant backends (one process each, on the load generator's core)
instead of one, so that every request is a real choice between backends: with a single backend the
default policy only computes the cost it charges (``choose_forced``), with several it scores every
candidate. The direct and bare-proxy measurements still use the first backend; the default output
is then ``overhead_b<N>.json``.

``--ceiling`` measures the request ceiling instead: requests/s at concurrency 64 (non-streaming)
through ``hetroute serve --workers 1`` and ``--workers N`` (default 2), alternating in ``--rounds``
rounds (medians reported) so that drift in the machine's other load hits both alike. Writes
``overhead_workers.json`` and ``.md``. Two harnesses (``--harness``): ``raw``, a load generator and an
instant backend written as bare asyncio protocols (a few µs each per request, so the proxy stays the
bottleneck), and ``aiohttp``, this file's usual load generator and backend. Two layouts
(``--layouts``): ``pinned`` (load generator and backend on the last core; the single worker alone on
core 0; with N workers, worker k on core k mod cores, so on 2 cores worker 1 shares the last core
with the harness) and ``floating`` (nothing pinned: the kernel places every process). Each window
records the CPU seconds of the proxy's processes, the backend, the load generator and everything
else on the machine (from ``/proc/stat``), per request and per second, so a result can be explained
by where the cores went.
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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

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


# ------------------------------------------------------------------ lean harness (for --ceiling)


def _http_ok(body: bytes, content_type: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body


_RAW_ANSWERS = {
    b"/v1/completions": _http_ok(
        json.dumps(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": " hello", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28},
            }
        ).encode(),
        b"application/json",
    ),  # fmt: skip
    b"/health": _http_ok(b"ok", b"text/plain"),
    b"/v1/models": _http_ok(
        json.dumps({"data": [{"id": MODEL, "owned_by": "vllm"}]}).encode(), b"application/json"
    ),
    b"/metrics": _http_ok(b"vllm:num_requests_running 0\n", b"text/plain"),
}
_RAW_404 = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def _framed(buf: bytes, end: int) -> int | None:
    """Where the HTTP message whose head ends at ``end`` (the blank line) ends in ``buf``; None: not
    all of it is there. Content-Length or chunked bodies, nothing else."""
    head = buf[:end].lower()
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        total = end + 4 + int(head[i + 17 : j if j >= 0 else end])
        return total if len(buf) >= total else None
    if b"chunked" in head:
        k = buf.find(b"\r\n0\r\n\r\n", end + 2)
        return None if k < 0 else k + 7
    return end + 4


class _RawBackend(asyncio.Protocol):
    """An instant backend as a bare asyncio protocol: keep-alive HTTP/1.1, canned answers. A few µs
    per request, against tens for the aiohttp backend, so the proxy stays the bottleneck."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._t = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        while (end := buf.find(b"\r\n\r\n")) >= 0 and (total := _framed(buf, end)) is not None:
            path = buf[: buf.find(b"\r\n")].split(b" ")[1]
            self._t.write(_RAW_ANSWERS.get(path, _RAW_404))
            buf = buf[total:]
        self._buf = buf


def run_raw_backend(port: int) -> None:
    loop = _uvloop()
    loop.run_until_complete(loop.create_server(_RawBackend, "127.0.0.1", port, backlog=1024))
    loop.run_forever()


class _RawClient(asyncio.Protocol):
    """One keep-alive connection sending ``request`` back to back while ``take()`` says so; records
    each latency; a non-200 answer is an error."""

    def __init__(
        self, request: bytes, take: Callable[[], bool], lat: list[float], done: asyncio.Future[None]
    ) -> None:
        self._request, self._take, self._lat, self._done = request, take, lat, done
        self._buf = b""
        self._t0 = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._t = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._next()

    def _next(self) -> None:
        if not self._take():
            self._t.close()
            return
        self._t0 = time.perf_counter()
        self._t.write(self._request)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        while (end := buf.find(b"\r\n\r\n")) >= 0 and (total := _framed(buf, end)) is not None:
            if buf[9:12] != b"200" and not self._done.done():
                self._done.set_exception(RuntimeError(f"answer {buf[:200]!r}"))
            buf = buf[total:]
            self._lat.append(time.perf_counter() - self._t0)
            self._next()
        self._buf = buf

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(None)


async def _raw_load(port: int, concurrency: int, n: int, body: dict[str, Any]) -> tuple[np.ndarray, float]:
    """n non-streaming requests at fixed concurrency over keep-alive connections: (latencies, elapsed)."""
    payload = json.dumps(body).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(payload)
    ) + payload
    left = n
    lat: list[float] = []

    def take() -> bool:
        nonlocal left
        left -= 1
        return left >= 0

    loop = asyncio.get_running_loop()
    dones: list[asyncio.Future[None]] = []
    t0 = time.perf_counter()
    for _ in range(concurrency):
        done: asyncio.Future[None] = loop.create_future()
        dones.append(done)
        await loop.create_connection(partial(_RawClient, request, take, lat, done), "127.0.0.1", port)
    await asyncio.gather(*dones)
    return np.array(lat), time.perf_counter() - t0


# ------------------------------------------------------------------ load generator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpus_s(pids: list[int]) -> float:
    return sum(_cpu_s(p) for p in pids)


def _machine_s() -> tuple[float, float, float]:
    """CPU seconds all cores have spent since boot (``/proc/stat``) running processes (user, nice,
    system), in interrupts (irq, softirq: loopback TCP is mostly softirq, charged to no process) and
    stolen by the hypervisor."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2]) / tick, (v[5] + v[6]) / tick, v[7] / tick


def _workers_of(pid: int) -> list[int]:
    """The worker processes of ``hetroute serve --workers`` ``pid`` (not multiprocessing's resource
    tracker, its other child)."""
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


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


NON_STREAM = {"model": MODEL, "prompt": "hello world, how are you today?", "max_tokens": 16}


async def _measure(target: str, pids: list[int], quick: bool) -> dict[str, Any]:
    """The standard measurement; ``pids``: the proxy's processes whose CPU is counted (none: direct)."""
    scale = 0.25 if quick else 1.0
    ns = NON_STREAM
    out: dict[str, Any] = {}
    await _load(target, 8, int(400 * scale), ns)  # warm-up (connections, caches)
    for c, n in ((1, int(2000 * scale)), (64, int(10000 * scale))):
        cpu0 = _cpus_s(pids)
        lat, elapsed, _ = await _load(target, c, n, ns)
        cpu = (_cpus_s(pids) - cpu0) if pids else None
        out[f"c{c}"] = {
            "requests": n,
            "p50_us": _pct(lat, 50),
            "p99_us": _pct(lat, 99),
            "req_per_s": n / elapsed,
            "proxy_cpu_us_per_request": None if cpu is None else cpu / n * 1e6,
        }
    for mode, gap_s, c, n in (("paced", 0.002, 16, int(400 * scale)), ("burst", 0.0, 16, int(600 * scale))):
        body = {**ns, "stream": True, "max_tokens": 100, "bench_gap_s": gap_s}
        cpu0 = _cpus_s(pids)
        lat, elapsed, events = await _load(target, c, n, body)
        cpu = (_cpus_s(pids) - cpu0) if pids else None
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


def _spawn(args: list[str], core: int | None) -> subprocess.Popen[bytes]:
    """Start ``args``; pinned to ``core`` unless None (then it may run on every core)."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if core is not None:
        os.sched_setaffinity(proc.pid, {core})
    return proc


def _hetroute_config(tmp: str, port: int, backend: str) -> Path:
    cfg = Path(tmp) / "router.yaml"
    cfg.write_text(
        f"policy: {{type: round_robin}}\nserver: {{host: 127.0.0.1, port: {port}}}\n"
        f"backends:\n  - {{name: fake, url: '{backend}', engine: vllm, models: [{MODEL}]}}\n"
    )
    return cfg


async def _start_hetroute(
    source: list[str], port: int, workers: int, cores: list[int] | None
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """``hetroute serve SOURCE --workers N`` up with every worker answering (``source``: ``--config
    FILE`` or ``--backend URL --port P``); returns the process and the pids that serve (the one process,
    or the N workers). ``cores``: worker k is pinned to cores[k % len] (None: not pinned)."""
    serve = [sys.executable, "-c", _SERVE, "serve", *source, "--log-level", "WARNING"]
    if workers > 1:
        serve += ["--workers", str(workers)]
    proc = _spawn(serve, cores[0] if cores and workers == 1 else None)
    try:
        return proc, await _serving_pids(proc, port, workers, cores)
    except BaseException:
        _stop(proc)
        raise


async def _serving_pids(
    proc: subprocess.Popen[bytes], port: int, workers: int, cores: list[int] | None
) -> list[int]:
    url = f"http://127.0.0.1:{port}"
    await _wait_up(url)
    if workers == 1:
        return [proc.pid]
    # Fresh connections until every worker has answered (x-hetroute-worker), then pin them.
    seen: set[str] = set()
    deadline = time.monotonic() + 30.0
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only workers {sorted(seen)} answered")
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s, s.get(url + "/health") as r:
            seen.add(r.headers["x-hetroute-worker"])
    pids = _workers_of(proc.pid)
    if len(pids) != workers:
        raise RuntimeError(f"expected {workers} worker processes, found {pids}")
    if cores is not None:
        os.sched_setaffinity(proc.pid, {cores[-1]})  # the supervisor only waits
        for k, pid in enumerate(sorted(pids)):  # spawned in order: pid order is worker order
            os.sched_setaffinity(pid, {cores[k % len(cores)]})
    return pids


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(15)


async def main_async(quick: bool, workers: int = 1, backends: int = 1) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, load_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {load_core})
    be_port, bare_port, hr_port = _free_port(), _free_port(), _free_port()
    backend = f"http://127.0.0.1:{be_port}"
    procs = [_spawn([sys.executable, __file__, "--role", "backend", "--port", str(be_port)], load_core)]
    extra = [_free_port() for _ in range(backends - 1)]  # --backends N: N instant backends for hetroute
    for port in extra:
        procs.append(_spawn([sys.executable, __file__, "--role", "backend", "--port", str(port)], load_core))
    results: dict[str, Any] = {"cores": {"proxy": proxy_core, "load_generator_and_backend": load_core}}
    try:
        await _wait_up(backend)
        results["direct"] = await _measure(backend, [], quick)
        bare = _spawn(
            [sys.executable, __file__, "--role", "bare", "--port", str(bare_port), "--upstream", backend],
            proxy_core,
        )
        procs.append(bare)
        await _wait_up(f"http://127.0.0.1:{bare_port}")
        results["bare_proxy"] = await _measure(f"http://127.0.0.1:{bare_port}", [bare.pid], quick)
        bare.terminate()
        bare.wait(10)
        quick_start = ["--backend", backend, "--port", str(hr_port)]
        for port in extra:
            await _wait_up(f"http://127.0.0.1:{port}")
            quick_start += ["--backend", f"http://127.0.0.1:{port}"]
        hr, pids = await _start_hetroute(
            quick_start, hr_port, workers, [proxy_core] if workers == 1 else cores
        )
        procs.append(hr)
        results["hetroute"] = await _measure(f"http://127.0.0.1:{hr_port}", pids, quick)
        results["hetroute"]["workers"] = workers
        results["hetroute"]["backends"] = backends
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        os.sched_setaffinity(0, set(cores))  # the next run (--runs) splits the same cores again
    return results


# ------------------------------------------------------------------ --ceiling: workers 1 vs N


async def _ceiling_window(harness: str, port: int, proxy: list[int], backend: int, n: int) -> dict[str, Any]:
    """One measured window of n requests at concurrency 64 through the proxy on ``port``."""
    me = os.getpid()
    cpu0 = (_cpus_s(proxy), _cpu_s(backend), _cpu_s(me), *_machine_s())
    if harness == "raw":
        lat, elapsed = await _raw_load(port, 64, n, NON_STREAM)
    else:
        lat, elapsed, _ = await _load(f"http://127.0.0.1:{port}", 64, n, NON_STREAM)
    cpu1 = (_cpus_s(proxy), _cpu_s(backend), _cpu_s(me), *_machine_s())
    proxy_s, backend_s, load_s, procs_s, irq_s, steal_s = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    other_s = max(procs_s - proxy_s - backend_s - load_s, 0.0)
    return {
        "requests": n,
        "elapsed_s": elapsed,
        "req_per_s": n / elapsed,
        "p50_us": _pct(lat, 50),
        "p99_us": _pct(lat, 99),
        "cpu_us_per_request": {
            "proxy": proxy_s / n * 1e6,
            "backend": backend_s / n * 1e6,
            "load_generator": load_s / n * 1e6,
            "interrupts": irq_s / n * 1e6,
        },
        "cores_busy": {
            "proxy": proxy_s / elapsed,
            "backend": backend_s / elapsed,
            "load_generator": load_s / elapsed,
            "other_processes": other_s / elapsed,
            "interrupts": irq_s / elapsed,
            "steal": steal_s / elapsed,
        },
    }


async def ceiling_async(
    quick: bool, workers: int, rounds: int, harnesses: list[str], layouts: list[str]
) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    harness_core = cores[-1]
    n = 5000 if quick else 20000
    runs: list[dict[str, Any]] = []
    for harness in harnesses:
        for layout in layouts:
            pinned = layout == "pinned"
            os.sched_setaffinity(0, {harness_core} if pinned else set(cores))
            be_port, hr_port = _free_port(), _free_port()
            role = "raw-backend" if harness == "raw" else "backend"
            be = _spawn([sys.executable, __file__, "--role", role, "--port", str(be_port)],
                        harness_core if pinned else None)  # fmt: skip
            backend = f"http://127.0.0.1:{be_port}"
            try:
                await _wait_up(backend)
                with tempfile.TemporaryDirectory() as tmp:
                    cfg = _hetroute_config(tmp, hr_port, backend)
                    for r in range(rounds):
                        # alternate the order, so drift in the machine's other load hits both alike
                        for w in (1, workers) if r % 2 == 0 else (workers, 1):
                            hr, pids = await _start_hetroute(
                                ["--config", str(cfg)], hr_port, w, cores if pinned else None
                            )
                            try:
                                await _raw_load(hr_port, 8, 500, NON_STREAM)  # warm-up
                                row = await _ceiling_window(harness, hr_port, pids, be.pid, n)
                            finally:
                                _stop(hr)
                            row.update(harness=harness, layout=layout, workers=w, round=r)
                            runs.append(row)
                            print(_progress(row), flush=True)
            finally:
                _stop(be)
    return {"workers": workers, "cores": len(cores), "rounds": rounds, "requests_per_window": n, "runs": runs}


def _progress(row: dict[str, Any]) -> str:
    busy = row["cores_busy"]
    return (
        f"{row['harness']:8} {row['layout']:9} workers={row['workers']} round={row['round']}: "
        f"{row['req_per_s']:7.0f} req/s; cores busy: proxy {busy['proxy']:.2f}, "
        f"harness {busy['backend'] + busy['load_generator']:.2f}, "
        f"other processes {busy['other_processes']:.2f}, interrupts {busy['interrupts']:.2f}"
    )


QUIET_CORES = 0.05
"""A window is quiet when processes outside the benchmark used less than this many cores in it."""


def _ceiling_estimate(m: dict[str, Any], workers: int, cores: int) -> float:
    """Requests/s the cores would allow with nothing else running, from the measured CPU per request:
    the proxy's processes cannot use more than ``min(workers, cores)`` cores, and the proxy, the
    harness and the kernel's interrupts together no more than ``cores``."""
    proxy = m["proxy_cpu_us_per_request"]
    total = proxy + m["harness_cpu_us_per_request"] + m["interrupt_us_per_request"]
    return float(min(min(workers, cores) * 1e6 / proxy, cores * 1e6 / total))


def _router_alone(m: dict[str, Any], workers: int, cores: int) -> float:
    """Requests/s the proxy's own processes would serve with ``min(workers, cores)`` cores to themselves
    (the harness and the kernel's interrupts on other cores), from the measured proxy CPU per request:
    how the workers scale apart from what shares this machine's cores with them."""
    return float(min(workers, cores) * 1e6 / m["proxy_cpu_us_per_request"])


def summarise_ceiling(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per harness and layout: the median over rounds of each worker count, and the ratio."""
    out: list[dict[str, Any]] = []
    runs = res["runs"]
    for harness in dict.fromkeys(r["harness"] for r in runs):
        for layout in dict.fromkeys(r["layout"] for r in runs if r["harness"] == harness):
            row: dict[str, Any] = {"harness": harness, "layout": layout}
            for w in (1, res["workers"]):
                mine = [r for r in runs if (r["harness"], r["layout"], r["workers"]) == (harness, layout, w)]

                def med(get: Callable[[dict[str, Any]], float], rows: list[dict[str, Any]] = mine) -> float:
                    return float(np.median([get(r) for r in rows]))

                clean = [r for r in mine if r["cores_busy"]["other_processes"] < QUIET_CORES]
                row[f"workers_{w}"] = {
                    "req_per_s": med(lambda r: r["req_per_s"]),
                    "quiet_windows": len(clean),
                    "quiet_req_per_s": med(lambda r: r["req_per_s"], clean) if clean else None,
                    "best_req_per_s": max(r["req_per_s"] for r in mine),
                    "req_per_s_runs": [round(r["req_per_s"]) for r in mine],
                    "p50_us": med(lambda r: r["p50_us"]),
                    "proxy_cpu_us_per_request": med(lambda r: r["cpu_us_per_request"]["proxy"]),
                    "harness_cpu_us_per_request": med(
                        lambda r: (
                            r["cpu_us_per_request"]["backend"] + r["cpu_us_per_request"]["load_generator"]
                        )
                    ),
                    "interrupt_us_per_request": med(lambda r: r["cpu_us_per_request"]["interrupts"]),
                    "proxy_cores": med(lambda r: r["cores_busy"]["proxy"]),
                    "interrupt_cores": med(lambda r: r["cores_busy"]["interrupts"]),
                    "other_processes_cores": med(lambda r: r["cores_busy"]["other_processes"]),
                }
            one, many = row["workers_1"], row[f"workers_{res['workers']}"]
            row["ratio"] = many["req_per_s"] / one["req_per_s"]
            row["ratio_best"] = many["best_req_per_s"] / one["best_req_per_s"]
            quiet = one["quiet_req_per_s"], many["quiet_req_per_s"]
            row["ratio_quiet"] = quiet[1] / quiet[0] if None not in quiet else None
            est = {w: _ceiling_estimate(row[f"workers_{w}"], w, res["cores"]) for w in (1, res["workers"])}
            row["estimate_without_other_load"] = {
                "workers_1_req_per_s": est[1],
                f"workers_{res['workers']}_req_per_s": est[res["workers"]],
                "ratio": est[res["workers"]] / est[1],
            }
            alone = {w: _router_alone(row[f"workers_{w}"], w, res["cores"]) for w in (1, res["workers"])}
            row["estimate_router_alone"] = {
                "workers_1_req_per_s": alone[1],
                f"workers_{res['workers']}_req_per_s": alone[res["workers"]],
                "ratio": alone[res["workers"]] / alone[1],
            }
            out.append(row)
    return out


def _quiet(m: dict[str, Any]) -> str:
    return "-" if m["quiet_req_per_s"] is None else f"{m['quiet_req_per_s']:.0f} ({m['quiet_windows']})"


def ceiling_markdown(res: dict[str, Any], summary: list[dict[str, Any]], mach: dict[str, Any]) -> str:
    w = res["workers"]
    lines = [
        f"# Request ceiling: `hetroute serve --workers {w}` against one worker",
        "",
        f"`python benchmarks/overhead.py --ceiling --workers {w}`: requests/s at concurrency 64, "
        f"non-streaming, {res['requests_per_window']} requests per window, {res['rounds']} windows per "
        "cell (worker counts alternating). Machine: "
        f"{mach['cpu']}, {mach['cores']} cores, Python {mach['python']}, aiohttp {mach['aiohttp']}. "
        "Harnesses and layouts: the docstring of `benchmarks/overhead.py`.",
        "",
        "Measured (median of the windows, each window in brackets; best: the best window of each; "
        f"quiet: the median of the windows in which other processes used < {QUIET_CORES} cores, "
        "how many in brackets):",
        "",
        f"| harness | layout | req/s, 1 worker | req/s, {w} workers | ratio | ratio of best "
        f"| other processes' cores (1 / {w}) | quiet req/s (1 / {w}) | quiet ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        one, many = row["workers_1"], row[f"workers_{w}"]
        one_runs, many_runs = (", ".join(map(str, x["req_per_s_runs"])) for x in (one, many))
        lines.append(
            f"| {row['harness']} | {row['layout']} | {one['req_per_s']:.0f} ({one_runs}) "
            f"| {many['req_per_s']:.0f} ({many_runs}) | {row['ratio']:.2f} | {row['ratio_best']:.2f} "
            f"| {one['other_processes_cores']:.2f} / {many['other_processes_cores']:.2f} "
            f"| {_quiet(one)} / {_quiet(many)} "
            f"| {'-' if row['ratio_quiet'] is None else format(row['ratio_quiet'], '.2f')} |"
        )
    lines += [
        "",
        "Where the CPU went (medians, µs of CPU per request), and the ceilings these allow on "
        f"{res['cores']} cores with nothing else running (`_ceiling_estimate`: an estimate, not a "
        "measurement):",
        "",
        f"| harness | layout | proxy (1 / {w}) | harness (1 / {w}) | interrupts (1 / {w}) "
        f"| estimated req/s, 1 worker | {w} workers | estimated ratio | router alone: ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        one, many = row["workers_1"], row[f"workers_{w}"]
        est = row["estimate_without_other_load"]
        lines.append(
            f"| {row['harness']} | {row['layout']} "
            f"| {one['proxy_cpu_us_per_request']:.0f} / {many['proxy_cpu_us_per_request']:.0f} "
            f"| {one['harness_cpu_us_per_request']:.0f} / {many['harness_cpu_us_per_request']:.0f} "
            f"| {one['interrupt_us_per_request']:.0f} / {many['interrupt_us_per_request']:.0f} "
            f"| {est['workers_1_req_per_s']:.0f} | {est[f'workers_{w}_req_per_s']:.0f} | {est['ratio']:.2f} "
            f"| {row['estimate_router_alone']['ratio']:.2f} |"
        )
    lines += [
        "",
        f"Router alone: {w} workers' ceiling over one worker's if the workers had "
        f"min({w}, cores) cores to themselves, the harness and interrupts running elsewhere "
        "(`_router_alone`, from the proxy's own CPU per request; an estimate, not a measurement): how the "
        "workers themselves scale, apart from what shares this machine's cores with them.",
    ]
    return "\n".join(lines) + "\n"


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
    for name, r in (("bare_proxy", b), ("hetroute", h)):
        summary[f"{name}_cpu_us_per_request"] = r["c64"]["proxy_cpu_us_per_request"]
        summary[f"{name}_cpu_us_per_event_paced"] = r["stream_paced"]["proxy_cpu_us_per_event"]
        summary[f"{name}_cpu_us_per_event_burst"] = r["stream_burst"]["proxy_cpu_us_per_event"]
    summary["paced_event_ratio"] = (
        h["stream_paced"]["proxy_cpu_us_per_event"] / b["stream_paced"]["proxy_cpu_us_per_event"]
    )
    summary["targets"] = {"cpu_ratio_max": 1.25, "cpu_us_per_request_max": 175, "cpu_us_per_event_max": 25}
    return summary


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median over ``runs`` of every number in their summaries (targets aside)."""
    keys = [k for k, v in runs[0]["summary"].items() if isinstance(v, int | float)]
    return {k: float(np.median([r["summary"][k] for r in runs])) for k in keys}


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
    ap.add_argument("--role", choices=("bench", "backend", "raw-backend", "bare"), default="bench")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--upstream", default="")
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the standard measurement N times (every run and the medians are written)",
    )
    ap.add_argument(
        "--workers", type=int, default=None, help="hetroute serve --workers N (see the docstring)"
    )
    ap.add_argument(
        "--backends",
        type=int,
        default=1,
        help="hetroute serve with N instant backends (a real choice per request; see the docstring)",
    )
    ap.add_argument("--ceiling", action="store_true", help="requests/s at concurrency 64, 1 worker vs N")
    ap.add_argument("--rounds", type=int, default=3, help="--ceiling: windows per worker count")
    ap.add_argument("--harness", default="raw,aiohttp", help="--ceiling: raw and/or aiohttp")
    ap.add_argument("--layouts", default="pinned,floating", help="--ceiling: pinned and/or floating")
    ap.add_argument("--out", default=None, help="the JSON file (default: by mode, under results/)")
    ap.add_argument(
        "--render",
        action="store_true",
        help="--ceiling: summarise the saved windows of --out (default overhead_workers.json) again, "
        "running nothing",
    )
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.backends < 1:
        ap.error("--backends must be at least 1")
    if args.role == "backend":
        run_backend(args.port)
        return 0
    if args.role == "raw-backend":
        run_raw_backend(args.port)
        return 0
    if args.role == "bare":
        run_bare_proxy(args.port, args.upstream)
        return 0
    if args.render and not args.ceiling:
        ap.error("--render goes with --ceiling")
    if args.ceiling:
        workers = args.workers or 2
        out = Path(args.out or HERE / "results" / "overhead_workers.json")
        if args.render:
            saved = json.loads(out.read_text())
            mach = saved.pop("machine")
            saved.pop("summary", None)
            res = saved
        else:
            harnesses, layouts = args.harness.split(","), args.layouts.split(",")
            res = _uvloop().run_until_complete(
                ceiling_async(args.quick, workers, args.rounds, harnesses, layouts)
            )
            mach = machine()
        ceiling = summarise_ceiling(res)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": mach, "summary": ceiling, **res}, indent=1))
        md = ceiling_markdown(res, ceiling, mach)
        out.with_suffix(".md").write_text(md)
        print(md)
        print(f"wrote {out} and {out.with_suffix('.md')}")
        return 0
    workers = args.workers or 1
    runs: list[dict[str, Any]] = []
    for k in range(args.runs):
        load_before = os.getloadavg()
        res = asyncio.run(main_async(args.quick, workers, args.backends))
        summary = summarise(res)
        print(f"run {k + 1} of {args.runs}:")
        print_table(res, summary)
        runs.append(
            {
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                "results": res,
                "summary": summary,
            }
        )
    med = medians(runs)
    print(f"medians over {args.runs} run(s):", json.dumps(med, indent=1))
    default = "overhead.json" if workers == 1 else f"overhead_w{workers}.json"
    if args.backends > 1:
        default = default.replace(".json", f"_b{args.backends}.json")
    out = Path(args.out or HERE / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "benchmarks/overhead.py", *sys.argv[1:]])
    doc = {"machine": machine(), "command": command, "median": med, "runs": runs}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
