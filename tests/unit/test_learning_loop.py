"""The gateway's refit loop: a large fleet is refitted a slice at a time, with the event loop serving
requests between two slices, and refitting takes a bounded share of the process's time."""

from __future__ import annotations

import asyncio
import random

import pytest

from hetroute.clock import ManualClock
from hetroute.config import config_from_dict
from hetroute.learning.live import LiveModels, PriorModel
from hetroute.learning.settings import LearningConfig
from hetroute.lifecycle import REFIT_CPU_SHARE, REFIT_SLICE, learning_loop
from hetroute.policies import build_policy
from hetroute.policies.base import PolicyContext
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import BackendSpec
from tests.unit.test_learning import CAP, SEQS, TRUE, synthetic

N = 3 * REFIT_SLICE + 1  # four slices


class _Stop(Exception):
    pass


async def test_a_busy_fleet_is_refitted_in_slices_with_requests_served_between_them() -> None:
    backends = tuple(
        BackendSpec(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}", engine="vllm", models=("m",))
        for i in range(N)
    )
    clock = ManualClock(100.0)
    names = [b.name for b in backends]
    prior = PriorModel(TRUE, "test", "profile")
    learner = LiveModels(names, [prior] * N, [CAP] * N, [SEQS] * N, LearningConfig())
    policy = build_policy("default", {}, PolicyContext(backends, seed=1))
    router = Router(backends, policy, Ledger(names), clock, learner=learner)
    rng = random.Random(5)
    for i in range(N):
        for obs in synthetic(TRUE, 40, rng):
            learner.observe(obs._replace(backend_index=i))
    events: list[str] = []
    refit = learner.refit

    def timed_refit(now_s: float, limit: int | None = None) -> int:
        events.append("refit")
        clock.advance(0.1)  # each slice takes 0.1 s of the process's time
        return refit(now_s, limit)

    learner.refit = timed_refit  # type: ignore[method-assign]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            raise _Stop

    async def requests() -> None:  # stands for the requests the event loop serves meanwhile
        while True:
            events.append("request")
            await asyncio.sleep(0)

    cfg = config_from_dict({"backends": [{"name": "b0", "url": "http://127.0.0.1:9000"}]}, env={})
    other = asyncio.create_task(requests())
    try:
        with pytest.raises(_Stop):
            await learning_loop(learner, router, cfg, None, sleep=sleep)
    finally:
        other.cancel()
    assert events.count("refit") == 4  # one pass of four slices; the second found nothing new
    assert all(learner.fit_of(i) is not None for i in range(N))
    refits = [k for k, e in enumerate(events) if e == "refit"]
    assert all("request" in events[a:b] for a, b in zip(refits, refits[1:], strict=False))
    spent_s = 4 * 0.1
    assert waits[0] == cfg.learning.refit_interval_s
    assert waits[1] == pytest.approx(spent_s / REFIT_CPU_SHARE - spent_s)  # 1.6 s: at most a fifth
    assert waits[2] == cfg.learning.refit_interval_s  # nothing to refit: the usual interval
