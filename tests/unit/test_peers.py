"""Router replicas exchanging summaries (hetroute.routing.peers) through the real Router, Ledger and
latency learner."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetroute.clock import ManualClock
from hetroute.learning.build import build_live_models
from hetroute.learning.observation import Observation
from hetroute.learning.settings import LearningConfig
from hetroute.policies import PolicyContext, build_policy
from hetroute.policies.backend_model import BackendModels
from hetroute.routing.ledger import Ledger
from hetroute.routing.peers import PeerSummary, PeerView
from hetroute.routing.router import OUTBOX_MAX, Router
from hetroute.types import EngineMetrics, RequestFeatures
from tests.unit.snapshots import spec

NAMES = ("a", "b")


def obs(backend: int, finished_at_s: float, e2e_s: float = 2.0) -> Observation:
    return Observation(
        backend_index=backend,
        finished_at_s=finished_at_s,
        input_tokens=100,
        output_tokens=20,
        ttft_s=0.1,
        e2e_s=e2e_s,
        pending_tokens_ahead=0.0,
        in_flight_at_first=1.0,
        context_at_first=100.0,
        in_flight_at_end=1.0,
        context_at_end=120.0,
    )


def summary(
    replica: str,
    seq: int,
    requests: tuple[float, ...] = (2.0, 1.0),
    backends: tuple[str, ...] = NAMES,
    sent_at_s: float = 0.0,
    observations: tuple[tuple[str, Observation], ...] = (),
) -> PeerSummary:
    n = len(backends)
    rows = np.array([[float(10 * (r + 1) * (k + 1)) for k in range(n)] for r in range(6)])
    return PeerSummary(replica, seq, sent_at_s, backends, np.array(requests), rows, observations)


def test_a_summary_counts_by_backend_name_until_it_is_stale() -> None:
    view = PeerView("me", NAMES, stale_s=0.3)
    assert view.totals(0.0) is None
    view.receive(summary("p1", 1, backends=("b", "a", "zz"), requests=(5.0, 3.0, 9.0)), now_s=0.0)
    view.receive(summary("p2", 1), now_s=0.1)
    totals = view.totals(0.2)
    assert totals is not None
    requests, rows = totals
    assert requests.tolist() == [3.0 + 2.0, 5.0 + 1.0]  # p1 named b first; its "zz" is not ours
    assert rows[4].tolist() == [100.0 + 50.0, 50.0 + 100.0]  # row 4 is 50 × (position + 1)
    assert not requests.flags.writeable and not rows.flags.writeable
    assert view.peers(0.29) == 2
    assert view.peers(0.31) == 1  # p1's summary (received at 0) is stale after 0.3 s
    only_p2 = view.totals(0.31)
    assert only_p2 is not None and only_p2[0].tolist() == [2.0, 1.0]
    assert view.totals(0.41) is None


def test_own_echoes_and_older_summaries_are_ignored() -> None:
    view = PeerView("me", NAMES, stale_s=1.0)
    view.receive(summary("me", 1), now_s=0.0)
    assert view.totals(0.0) is None
    view.receive(summary("p", 2, requests=(1.0, 1.0)), now_s=0.0)
    view.receive(summary("p", 1, requests=(7.0, 7.0)), now_s=0.1)  # reordered: older than the one held
    totals = view.totals(0.1)
    assert totals is not None and totals[0].tolist() == [1.0, 1.0]


def test_observations_come_back_on_this_replicas_backends_and_clock() -> None:
    view = PeerView("me", NAMES, stale_s=1.0)
    sent = summary("p", 1, sent_at_s=100.0, observations=(("b", obs(0, 99.5)), ("zz", obs(1, 99.0))))
    got = view.receive(sent, now_s=7.0)
    assert len(got) == 1
    assert got[0].backend_index == 1  # "b" is our backend 1, whatever the sender's index
    assert got[0].finished_at_s == pytest.approx(6.5)  # half a second before it was sent


def test_a_changed_backend_set_drops_what_was_held() -> None:
    view = PeerView("me", NAMES, stale_s=1.0)
    view.receive(summary("p", 1), now_s=0.0)
    view.set_backends(("b", "c", "a"))
    assert view.totals(0.0) is None
    view.receive(summary("p", 2), now_s=0.0)
    totals = view.totals(0.0)
    assert totals is not None and totals[0].tolist() == [1.0, 0.0, 2.0]


def test_a_bad_staleness_is_refused() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="stale_s"):
            PeerView("me", NAMES, stale_s=bad)


def feats(k: int) -> RequestFeatures:
    return RequestFeatures(f"r{k}", "m", "openai", 100, None, 50)


def router(replica: str, clock: ManualClock, metrics: dict[int, EngineMetrics] | None = None) -> Router:
    backends = tuple(spec(name, models=("m",)) for name in NAMES)
    latest = metrics if metrics is not None else {}
    return Router(
        backends,
        build_policy("round_robin", {}, PolicyContext(backends)),
        Ledger(list(NAMES)),
        clock,
        latest_metrics=latest.get,
        learner=build_live_models(BackendModels.from_specs(backends), LearningConfig()),
        peers=PeerView(replica, NAMES, stale_s=0.3),
    )


def test_two_routers_see_each_others_load_and_learn_from_each_others_completions() -> None:
    clock = ManualClock()
    first, second = router("r1", clock), router("r2", clock)
    tickets = [first.route(feats(k)) for k in range(3)]  # round robin: a, b, a
    second.receive(first.publish())
    snap = second.snapshot()
    assert snap.requests_in_flight.tolist() == [2, 1]
    assert snap.workload.tolist() == first.ledger.snapshot_arrays()[1][4].tolist()
    assert second.ledger.is_zero()  # the peers' load is in the snapshot only

    clock.set(1.0)
    first.first_token(tickets[0], 1.0)
    clock.set(2.0)
    first.complete(tickets[0], 20)
    first.release(tickets[0])
    before = second.learner.observed_total(0) if second.learner is not None else -1
    assert second.receive(first.publish()) == 1
    assert second.learner is not None and second.learner.observed_total(0) == before + 1
    assert second.snapshot().requests_in_flight.tolist() == [1, 1]
    assert second.receive(first.publish()) == 0  # each completion is handed over once

    clock.set(2.4)  # the last summary, received at 2.0, is stale after 0.3 s
    assert second.snapshot().requests_in_flight.tolist() == [0, 0]
    for t in tickets[1:]:
        first.release(t)
    assert first.ledger.is_zero() and second.ledger.is_zero()


def test_current_summaries_replace_the_foreign_estimate_which_then_leaves_the_peers_out() -> None:
    clock = ManualClock()
    metrics: dict[int, EngineMetrics] = {}
    mine, other = router("r1", clock, metrics), router("r2", clock)
    ticket = mine.route(feats(0))  # on a
    others = [other.route(feats(k)) for k in range(1, 4)]  # a, b, a
    mine.receive(other.publish())
    # The engines hold the two routers' requests and three on b from a client outside them.
    for i, running in ((0, 3.0), (1, 4.0)):
        metrics[i] = EngineMetrics(scraped_at_s=0.0, num_requests_running=running, num_requests_waiting=0.0)
        mine.scraped(i, metrics[i])
    assert mine.foreign_requests().tolist() == [0.0, 0.0]  # while the peer's summary is current
    assert mine.snapshot().requests_in_flight.tolist() == [3, 1]
    clock.set(0.5)  # the summary is stale: the scrape-based estimate (scaled_excess) takes over,
    outside = mine.foreign_requests()  # and it counted the peer's requests as this router's own
    assert outside[0] == pytest.approx(0.0) and outside[1] > 0.0
    for t in (ticket, *others):
        (mine if t is ticket else other).release(t)


def test_the_first_token_and_the_end_record_the_peers_load_for_the_learner() -> None:
    clock = ManualClock()
    first, second = router("r1", clock), router("r2", clock)
    peer_tickets = [second.route(feats(k)) for k in range(4)]  # a, b, a, b
    first.receive(second.publish())
    ticket = first.route(feats(9))  # a
    first.first_token(ticket, 0.2)  # the peer's summary is current (0.3 s)
    assert ticket.in_flight_at_first == 1.0 + 2.0
    assert ticket.context_at_first == pytest.approx(100.0 + 200.0)
    for t in peer_tickets:
        second.release(t)
    first.release(ticket)


def test_publish_without_a_peer_view_is_refused() -> None:
    backends = tuple(spec(name, models=("m",)) for name in NAMES)
    alone = Router(
        backends, build_policy("round_robin", {}, PolicyContext(backends)), Ledger(list(NAMES)), ManualClock()
    )
    with pytest.raises(RuntimeError, match="PeerView"):
        alone.publish()
    with pytest.raises(RuntimeError, match="PeerView"):
        alone.receive(summary("p", 1))
    assert np.array_equal(alone.snapshot().requests_in_flight, [0, 0])


def test_completions_wait_for_the_next_summary_in_a_bounded_outbox() -> None:
    clock = ManualClock()
    alone = router("r1", clock)
    for k in range(OUTBOX_MAX + 10):
        ticket = alone.route(feats(k))
        clock.set(clock.now() + 0.01)
        alone.complete(ticket, 5)
        alone.release(ticket)
    sent = alone.publish()
    assert len(sent.observations) == OUTBOX_MAX  # the oldest ten were dropped
    assert sent.observations[-1][1].finished_at_s == pytest.approx(clock.now())
    assert alone.publish().observations == ()


def test_a_backend_added_live_is_matched_by_name_in_the_next_summaries() -> None:
    clock = ManualClock()
    mine, other = router("r1", clock), router("r2", clock)
    held = [other.route(feats(k)) for k in range(2)]  # a, b
    mine.receive(other.publish())
    mine.set_slot(2, spec("c", models=("m",)))  # this replica gains c; the peer does not have it
    assert mine.snapshot().requests_in_flight.tolist() == [0, 0, 0]  # held summaries were dropped
    mine.receive(other.publish())
    assert mine.snapshot().requests_in_flight.tolist() == [1, 1, 0]
    for t in held:
        other.release(t)


def test_a_summary_is_due_after_a_dispatch_or_a_release_or_the_heartbeat() -> None:
    clock = ManualClock()
    me = router("r1", clock)
    assert me.summary_due(heartbeat_s=1.0)  # never sent
    me.publish()
    assert not me.summary_due(heartbeat_s=1.0)
    ticket = me.route(feats(0))
    assert me.summary_due(heartbeat_s=1.0)  # a dispatch
    me.publish()
    clock.set(0.5)
    assert not me.summary_due(heartbeat_s=1.0)
    me.release(ticket)
    assert me.summary_due(heartbeat_s=1.0)  # a release
    me.publish()
    me.release(ticket)  # not effective: nothing changed
    assert not me.summary_due(heartbeat_s=1.0)
    clock.set(1.5)
    assert me.summary_due(heartbeat_s=1.0)  # the heartbeat
