"""``hetroute serve --workers N``: real processes sharing one port on 127.0.0.1 (SO_REUSEPORT).

The process tests start ``python -m hetroute serve --workers 2`` in front of an in-process emulated
engine, read the parent's start-up line (``2 workers serving on ... (pids A, B)``) from its stderr,
and identify the answering worker by the ``x-hetroute-worker`` header.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from hetroute.app import LEARNER, SAVE_DIR, build_app, start_app
from hetroute.cli import build_parser
from hetroute.commands import serve
from hetroute.config import config_from_dict
from hetroute.errors import ConfigError
from tests.conftest import MODEL, EmulateFn, backend_entry, eventually
from tests.integration.test_gateway_serve import _free_port

START_S = 60.0  # two spawned interpreters importing numpy/aiohttp on a busy 2-core machine
EXIT_S = 10.0
SERVING = re.compile(r"(\d+) workers serving on http://\S+ \(pids ([\d, ]+)\)")


@dataclass
class Served:
    proc: asyncio.subprocess.Process
    url: str
    pids: list[int]
    stderr: list[str] = field(default_factory=list)


async def _collect(stream: asyncio.StreamReader, into: list[str], seen: asyncio.Queue[str]) -> None:
    while line := await stream.readline():
        text = line.decode(errors="replace")
        into.append(text)
        seen.put_nowait(text)


@asynccontextmanager
async def _serve_workers(
    backend_url: str,
    workers: int = 2,
    restarts: int | None = None,
    tmp: Path | None = None,
    peers: dict[str, Any] | None = None,
) -> AsyncIterator[Served]:
    """``--backend`` flags, or with ``restarts`` or ``peers`` a config file in ``tmp``
    (``server.worker_restarts``, the ``peers`` section; the peer key is set in the environment)."""
    port = _free_port()
    source = ["--backend", backend_url, "--policy", "round_robin"]
    env = dict(os.environ)
    if restarts is not None or peers is not None:
        assert tmp is not None
        config = tmp / "router.yaml"
        data: dict[str, Any] = {
            "backends": [{"name": "emu", "url": backend_url, "engine": "vllm", "models": [MODEL]}],
            "policy": {"type": "round_robin"},
            "server": {"worker_restarts": 5 if restarts is None else restarts},
        }
        if peers is not None:
            data["peers"] = peers
            env["HETROUTE_PEER_KEY"] = "workers-test-key"
        config.write_text(json.dumps(data), encoding="utf-8")
        source = ["--config", str(config)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hetroute", "serve", *source,
        "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    lines: list[str] = []
    seen: asyncio.Queue[str] = asyncio.Queue()
    reader = asyncio.create_task(_collect(proc.stderr, lines, seen))
    try:
        async with asyncio.timeout(START_S):
            while not (m := SERVING.search(await seen.get())):
                pass
        assert int(m.group(1)) == workers
        pids = [int(p) for p in m.group(2).split(", ")]
        yield Served(proc, f"http://127.0.0.1:{port}", pids, lines)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await asyncio.wait_for(reader, EXIT_S)


def _has_fit(app: web.Application) -> bool:
    return app[LEARNER].fit_of(0) is not None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _request(url: str) -> tuple[int, str | None]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
    # A fresh connection per request: the kernel picks a worker per connection.
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s, s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status, r.headers.get("x-hetroute-worker")


async def test_two_workers_share_the_port_and_all_exit_0_on_sigterm(emulate: EmulateFn) -> None:
    emu = await emulate("vllm")
    async with _serve_workers(emu.url) as served:
        assert len(served.pids) == 2 and served.proc.pid not in served.pids
        answers: list[tuple[int, str | None]] = []
        for _ in range(5):  # 40 requests, 8 at a time, each on its own connection
            answers += await asyncio.gather(*(_request(served.url) for _ in range(8)))
        assert [status for status, _ in answers] == [200] * 40
        by_worker = {w: sum(1 for _, x in answers if x == w) for w in {x for _, x in answers}}
        assert set(by_worker) == {"0", "1"}, by_worker  # both processes served
        async with aiohttp.ClientSession() as s, s.get(served.url + "/admin/backends") as r:
            assert r.headers["x-hetroute-worker"] in ("0", "1")  # admin answers per worker

        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(served.proc.wait(), EXIT_S)
        elapsed = time.monotonic() - t0
        assert rc == 0, "".join(served.stderr)
        assert elapsed < 5.0, elapsed
        assert all(_gone(pid) for pid in served.pids)  # reaped by the parent, none left behind
        assert served.proc.stdout is not None
        log_lines = (await served.proc.stdout.read()).decode().splitlines()
        # The workers share stdout: 40 whole JSON lines, none interleaved with another.
        records = [json.loads(line) for line in log_lines]
        assert len(records) == 40 and all(r["status"] == 200 for r in records)
        prefixes = {r["request_id"].split("-")[0] for r in records}
        assert len(prefixes) == 2  # seed + k: each worker has its own request-id prefix


def _two_udp_ports() -> int:
    """A UDP port P on 127.0.0.1 with P + 1 free too (worker k listens on P + k)."""
    for _ in range(50):
        with (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b,
        ):
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            if port >= 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free UDP ports")


async def _peer_replicas_seen(url: str) -> tuple[str, float]:
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s, s.get(url + "/metrics") as r:
        text = await r.text()
        worker = r.headers["x-hetroute-worker"]
    (line,) = [x for x in text.splitlines() if x.startswith("hetroute_peer_replicas ")]
    return worker, float(line.split()[1])


async def test_each_worker_is_a_peer_on_its_own_port(emulate: EmulateFn, tmp_path: Path) -> None:
    emu = await emulate("vllm")
    port = _two_udp_ports()
    peers = {"addresses": [f"127.0.0.1:{port}"], "listen_host": "127.0.0.1", "listen_port": port}
    async with _serve_workers(emu.url, tmp=tmp_path, peers=peers) as served:
        heard: dict[str, float] = {}
        deadline = time.monotonic() + START_S
        while len(heard) < 2 or min(heard.values()) < 1.0:
            assert time.monotonic() < deadline, heard
            worker, replicas = await _peer_replicas_seen(served.url)
            heard[worker] = replicas
            await asyncio.sleep(0.05)
        # Worker 0 listens on the port, worker 1 on the next; each hears exactly the other one.
        assert heard == {"0": 1.0, "1": 1.0}
        served.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(served.proc.wait(), EXIT_S) == 0, "".join(served.stderr)


async def test_without_restarts_a_killed_worker_stops_the_others_and_the_parent_exits_non_zero(
    emulate: EmulateFn, tmp_path: Path
) -> None:
    emu = await emulate("vllm")
    async with _serve_workers(emu.url, restarts=0, tmp=tmp_path) as served:
        assert (await _request(served.url))[0] == 200
        os.kill(served.pids[0], signal.SIGKILL)
        rc = await asyncio.wait_for(served.proc.wait(), EXIT_S)
        assert rc == 1
        assert all(_gone(pid) for pid in served.pids)
        assert any("exited unexpectedly" in line and "stopping the others" in line for line in served.stderr)


RESTARTED = re.compile(r"worker (\d+) listening again \(pid (\d+)\)")


async def test_a_killed_worker_is_started_again_until_the_restart_budget_is_spent(
    emulate: EmulateFn, tmp_path: Path
) -> None:
    """``server.worker_restarts: 1``: the first SIGKILL of worker 0 is repaired while worker 1 keeps
    serving (no request fails and both indices answer again); the second within 60 s stops the group."""
    emu = await emulate("vllm")
    async with _serve_workers(emu.url, restarts=1, tmp=tmp_path) as served:
        assert (await _request(served.url))[0] == 200
        os.kill(served.pids[0], signal.SIGKILL)
        # Once the supervisor saw it die, its socket is closed: the kernel sends new connections to worker 1.
        assert await eventually(lambda: any("starting it again" in x for x in served.stderr), EXIT_S)
        during = await asyncio.gather(*(_request(served.url) for _ in range(8)))
        assert [status for status, _ in during] == [200] * 8

        def restarted() -> re.Match[str] | None:
            return next((m for line in served.stderr if (m := RESTARTED.search(line))), None)

        assert await eventually(lambda: restarted() is not None, timeout_s=START_S)
        m = restarted()
        assert m is not None and m.group(1) == "0"
        new_pid = int(m.group(2))
        assert new_pid not in served.pids and _gone(served.pids[0]) and not _gone(served.pids[1])
        assert any("starting it again (restart 1 of at most 1" in line for line in served.stderr)
        seen: set[str | None] = set()
        for _ in range(10):  # new connections reach both workers again
            answers = await asyncio.gather(*(_request(served.url) for _ in range(8)))
            assert [status for status, _ in answers] == [200] * 8
            seen |= {w for _, w in answers}
            if seen == {"0", "1"}:
                break
        assert seen == {"0", "1"}

        os.kill(new_pid, signal.SIGKILL)  # the budget is spent: the group stops
        rc = await asyncio.wait_for(served.proc.wait(), EXIT_S)
        assert rc == 1, "".join(served.stderr)
        assert _gone(new_pid) and _gone(served.pids[1])
        assert any("stopping the others (1 restarts in the last 60s)" in line for line in served.stderr)


async def test_workers_need_a_fixed_port_and_at_least_one() -> None:
    parser = build_parser("serve", lazy=True)
    for argv, field_name in (
        (["--workers", "0"], "--workers"),
        (["--workers", "2", "--port", "0"], "--port"),
    ):
        args = parser.parse_args(["serve", "--backend", "http://127.0.0.1:1", *argv])
        with pytest.raises(ConfigError) as info:
            serve._load(args)
        assert info.value.path == field_name
    args = parser.parse_args(["serve", "--backend", "http://127.0.0.1:1", "--port", "8123", "--workers", "3"])
    cfg = serve._load(args)
    assert (cfg.server.workers, cfg.server.port, cfg.server.worker_restarts) == (3, 8123, 5)
    backends = [{"name": "a", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ConfigError, match="server.worker_restarts") as bad:
        config_from_dict({"backends": backends, "server": {"worker_restarts": -1}})
    assert bad.value.path == "server.worker_restarts"
    never = config_from_dict({"backends": backends, "server": {"worker_restarts": 0}})
    assert never.server.worker_restarts == 0


async def test_worker_apps_differ_in_seed_and_only_worker_0_saves(emulate: EmulateFn, tmp_path: Path) -> None:
    emu = await emulate("vllm")
    cfg = config_from_dict(
        {
            "backends": [backend_entry(emu)],
            "server": {"workers": 2},
            "learning": {"state_dir": str(tmp_path), "refit_interval_s": 0.05},
        },
        env={},
    )
    apps = {k: build_app(cfg, registry=CollectorRegistry(), worker=k) for k in (0, 1)}
    assert apps[0][SAVE_DIR] == str(tmp_path) and SAVE_DIR not in apps[1]
    assert SAVE_DIR in build_app(cfg, registry=CollectorRegistry())  # the single process saves
    saved_file = f"{emu.name}.yaml"
    for k, app in apps.items():
        runner, port = await start_app(app)
        try:
            async with aiohttp.ClientSession() as s:
                for n in range(8):
                    body = {"model": MODEL, "prompt": "word " * (10 + 5 * n), "max_tokens": 4 + n}
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        assert r.status == 200 and r.headers["x-hetroute-worker"] == str(k)
            assert await eventually(partial(_has_fit, app))
        finally:
            await runner.cleanup()  # worker 0's cleanup saves its models; worker 1's does not
        files = sorted(os.listdir(tmp_path))
        if k == 0:
            assert files == [saved_file]
            (tmp_path / saved_file).unlink()
        else:
            assert files == []
