"""The step timers: hand-computed step times, and pure-decode runs equal to their step-by-step sums."""

from __future__ import annotations

import pytest

from hetroute.catalog.roofline import StepCost
from hetroute.latency import LatencyParams
from hetroute.sim.step_timer import FittedTimer, RooflineTimer, StepBatch, StepTimer

P = LatencyParams(p1=1e-3, p2=2e-2, p3=3e-4, p4=0.5, p5=1e-5, p6=2e-3, p7=4e-5, p8=0.01)
COST = StepCost(
    weight_s=0.010,
    kv_s_per_token=1e-5,
    prefill_s_per_token=1e-4,
    prefill_attn_s=1e-8,
    decode_s_per_seq=1e-4,
    compute_overlap=1.0,
    fixed_s=0.002,
    comm_s_per_token=1e-6,
)
# memory time starts below compute time and overtakes it after 50 steps of 10 sequences
CROSSING = StepCost(0.0005, 1e-6, 1e-4, 1e-8, 1e-4, 0.5, 0.002, 1e-6)


def step_by_step(timer: StepTimer, seqs: int, kv_tokens: int, steps: int) -> float:
    return sum(timer.step_s(StepBatch(seqs, kv_tokens + j * seqs)) for j in range(steps))


def test_fitted_mixed_step_is_decode_term_plus_prefill_term_without_p4() -> None:
    # decode: 4 sequences holding 400 tokens: p5·400 + p6·4 + p7·400/4 + p8 = 0.004 + 0.008 + 0.004 + 0.01
    # prefill: 2 chunks of 300 tokens in all: p1·300 + p2·2 + p3·300/2 = 0.3 + 0.04 + 0.045
    batch = StepBatch(4, 400, prefill_tokens=300, prefill_chunks=2, prefill_attn=1.0, prefill_kv_tokens=7)
    assert FittedTimer(P).step_s(batch) == pytest.approx(0.026 + 0.385, rel=1e-12)


def test_fitted_prefill_only_step_adds_p4_and_empty_step_is_free() -> None:
    assert FittedTimer(P).step_s(StepBatch(0, 0, 300, 2)) == pytest.approx(0.385 + 0.5, rel=1e-12)
    assert FittedTimer(P).step_s(StepBatch(0, 0)) == 0.0
    assert StepBatch(0, 0).empty and not StepBatch(1, 5).empty


def test_fitted_decode_run_is_closed_form_and_the_sum_of_its_steps() -> None:
    timer = FittedTimer(P)
    # steps at S = 400, 404, 408: 0.026 + 0.02608 + 0.02616 = 3·0.026 + (p5·4 + p7)·3
    assert timer.decode_run_s(4, 400, 3) == pytest.approx(0.07824, rel=1e-12)
    assert timer.decode_run_s(4, 400, 37) == pytest.approx(step_by_step(timer, 4, 400, 37), rel=1e-12)
    assert timer.decode_run_s(0, 0, 5) == 0.0


def test_fitted_steps_until_is_the_first_run_reaching_the_time() -> None:
    timer = FittedTimer(P)
    assert timer.decode_steps_until(4, 400, 0.05) == 2  # 0.026 < 0.05 <= 0.05208
    assert timer.decode_steps_until(4, 400, 0.07824) == 3
    assert timer.decode_steps_until(4, 400, 0.0) == 1
    for delta in (0.3, 1.7, 12.5):
        k = timer.decode_steps_until(4, 400, delta)
        assert timer.decode_run_s(4, 400, k) >= delta > timer.decode_run_s(4, 400, k - 1)


def test_fitted_curves_below_zero_cost_no_time() -> None:
    negative = LatencyParams(p1=0.0, p2=0.0, p3=0.0, p4=-1.0, p5=0.0, p6=0.0, p7=0.0, p8=-1.0)
    assert FittedTimer(negative).step_s(StepBatch(0, 0, 10, 1)) == 0.0
    assert FittedTimer(negative).decode_run_s(2, 10, 4) == 0.0


def test_roofline_step_is_the_step_cost_with_decode_and_prefill_kv_read() -> None:
    # t_mem = 0.010 + 1e-5·(800 + 50) = 0.0185; t_comp = 1e-4·100 + 1e-8·100·(50 + 50) + 1e-4·8 = 0.0109;
    # full overlap leaves t_mem; + fixed 0.002 + comm 1e-6·108
    batch = StepBatch(8, 800, prefill_tokens=100, prefill_chunks=1, prefill_attn=1e4, prefill_kv_tokens=50)
    assert RooflineTimer(COST).step_s(batch) == pytest.approx(0.0185 + 0.002 + 0.000108, rel=1e-12)
    assert RooflineTimer(COST).step_s(batch) == COST.step_s(100, 10_000.0, 8, 850)


def test_roofline_decode_run_switches_branch_where_memory_overtakes_compute() -> None:
    timer = RooflineTimer(CROSSING)
    # first step: t_mem 0.0005 < t_comp 0.001: 0.0005 + 0.001 − 0.5·0.0005 + 0.002 + 1e-6·10
    assert timer.decode_run_s(10, 0, 1) == pytest.approx(0.00326, rel=1e-12)
    for steps in (1, 49, 50, 51, 120):
        assert timer.decode_run_s(10, 0, steps) == pytest.approx(step_by_step(timer, 10, 0, steps), rel=1e-12)
    assert timer.decode_run_s(10, 5_000, 30) == pytest.approx(step_by_step(timer, 10, 5_000, 30), rel=1e-12)


def test_roofline_steps_until_is_the_first_run_reaching_the_time() -> None:
    timer = RooflineTimer(CROSSING)
    for delta in (0.001, 0.00326, 0.05, 0.4, 3.0):
        k = timer.decode_steps_until(10, 0, delta)
        assert timer.decode_run_s(10, 0, k) >= delta
        assert k == 1 or timer.decode_run_s(10, 0, k - 1) < delta
