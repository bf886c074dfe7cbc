"""The iteration-level continuous-batching estimate: exact small cases and a step-by-step reference."""

from __future__ import annotations

import math
import random

import pytest

from hetroute.latency import LatencyParams
from hetroute.tuner.iteration import simulate_instance, simulate_machine

# a flat prefill of 1 s per step, 0.1 s per decode step
FLAT = LatencyParams(p1=0.0, p2=0.0, p3=0.0, p4=1.0, p5=0.0, p6=0.0, p7=0.0, p8=0.1)


def test_one_request_prefill_then_decode_steps() -> None:
    run = simulate_instance(
        FLAT, [(10, 5)], kv_capacity_tokens=100, max_num_seqs=8, max_num_batched_tokens=64
    )
    # the prefill step emits the first token, four decode steps the rest
    assert run.makespan_s == pytest.approx(1.0 + 4 * 0.1)
    assert run.steps == 5
    assert run.tokens_per_s == pytest.approx(15 / 1.4)
    assert run.ttft_p90_s == pytest.approx(1.0)
    assert run.tpot_mean_s == pytest.approx(0.1)


def test_max_num_seqs_one_serves_requests_one_after_another() -> None:
    run = simulate_instance(FLAT, [(10, 5), (10, 3)], 100, max_num_seqs=1, max_num_batched_tokens=64)
    assert run.makespan_s == pytest.approx((1.0 + 0.4) + (1.0 + 0.2))


def test_continuous_batching_mixes_a_new_prefill_into_decode_steps() -> None:
    # r0 (O=3) and r1 (O=6) start together; r2 joins when r0 finishes (mixed step: decode + prefill, no p4)
    p = LatencyParams(p1=0.0, p2=0.05, p3=0.0, p4=1.0, p5=0.0, p6=0.0, p7=0.0, p8=0.1)
    run = simulate_instance(p, [(4, 3), (4, 6), (4, 2)], 1000, max_num_seqs=2, max_num_batched_tokens=64)
    # t=1.1: prefill of r0, r1 (p4 + 2·p2), first tokens. Two decode steps (0.1 each): r0 has 3 at 1.3.
    # Then decode r1 + prefill r2 = 0.1 + 0.05 -> 1.45 (r2's first token); decode both -> 1.55 (r2 done);
    # r1 alone -> 1.65 (r1 has 1 + 5 = 6 tokens).
    assert run.makespan_s == pytest.approx(1.65)


def _reference(p: LatencyParams, reqs: list[tuple[int, int]], seqs: int, budget: int) -> float:
    """A plain step-by-step simulation (no KV limit), the behaviour the analytic jumps must reproduce."""
    waiting = list(range(len(reqs)))
    todo = {r: reqs[r][0] for r in waiting}
    computed = {r: 0 for r in waiting}
    generated = {r: 0 for r in waiting}
    running: list[int] = []
    now = 0.0
    while waiting or running:
        decoders = [r for r in running if todo[r] == 0]
        left = budget - len(decoders)
        chunks = []
        for r in running:
            if todo[r] > 0 and left > 0:
                c = min(todo[r], left)
                chunks.append((r, c))
                left -= c
        while waiting and left > 0 and len(running) < seqs:
            r = waiting.pop(0)
            running.append(r)
            c = min(todo[r], left)
            chunks.append((r, c))
            left -= c
        b = len(decoders)
        s = sum(computed[r] for r in decoders)
        dt = (p.p5 * s + p.p6 * b + p.p7 * s / b + p.p8) if b else 0.0
        if chunks:
            tokens = sum(c for _, c in chunks)
            dt += p.p1 * tokens + p.p2 * len(chunks) + p.p3 * tokens / len(chunks) + (0.0 if b else p.p4)
        now += dt
        for r in decoders:
            computed[r] += 1
            generated[r] += 1
        for r, c in chunks:
            todo[r] -= c
            computed[r] += c
            if todo[r] == 0:
                generated[r] += 1
        running = [r for r in running if generated[r] < reqs[r][1]]
    return now


def test_analytic_jumps_match_a_step_by_step_reference() -> None:
    p = LatencyParams(p1=2e-5, p2=1e-3, p3=3e-6, p4=0.02, p5=4e-7, p6=2e-4, p7=5e-6, p8=0.01)
    rng = random.Random(3)
    for _ in range(5):
        reqs = [(rng.randint(1, 300), rng.randint(1, 80)) for _ in range(60)]
        run = simulate_instance(p, reqs, 10**9, max_num_seqs=16, max_num_batched_tokens=512)
        assert run.makespan_s == pytest.approx(_reference(p, reqs, 16, 512), rel=1e-9)
        assert run.preemptions == 0


def test_kv_pressure_preempts_and_still_finishes_everything() -> None:
    p = LatencyParams(p1=1e-5, p2=0.0, p3=0.0, p4=0.01, p5=1e-7, p6=1e-4, p7=0.0, p8=0.01)
    reqs = [(100, 200)] * 40
    roomy = simulate_instance(p, reqs, 10**6, 64, 8192)
    tight = simulate_instance(p, reqs, 2000, 64, 8192)
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert tight.makespan_s > roomy.makespan_s
    assert tight.mean_batch < roomy.mean_batch


def test_a_preempted_decoder_resumes_with_its_generated_tokens() -> None:
    # KV for 11 tokens. t=1.0: one prefill step computes a (1 token) and b (5), each emits its 1st token.
    # Two decode steps (1.2): a holds 3, b 7 = 10 tokens; the next needs 2, one is free, so b (newest) is
    # preempted by recompute while a decodes its 4th and last token (1.3). b resumes by prefilling its
    # prompt and its 3 generated tokens (8), which yields its 4th and last token: 2.3. (The tuner's own copy
    # of the scheduler lost b's decoded tokens here: it re-prefilled 5 + 1 and decoded two tokens again.)
    run = simulate_instance(FLAT, [(1, 4), (5, 4)], 11, max_num_seqs=4, max_num_batched_tokens=20)
    assert run.preemptions == 1
    assert run.makespan_s == pytest.approx(2.3)
    assert run.steps == 5


def test_arrivals_give_latencies_and_idle_gaps() -> None:
    run = simulate_instance(FLAT, [(10, 3), (10, 3)], 100, 8, 64, arrivals_s=[0.0, 10.0])
    assert run.makespan_s == pytest.approx(10.0 + 1.2)
    assert run.ttft_mean_s == pytest.approx(1.0)
    assert run.tpot_p90_s == pytest.approx(0.1)


def test_requests_that_cannot_fit_are_rejected() -> None:
    with pytest.raises(ValueError, match="request 0"):
        simulate_instance(FLAT, [(90, 20)], 100, 8, 64)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be greater than or equal"):
        simulate_instance(FLAT, [(10, 2)], 100, 128, 64)


def test_machine_makespan_is_the_slowest_round_robin_share() -> None:
    reqs = [(10, 50), (10, 1), (10, 50), (10, 1)]
    machine = simulate_machine(FLAT, reqs, 2, 1000, 8, 64)
    slow = simulate_instance(FLAT, [(10, 50), (10, 50)], 1000, 8, 64)
    assert machine.makespan_s == pytest.approx(slow.makespan_s)
    assert machine.tokens_per_s == pytest.approx(sum(i + o for i, o in reqs) / slow.makespan_s)
    assert not math.isnan(machine.instance_tokens_per_s)
