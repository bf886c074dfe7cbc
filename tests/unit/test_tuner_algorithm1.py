"""Algorithm 1 (paper, fixed): batching, timing, the (u/t) return value, termination, infeasibility."""

from __future__ import annotations

import pytest

from hetroute.latency import LatencyParams
from hetroute.tuner.algorithm1 import algorithm1_estimate

# Prefill costs a flat 1 s per batch, each decode step 0.1 s: T(batch) = 1 + 0.1 · max O.
FLAT = LatencyParams(p1=0.0, p2=0.0, p3=0.0, p4=1.0, p5=0.0, p6=0.0, p7=0.0, p8=0.1)
REQS = [(10, 5), (10, 5), (10, 20)]  # 60 tokens


def test_one_batch_when_everything_fits() -> None:
    est = algorithm1_estimate(FLAT, REQS, kv_capacity_tokens=100, max_num_seqs=256, instances=1)
    # KV check of the whole batch: Σ I + 3 · max O = 30 + 60 = 90 <= 100
    assert est.batches == 1
    assert est.largest_batch == 3
    assert est.total_time_s == pytest.approx(1.0 + 0.1 * 20)
    assert est.instance_tokens_per_s == pytest.approx(60 / 3.0)


def test_kv_check_uses_count_times_longest_output() -> None:
    # with cap 50: [r0, r1] needs 20 + 2·5 = 30; adding r2 needs 30 + 3·20 = 90 > 50
    est = algorithm1_estimate(FLAT, REQS, kv_capacity_tokens=50, max_num_seqs=256, instances=1)
    assert est.batches == 2
    assert est.total_time_s == pytest.approx((1.0 + 0.5) + (1.0 + 2.0))


def test_batch_is_capped_at_max_num_seqs() -> None:
    est = algorithm1_estimate(FLAT, REQS, kv_capacity_tokens=10_000, max_num_seqs=1, instances=1)
    assert est.batches == 3
    assert est.largest_batch == 1
    assert est.total_time_s == pytest.approx(1.5 + 1.5 + 3.0)


def test_machine_throughput_is_instances_times_instance_not_tp() -> None:
    one = algorithm1_estimate(FLAT, REQS, 100, 256, instances=1)
    four = algorithm1_estimate(FLAT, REQS, 100, 256, instances=4)
    assert four.machine_tokens_per_s == pytest.approx(4 * one.instance_tokens_per_s)
    assert four.instance_tokens_per_s == pytest.approx(one.instance_tokens_per_s)


def test_batch_time_uses_eq3_and_eq4_at_the_longest_request() -> None:
    p = LatencyParams(p1=1e-4, p2=2e-3, p3=3e-5, p4=4e-2, p5=5e-7, p6=6e-5, p7=7e-6, p8=8e-3)
    reqs = [(100, 10), (300, 40)]
    est = algorithm1_estimate(p, reqs, 100_000, 256, 1)
    b, i, o = 2, 300, 40
    s = o * i + o * (o + 1) / 2
    expected = (p.p1 * b * i + p.p2 * b + p.p3 * i + p.p4) + (
        p.p5 * b * s + p.p6 * b * o + p.p7 * s + p.p8 * o
    )
    assert est.total_time_s == pytest.approx(expected)


def test_a_request_larger_than_capacity_is_infeasible_not_an_endless_loop() -> None:
    est = algorithm1_estimate(
        FLAT, [(10, 5), (90, 20)], kv_capacity_tokens=100, max_num_seqs=256, instances=2
    )
    assert est.infeasible_reason is not None
    assert "request 1" in est.infeasible_reason
    assert est.machine_tokens_per_s == 0.0


def test_terminates_and_batches_every_request_once() -> None:
    reqs = [(50 + (k % 7) * 13, 20 + (k % 5) * 9) for k in range(5000)]
    est = algorithm1_estimate(FLAT, reqs, kv_capacity_tokens=2000, max_num_seqs=16, instances=1)
    assert est.infeasible_reason is None
    # every batch holds <= 16 requests, so at least 5000/16 batches; time adds up per batch
    assert est.batches >= 5000 // 16
    assert est.instance_tokens_per_s == pytest.approx(sum(i + o for i, o in reqs) / est.total_time_s)


def test_rejects_empty_input() -> None:
    with pytest.raises(ValueError):
        algorithm1_estimate(FLAT, [], 100, 1, 1)
