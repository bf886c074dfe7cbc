"""The arrival rate the tail test's backlog uses (hetroute.admission.arrivals)."""

from __future__ import annotations

import math

import pytest

from hetroute.admission.arrivals import ArrivalRate


def test_a_steady_stream_reads_its_rate_and_a_burst_decays_with_the_window() -> None:
    rate = ArrivalRate(window_s=5.0)
    for k in range(2000):  # 20 requests/s for 100 s: many windows, so the sum has converged
        rate.note("m", k * 0.05)
    assert rate.rate_per_s("m", 99.95) == pytest.approx(20.0, rel=0.03)
    assert rate.rate_per_s("other", 99.95) == 0.0  # per model

    burst = ArrivalRate(window_s=5.0)
    for _ in range(1000):
        burst.note("m", 0.0)
    assert burst.rate_per_s("m", 0.0) == pytest.approx(200.0)  # N / τ at once
    assert burst.rate_per_s("m", 5.0) == pytest.approx(200.0 / math.e)
    assert burst.rate_per_s("m", 50.0) == pytest.approx(200.0 * math.exp(-10.0))


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        ArrivalRate(window_s=0.0)
