"""Mirroring a replica's own change onto its peers between their summaries (hetroute.routing.peer_mirror),
alone and through the real Router and Ledger."""

from __future__ import annotations

import numpy as np
import pytest

from hetroute.clock import ManualClock
from hetroute.policies import PolicyContext, build_policy
from hetroute.routing.ledger import FLOAT_ROWS, Ledger
from hetroute.routing.peer_mirror import OwnHistory
from hetroute.routing.peers import PeerView
from hetroute.routing.router import Router
from hetroute.types import FloatArray, IntArray, RequestFeatures
from tests.unit.snapshots import spec

NAMES = ("a", "b")
FOLLOW_S = 0.01


def arrays(a: int, b: int) -> tuple[IntArray, FloatArray]:
    requests = np.array([a, b], dtype=np.int64)
    floats = np.zeros((FLOAT_ROWS, 2), dtype=np.float64)
    floats[0] = [100.0 * a, 100.0 * b]
    return requests, floats


def test_marks_give_the_state_at_any_instant_and_only_the_needed_ones_are_kept() -> None:
    history = OwnHistory(FOLLOW_S)
    assert history.at(0.0) is None and history.mirrored(0.0, [0.0]) is None
    history.mark(0.0, *arrays(0, 0))
    history.mark(0.001, *arrays(1, 0))
    history.mark(0.001, *arrays(2, 0))  # a second change at the same instant replaces the first
    history.mark(0.0008, *arrays(2, 0))  # an older clock reading too: the marks stay in time order
    assert history.at(0.0005)[0].tolist() == [0, 0]  # type: ignore[index]
    assert history.at(0.001)[0].tolist() == [2, 0]  # type: ignore[index]
    assert history.at(-1.0)[0].tolist() == [0, 0]  # type: ignore[index]  # before all: the earliest
    history.mark(0.05, *arrays(5, 0))  # 0.0 and 0.001 are older than 0.07 - follow_s ...
    history.mark(0.07, *arrays(6, 0))  # ... and 0.05 is the latest such: kept, the others gone
    assert history.at(0.0)[0].tolist() == [5, 0]  # type: ignore[index]
    history.clear()
    assert history.at(0.07) is None
    with pytest.raises(ValueError, match="follow_s"):
        OwnHistory(0.0)


def test_each_peer_gets_the_own_change_since_its_summary_or_the_window_start() -> None:
    history = OwnHistory(FOLLOW_S)
    history.mark(-1.0, *arrays(2, 2))
    history.mark(0.002, *arrays(3, 2))
    history.mark(0.005, *arrays(5, 2))
    # Summaries arrived at 0.0 and at 0.004: since then this replica went 2 -> 5 and 3 -> 5 on a.
    mirrored = history.mirrored(0.006, [0.0, 0.004])
    assert mirrored is not None
    assert mirrored[0].tolist() == [(5 - 2) + (5 - 3), 0.0]
    assert mirrored[1][0].tolist() == [100.0 * 5, 0.0]
    # Much later, with no new summary: only the change within the last follow_s is mirrored.
    history.mark(0.1, *arrays(9, 2))
    history.mark(0.104, *arrays(10, 2))
    late = history.mirrored(0.105, [0.0, 0.004])
    assert late is not None and late[0].tolist() == [10.0, 0.0]  # 5 at 0.095 -> 10 now, per peer
    assert history.mirrored(0.2, [0.0, 0.004]) is None  # no own change within the window: nothing
    assert history.mirrored(0.105, []) is None


def feats(k: int) -> RequestFeatures:
    return RequestFeatures(f"r{k}", "m", "openai", 100, None, 50)


def router(replica: str, clock: ManualClock, follow_s: float) -> Router:
    backends = tuple(spec(name, models=("m",)) for name in NAMES)
    return Router(
        backends,
        build_policy("round_robin", {}, PolicyContext(backends)),
        Ledger(list(NAMES)),
        clock,
        peers=PeerView(replica, NAMES, stale_s=0.3, follow_s=follow_s),
    )


@pytest.mark.parametrize("follow_s", [FOLLOW_S, 0.0])
def test_a_burst_before_any_summary_counts_the_peer_as_having_done_the_same(follow_s: float) -> None:
    clock = ManualClock()
    first, second = router("r1", clock, follow_s), router("r2", clock, follow_s)
    first.receive(second.publish())  # the replicas were up before the traffic: heartbeats
    second.receive(first.publish())
    clock.set(0.001)
    tickets = [first.route(feats(k)) for k in range(4)]  # round robin: a, b, a, b
    seen = first.snapshot().requests_in_flight.tolist()
    assert seen == ([4, 4] if follow_s else [2, 2])  # mirrored: the peer took a like burst
    # The peer's summary says it took nothing: its word replaces the mirror.
    clock.set(0.003)
    first.receive(second.publish())
    assert first.snapshot().requests_in_flight.tolist() == [2, 2]
    # Releases are mirrored too, never below what the summaries say.
    clock.set(0.004)
    for t in tickets:
        first.release(t)
    assert first.snapshot().requests_in_flight.tolist() == [0, 0]
    assert first.ledger.is_zero() and second.ledger.is_zero()


def test_without_a_current_summary_nothing_is_mirrored() -> None:
    clock = ManualClock()
    first = router("r1", clock, FOLLOW_S)
    ticket = first.route(feats(0))
    assert first.snapshot().requests_in_flight.tolist() == [1, 0]
    first.release(ticket)
