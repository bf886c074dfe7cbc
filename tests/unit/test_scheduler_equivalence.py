"""The tuner's estimate and the engine model schedule alike: same requests, same step timer, same schedule.

The tuner path is :func:`hetroute.tuner.iteration.trace_instance` (the shared vLLM scheduler, pure-decode
stretches jumped in closed form); the engine path is :class:`EngineModel` with the same timer, driven one
step at a time as the simulator drives it. Every request's first-token and finish time, the number of
steps and the preemptions must agree (times up to float rounding: a jump sums its steps in closed form).
"""

from __future__ import annotations

import math
import random

import pytest

from hetroute.catalog.roofline import step_cost
from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog
from hetroute.latency import LatencyParams
from hetroute.sim.engine_model import EngineConfig, EngineModel
from hetroute.sim.sched_request import SchedRequest
from hetroute.sim.step_timer import FittedTimer, RooflineTimer, StepTimer
from hetroute.sim.vllm_scheduler import VllmScheduler
from hetroute.tuner.iteration import InstanceTrace, simulate_instance, trace_instance

GPU = load_gpu_catalog()["A100-80GB"]
MODEL = load_model_catalog()["Llama-3-8B"]
FITTED = LatencyParams(p1=2e-5, p2=1e-3, p3=3e-6, p4=0.02, p5=4e-7, p6=2e-4, p7=5e-6, p8=0.01)


def timer_of(kind: str) -> StepTimer:
    return FittedTimer(FITTED) if kind == "fitted" else RooflineTimer(step_cost(GPU, MODEL, 1))


def engine_trace(
    timer: StepTimer,
    requests: list[tuple[int, int]],
    arrivals: list[float],
    cap: int,
    seqs: int,
    budget: int,
    block_size: int,
) -> InstanceTrace:
    """Serve ``requests`` on an :class:`EngineModel` one step at a time, submitting each on arrival."""
    blocks = cap // block_size
    config = EngineConfig(
        gpu=GPU,
        model=MODEL,
        block_size=block_size,
        num_gpu_blocks_override=blocks,
        max_model_len=blocks * block_size,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    engine = EngineModel(config, timer=timer)
    n = len(requests)
    order = sorted(range(n), key=lambda r: arrivals[r])
    first_s, finish_s = [math.nan] * n, [math.nan] * n
    now, nxt = 0.0, 0
    while nxt < n or engine.has_work():
        while nxt < n and arrivals[order[nxt]] <= now:
            inp, out = requests[order[nxt]]
            engine.submit(str(order[nxt]), inp, out, now)
            nxt += 1
        if not engine.has_work():
            now = arrivals[order[nxt]]
            continue
        outcome = engine.step(now)
        if not outcome.scheduled_tokens:
            continue  # a step that only preempted: plan again at once, as the simulator does
        now += outcome.duration_s
        for event in outcome.emitted:
            if event.first:
                first_s[int(event.request_id)] = now
        for rid in outcome.finished:
            finish_s[int(rid)] = now
    stats = engine.stats()
    return InstanceTrace(
        tuple(first_s), tuple(finish_s), now, stats.steps_total, stats.num_preemptions_total, 0
    )


def count_jumps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of every pure-decode jump the tuner path makes from now on."""
    jumps: list[int] = []
    original = VllmScheduler.advance_decode

    def spy(self: VllmScheduler[SchedRequest], steps: int) -> list[SchedRequest]:
        jumps.append(steps)
        return original(self, steps)

    monkeypatch.setattr(VllmScheduler, "advance_decode", spy)
    return jumps


def workload(seed: int, n: int, poisson_rps: float | None) -> tuple[list[tuple[int, int]], list[float]]:
    rng = random.Random(seed)
    requests = [(rng.randint(1, 400), rng.randint(1, 150)) for _ in range(n)]
    if poisson_rps is None:
        return requests, [0.0] * n
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(poisson_rps)
        arrivals.append(t)
    return requests, arrivals


@pytest.mark.parametrize("timer_kind", ["fitted", "roofline"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    ("cap", "poisson_rps"),
    [(4096, None), (4096, 40.0), (10**6, None), (10**6, 15.0)],
    ids=["tight-saturated", "tight-poisson", "roomy-saturated", "roomy-poisson"],
)
def test_tuner_path_and_engine_model_schedule_identically(
    timer_kind: str, block_size: int, cap: int, poisson_rps: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests, arrivals = workload(seed=cap + block_size, n=120, poisson_rps=poisson_rps)
    timer = timer_of(timer_kind)
    jumps = count_jumps(monkeypatch)
    tuner = trace_instance(timer, requests, cap, 48, 512, arrivals, block_size=block_size)
    engine = engine_trace(timer, requests, arrivals, cap, 48, 512, block_size)
    assert tuner.first_token_s == pytest.approx(engine.first_token_s, rel=1e-9)
    assert tuner.finish_s == pytest.approx(engine.finish_s, rel=1e-9)
    assert tuner.end_s == pytest.approx(engine.end_s, rel=1e-9)
    assert (tuner.steps, tuner.preemptions) == (engine.steps, engine.preemptions)
    assert max(jumps) > 1  # the tuner path did jump over decode stretches
    if cap == 4096:
        assert engine.preemptions > 0  # the KV pressure case exercises preemption and resumption


def test_simulate_instance_is_the_fitted_trace_summarised() -> None:
    requests, arrivals = workload(seed=5, n=60, poisson_rps=20.0)
    run = simulate_instance(FITTED, requests, 4096, 48, 512, arrivals)
    engine = engine_trace(FittedTimer(FITTED), requests, arrivals, 4096, 48, 512, 1)
    assert run.makespan_s == pytest.approx(engine.end_s - min(arrivals), rel=1e-9)
    assert (run.steps, run.preemptions) == (engine.steps, engine.preemptions)
    ttft = [f - a for f, a in zip(engine.first_token_s, arrivals, strict=True)]
    assert run.ttft_mean_s == pytest.approx(sum(ttft) / len(ttft), rel=1e-9)
