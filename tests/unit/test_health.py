"""The health state machine: Envoy-style ejection with back-off, max %, no early un-ejection."""

from __future__ import annotations

from collections.abc import Callable

from hetroute.backends.health import HealthTracker
from hetroute.clock import ManualClock
from hetroute.config import HealthConfig

CFG = HealthConfig(
    consecutive_failures=3,
    base_ejection_s=10.0,
    max_ejection_s=25.0,
    max_ejection_percent=50.0,
    unhealthy_threshold=2,
    healthy_threshold=1,
)


def _tracker(n: int = 2, cfg: HealthConfig = CFG) -> tuple[HealthTracker, ManualClock, list[int]]:
    clock = ManualClock()
    ejected: list[int] = []
    return HealthTracker(cfg, [f"b{i}" for i in range(n)], clock, on_eject=ejected.append), clock, ejected


def _fail(t: HealthTracker, i: int, times: int) -> list[bool]:
    return [t.record_failure(i, "status 500") for _ in range(times)]


def test_consecutive_failures_eject_and_time_returns_backend() -> None:
    t, clock, ejected = _tracker()
    assert _fail(t, 0, 3) == [False, False, True] and ejected == [0]
    assert not t.is_available(0) and t.is_available(1)
    clock.advance(9.9)
    assert not t.is_available(0)
    clock.advance(0.1)
    assert t.is_available(0)  # base_ejection_s × 1


def test_success_resets_the_consecutive_count() -> None:
    t, _, _ = _tracker()
    _fail(t, 0, 2)
    t.record_success(0)
    assert _fail(t, 0, 2) == [False, False] and t.is_available(0)


def test_ejection_time_grows_and_is_capped() -> None:
    t, clock, _ = _tracker()
    durations = []
    for _ in range(4):
        _fail(t, 0, 3)
        start = clock.now()
        while not t.is_available(0):
            clock.advance(1.0)
        durations.append(clock.now() - start)
    assert durations == [10.0, 20.0, 25.0, 25.0]  # base × times_ejected, capped at max
    assert t.states[0].ejections_total == 4


def test_multiplier_decays_while_healthy() -> None:
    t, clock, _ = _tracker()
    _fail(t, 0, 3)
    clock.advance(10.0)
    _fail(t, 0, 3)  # second ejection: 20 s
    assert t.states[0].times_ejected == 2
    clock.advance(20.0 + 20.0)  # ejection over, then two base periods healthy
    t.record_success(0)
    assert t.states[0].times_ejected == 0


def test_max_ejection_percent() -> None:
    t, _, ejected = _tracker(n=2)
    _fail(t, 0, 3)
    assert _fail(t, 1, 5) == [False] * 5  # a second ejection would exceed 50 %
    assert ejected == [0] and t.is_available(1)


def test_zero_percent_never_ejects() -> None:
    t, _, ejected = _tracker(cfg=HealthConfig(consecutive_failures=1, max_ejection_percent=0.0))
    _fail(t, 0, 3)
    assert ejected == [] and t.is_available(0)


def test_successful_probe_does_not_end_an_ejection_early() -> None:
    # A backend that fails every request but passes /health stays out for its ejection time.
    t, clock, _ = _tracker()
    _fail(t, 0, 3)
    assert not t.is_available(0)
    t.record_probe(0, ok=True)
    assert not t.is_available(0)
    until = t.states[0].ejected_until_s
    assert until is not None
    clock.advance(until - clock.now() - 0.001)
    t.record_probe(0, ok=True)
    assert not t.is_available(0)
    clock.advance(0.002)
    assert t.is_available(0) and t.states[0].consecutive_failures == 0


def test_failed_probes_mark_unhealthy_until_a_success() -> None:
    t, _, _ = _tracker()
    t.record_probe(1, ok=False, error="refused")
    assert t.is_available(1)  # unhealthy_threshold = 2
    t.record_probe(1, ok=False, error="refused")
    assert not t.is_available(1) and t.available_count() == 1
    d = t.describe(1)
    assert d["probe_healthy"] is False and d["last_error"] == "refused"
    t.record_probe(1, ok=True)
    assert t.is_available(1)


def test_failures_while_ejected_do_not_extend() -> None:
    t, clock, ejected = _tracker()
    _fail(t, 0, 3)
    _fail(t, 0, 10)
    assert ejected == [0] and t.states[0].ejected_until_s == 10.0
    assert t.describe(0)["ejected"] is True
    clock.advance(10.0)
    assert t.describe(0)["ejected"] is False


def test_confirmed_needs_a_passed_probe_or_a_success() -> None:
    t, _, _ = _tracker(3)
    assert t.available_count() == 3 and t.confirmed_available_count() == 0  # nothing heard yet
    t.record_probe(0, False, "probe status 503")  # one failure: still available, not confirmed
    assert t.is_available(0) and not t.confirmed(0)
    t.record_probe(1, True)
    t.record_success(2)
    assert [t.confirmed(i) for i in range(3)] == [False, True, True]
    assert t.confirmed_available_count() == 2
    t.record_probe(1, False, "x")
    t.record_probe(1, False, "x")  # unhealthy_threshold: confirmed once, but no longer available
    assert t.confirmed(1) and t.confirmed_available_count() == 1


def test_available_all_equals_is_available_of_every_backend_through_ejection_and_probes() -> None:
    twin_a, clock_a, _ = _tracker(4)
    twin_b, clock_b, _ = _tracker(4)

    def both(step: Callable[[HealthTracker, ManualClock], object]) -> None:
        step(twin_a, clock_a)
        step(twin_b, clock_b)
        # Each twin read one way only (reading ends expired ejections, so the two must not share state).
        assert twin_a.available_all() == tuple(twin_b.is_available(i) for i in range(4))

    both(lambda t, c: None)
    both(lambda t, c: _fail(t, 1, 3))  # ejected for 10 s

    def two_failed_probes(t: HealthTracker, c: ManualClock) -> None:
        t.record_probe(2, False)
        t.record_probe(2, False)

    both(two_failed_probes)  # unhealthy
    both(lambda t, c: c.advance(9.9))
    both(lambda t, c: c.advance(0.1))  # ejection over
    both(lambda t, c: t.record_probe(2, True))
    assert twin_a.states[1].ejected_until_s is None and twin_b.states[1].ejected_until_s is None


def test_available_all_is_one_tuple_until_something_changes() -> None:
    t, clock, _ = _tracker(3)
    first = t.available_all()
    clock.advance(5.0)
    assert t.available_all() is first  # reused: nothing changed
    _fail(t, 0, 3)  # ejected for 10 s
    ejected = t.available_all()
    assert ejected == (False, True, True)
    clock.advance(9.9)
    assert t.available_all() is ejected
    clock.advance(0.1)  # the ejection ran out: read anew, and ended
    assert t.available_all() == (True, True, True) and t.states[0].ejected_until_s is None
    t.retire(2)
    assert t.available_all() == (True, True, False)
    t.set_slot(2, "b2-new")
    assert t.available_all() == (True, True, True)
    t.record_probe(1, False)
    t.record_probe(1, False)
    assert t.available_all() == (True, False, True)
