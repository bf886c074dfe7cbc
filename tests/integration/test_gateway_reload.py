"""`hetroute serve --config` reloads its backends on SIGHUP, in one process and in every worker."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.conftest import MODEL, Emu, EmulateFn
from tests.integration.test_gateway_serve import _free_port, _wait_healthy


def _write(path: Path, backends: list[Emu], **extra: Any) -> None:
    data = {
        "backends": [{"name": e.name, "url": e.url, "engine": "vllm", "models": [MODEL]} for e in backends],
        "policy": {"type": "round_robin"},
        "health": {"probe_interval_s": 0.5},
        "scrape": {"interval_s": 0.2},
        **extra,
    }
    path.write_text(yaml.safe_dump(data))


async def _members(s: aiohttp.ClientSession, url: str) -> tuple[str, list[str]]:
    """(worker header, names of the members) from one fresh connection's /admin/backends."""
    async with s.get(url + "/admin/backends") as r:
        admin = json.loads(await r.read())
        return r.headers.get("x-hetroute-worker", ""), [
            b["name"] for b in admin["backends"] if b["state"] == "member"
        ]


async def _until(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.1)
    return bool(await check())


async def _stop(proc: asyncio.subprocess.Process) -> str:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), timeout=15.0)
    return (await proc.stderr.read()).decode() if proc.stderr else ""


async def test_sighup_applies_the_files_backends_and_keeps_running_on_a_bad_file(
    emulate: EmulateFn, tmp_path: Path
) -> None:
    a, b, c = [await emulate(name=n) for n in "abc"]
    config = tmp_path / "router.yaml"
    _write(config, [a, b])
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hetroute", "serve", "--config", str(config), "--port", str(port),
        "--host", "127.0.0.1", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, proc)
        async with aiohttp.ClientSession() as s:
            assert (await _members(s, url))[1] == ["a", "b"]
            _write(config, [a, c], policy={"type": "least_outstanding"})
            proc.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                return (await _members(s, url))[1] == ["a", "c"]

            assert await _until(reloaded)
            served = []
            for k in range(6):
                body = {"model": MODEL, "prompt": f"after reload {k}", "max_tokens": 4}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    served.append(r.headers["x-hetroute-backend"])
            assert set(served) == {"a", "c"}
            config.write_text("backends: [this is not a backend]\n")
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            assert (await _members(s, url))[1] == ["a", "c"]
            async with s.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
            ) as r:
                assert r.status == 200
    finally:
        err = await _stop(proc)
    assert proc.returncode == 0, err
    assert "added ['c'], removed ['b']" in err
    assert "policy changed" in err and "restart to apply" in err
    assert "failed; nothing changed" in err and "backends[0]" in err


async def test_sighup_reaches_every_worker(emulate: EmulateFn, tmp_path: Path) -> None:
    a, b = await emulate(name="a"), await emulate(name="b")
    config = tmp_path / "router.yaml"
    _write(config, [a])
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hetroute", "serve", "--config", str(config), "--port", str(port),
        "--host", "127.0.0.1", "--workers", "2",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, proc, timeout_s=30.0)
        _write(config, [a, b])
        proc.send_signal(signal.SIGHUP)
        seen: dict[str, list[str]] = {}
        # A new connection per request, so that the kernel spreads them over both workers.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as s:

            async def both_reloaded() -> bool:
                worker, names = await _members(s, url)
                seen[worker] = names
                return len(seen) == 2 and all(v == ["a", "b"] for v in seen.values())

            assert await _until(both_reloaded, timeout_s=20.0), seen
    finally:
        err = await _stop(proc)
    assert proc.returncode == 0, err
    assert err.count("added ['b']") == 2
