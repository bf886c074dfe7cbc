"""Ledger invariants: exactly-once release and exact return to zero."""

from __future__ import annotations

import random

from hetroute.routing.ledger import Ledger, Ticket


def test_dispatch_and_release_round_trip() -> None:
    led = Ledger(["a", "b"])
    t = led.dispatch(
        request_id="1",
        backend_index=1,
        input_tokens=100,
        predicted_output_tokens=40,
        workload_cost=0.3,
        now_s=0.0,
    )
    assert led.backend_load(1)["requests_in_flight"] == 1
    assert led.backend_load(1)["input_tokens_in_flight"] == 100
    assert led.backend_load(1)["remaining_predicted_tokens"] == 40
    assert led.backend_load(1)["workload"] == 0.3
    assert led.backend_load(0)["requests_in_flight"] == 0
    assert led.release(t, 1.0) is True
    assert led.release(t, 2.0) is False  # second release has no effect
    assert led.is_zero()
    assert t.released_at_s == 1.0


def test_observed_tokens_replace_predicted() -> None:
    led = Ledger(["a"])
    t = led.dispatch(
        request_id="1",
        backend_index=0,
        input_tokens=10,
        predicted_output_tokens=5,
        workload_cost=1.0,
        now_s=0.0,
    )
    led.observe_generated(t, 3)
    assert led.backend_load(0)["generated_tokens_in_flight"] == 3
    assert led.backend_load(0)["remaining_predicted_tokens"] == 2
    led.observe_generated(t, 8)  # more than predicted: remaining clamps at 0
    assert led.backend_load(0)["generated_tokens_in_flight"] == 8
    assert led.backend_load(0)["remaining_predicted_tokens"] == 0
    led.observe_generated(t, 7)  # counts never go backwards
    assert led.backend_load(0)["generated_tokens_in_flight"] == 8
    led.release(t, 1.0)
    led.observe_generated(t, 20)  # after release: no effect
    assert led.is_zero()


def test_random_interleaving_returns_exactly_to_zero() -> None:
    rng = random.Random(7)
    led = Ledger(["a", "b", "c"])
    live: list[Ticket] = []
    for step in range(5000):
        if live and rng.random() < 0.5:
            t = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                led.observe_generated(t, rng.randrange(0, 300))
            assert led.release(t, float(step))
            if rng.random() < 0.1:
                assert not led.release(t, float(step))
        else:
            live.append(
                led.dispatch(
                    request_id=str(step),
                    backend_index=rng.randrange(3),
                    input_tokens=rng.randrange(1, 2000),
                    predicted_output_tokens=rng.randrange(1, 500),
                    workload_cost=rng.random() * 3.7,
                    now_s=float(step),
                )
            )
        assert led.in_flight() == len(live)
    for t in live:
        led.release(t, 1e9)
    assert led.is_zero()


def test_predicted_outputs_stay_as_dispatched_until_release() -> None:
    led = Ledger(["a"])
    t = led.dispatch(
        request_id="1",
        backend_index=0,
        input_tokens=10,
        predicted_output_tokens=5,
        workload_cost=0.0,
        now_s=0.0,
    )
    led.observe_generated(t, 9)
    assert led.backend_load(0)["predicted_output_tokens_in_flight"] == 5  # open loop: never corrected
    led.release(t, 1.0)
    assert led.backend_load(0)["predicted_output_tokens_in_flight"] == 0 and led.is_zero()


def _dispatch(led: Ledger, rid: str, backend: int, input_tokens: int) -> Ticket:
    return led.dispatch(
        request_id=rid,
        backend_index=backend,
        input_tokens=input_tokens,
        predicted_output_tokens=7,
        workload_cost=0.5,
        now_s=0.0,
    )


def test_prefill_pending_tokens_leave_at_the_first_token_exactly_once() -> None:
    led = Ledger(["a", "b"])
    t1 = _dispatch(led, "1", 0, 100)
    t2 = _dispatch(led, "2", 0, 30)
    _dispatch(led, "3", 1, 5)
    assert led.prefill_pending_tokens.tolist() == [130, 5]
    assert led.backend_load(0)["prefill_pending_tokens"] == 130
    led.first_token(t1, 1.0)
    assert led.prefill_pending_tokens.tolist() == [30, 5]
    led.first_token(t1, 2.0)  # idempotent: not removed twice
    assert led.prefill_pending_tokens.tolist() == [30, 5]
    assert t1.first_token_at_s == 1.0
    led.release(t1, 3.0)  # first token already counted: release does not remove it again
    assert led.prefill_pending_tokens.tolist() == [30, 5]
    assert led.input_tokens_in_flight.tolist() == [30, 5]
    led.release(t2, 3.0)  # no first token ever came (error, timeout): removed at release
    assert led.prefill_pending_tokens.tolist() == [0, 5]
    led.first_token(t2, 4.0)  # a first token after release changes nothing
    assert led.prefill_pending_tokens.tolist() == [0, 5] and t2.first_token_at_s is None


def test_is_zero_includes_prefill_pending_tokens() -> None:
    led = Ledger(["a"])
    t = _dispatch(led, "1", 0, 10)
    led.release(t, 1.0)
    assert led.is_zero()
    led.prefill_pending_tokens[0] = 1.0  # a leak anywhere must show
    assert not led.is_zero()


def test_prefill_pending_random_interleaving_matches_a_recount() -> None:
    rng = random.Random(11)
    led = Ledger(["a", "b", "c"])
    live: list[Ticket] = []
    for step in range(4000):
        roll = rng.random()
        if live and roll < 0.3:
            led.first_token(live[rng.randrange(len(live))], float(step))
        elif live and roll < 0.6:
            t = live.pop(rng.randrange(len(live)))
            assert led.release(t, float(step))
        else:
            backend, tokens = rng.randrange(3), rng.randrange(1, 4000)
            cached = rng.choice([0, 0, rng.randrange(tokens)])
            ticket = led.dispatch(
                request_id=str(step),
                backend_index=backend,
                input_tokens=tokens,
                predicted_output_tokens=7,
                workload_cost=0.5,
                now_s=float(step),
                prefill_tokens=tokens - cached,
            )
            # The learner's "work ahead": the uncached prompt tokens still waiting on that backend.
            assert ticket.pending_tokens_ahead == sum(
                t.prefill_tokens for t in live if t.backend_index == backend and t.first_token_at_s is None
            )
            live.append(ticket)
        expected = [0.0, 0.0, 0.0]
        uncached = [0.0, 0.0, 0.0]
        for t in live:
            if t.first_token_at_s is None:
                expected[t.backend_index] += t.input_tokens
                uncached[t.backend_index] += t.prefill_tokens
        assert led.prefill_pending_tokens.tolist() == expected
        assert led.prefill_pending_uncached_tokens.tolist() == uncached
    for t in live:
        led.release(t, 1e9)
    assert led.is_zero()
