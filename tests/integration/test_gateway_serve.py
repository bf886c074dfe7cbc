"""`hetroute serve` as a process: quick start with discovery, config errors, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp

from tests.conftest import MODEL, EmulateFn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_healthy(url: str, proc: asyncio.subprocess.Process, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.returncode is None, "hetroute serve exited early"
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("hetroute serve did not become healthy")


async def test_quick_start_discovers_and_drains_on_sigterm(emulate: EmulateFn) -> None:
    vllm, tgi = await emulate("vllm", speedup=2.0), await emulate("tgi", speedup=2.0)
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hetroute", "serve", "--backend", vllm.url, "--backend", tgi.url,
        "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/admin/backends") as r:
                admin = json.loads(await r.read())
            assert [(b["engine"], b["models"]) for b in admin["backends"]] == [
                ("vllm", [MODEL]),
                ("tgi", [MODEL]),
            ]
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                first = await r.content.readany()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)  # in-flight stream must still finish
                rest = await r.read()
            assert (first + rest).endswith(b"data: [DONE]\n\n")
            assert (first + rest).count(b'"text"') == 40
        rc = await asyncio.wait_for(proc.wait(), timeout=10.0)
        err = (await proc.stderr.read()).decode() if proc.stderr else ""
        assert rc == 0, err
        out = (await proc.stdout.read()).decode() if proc.stdout else ""
        assert '"status":200' in out  # the access-log line of the drained request
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_config_error_exits_non_zero_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "router.yaml"
    bad.write_text("backends:\n  - {name: a, url: 'http://127.0.0.1:1', engine: vllm, models: [m]}\n"
                   "  - {name: b, url: 'ftp://nope', engine: vllm, models: [m]}\n")  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hetroute", "serve", "--config", str(bad),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), timeout=15.0)
    assert proc.returncode == 2
    assert b"backends[1].url" in err
