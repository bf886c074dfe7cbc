"""The admission queue's "full" test on backends whose sequence limit no config gives
(hetroute.admission.full): the engine-queue test and the observed sequence limit, through the real
Router, Ledger and default policy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hetroute.admission.config import ClassConfig, FullConfig
from hetroute.admission.full import Placer
from hetroute.clock import ManualClock
from hetroute.policies import PolicyContext, build_policy
from hetroute.routing.ledger import Ledger, Ticket
from hetroute.routing.router import Router
from hetroute.types import EngineMetrics, RequestFeatures
from tests.unit.snapshots import spec

CLASS = ClassConfig()


class Scrapes:
    """The latest scrape per backend, as the gateway's MetricsStore holds them."""

    def __init__(self) -> None:
        self.latest: dict[int, EngineMetrics] = {}
        self.at_s = 0.0

    def get(self, i: int) -> EngineMetrics | None:
        return self.latest.get(i)

    def publish(self, i: int, running: float, waiting: float, kv_usage: float | None = None) -> None:
        self.at_s += 1.0
        self.latest[i] = EngineMetrics(
            scraped_at_s=self.at_s,
            num_requests_running=running,
            num_requests_waiting=waiting,
            kv_usage_frac=kv_usage,
        )


def make(max_num_seqs: int | None = None, config: FullConfig | None = None) -> tuple[Router, Placer, Scrapes]:
    backends = [replace(spec("a"), max_num_seqs=max_num_seqs)]
    scrapes = Scrapes()
    router = Router(
        backends,
        build_policy("default", {}, PolicyContext(tuple(backends))),
        Ledger(["a"]),
        ManualClock(),
        latest_metrics=scrapes.get,
    )
    return router, Placer(router, config or FullConfig()), scrapes


def feats(k: int) -> RequestFeatures:
    return RequestFeatures(
        request_id=f"r{k}",
        model="m",
        api="openai",
        input_tokens=20,
        max_tokens=None,
        predicted_output_tokens=10,
    )


def place_all(placer: Placer, n: int, start: int = 0) -> list[Ticket]:
    tickets = []
    for k in range(start, start + n):
        ticket = placer.place(feats(k), 1, CLASS)
        assert ticket is not None, k
        tickets.append(ticket)
    return tickets


def test_a_queue_seen_at_a_scrape_sets_the_limit_and_a_finish_reopens_the_backend() -> None:
    router, placer, scrapes = make()
    tickets = place_all(placer, 6)  # nothing known: neither a sequence limit nor a queue seen
    scrapes.publish(0, running=4.0, waiting=2.0)  # the engine could start only 4 of the 6
    assert placer.place(feats(6), 1, CLASS) is None  # 6 in flight > 4 + 1: full
    router.release(tickets.pop())
    assert placer.place(feats(7), 1, CLASS) is None  # 5 = limit 4 + 1: still full
    router.release(tickets.pop())
    ticket = placer.place(feats(8), 1, CLASS)  # 4 in flight: finishes let the engine start more
    assert ticket is not None and ticket.backend_index == 0
    tickets.append(ticket)
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()


def test_the_observed_limit_grows_by_one_per_scrape_that_shows_a_queue() -> None:
    router, placer, scrapes = make()
    tickets = place_all(placer, 4)
    scrapes.publish(0, running=3.0, waiting=1.0)
    assert placer.place(feats(4), 1, CLASS) is None  # limit 3 + 1 reached
    scrapes.publish(0, running=4.0, waiting=0.0)  # no queue: says nothing of the limit
    assert placer.place(feats(5), 1, CLASS) is None
    scrapes.publish(0, running=4.0, waiting=1.0)  # the engine ran one more: the limit follows
    tickets += place_all(placer, 1, start=6)
    assert placer.place(feats(7), 1, CLASS) is None  # 5 in flight = 4 + 1
    idx = np.array(router.serving("m", "openai"), dtype=np.int64)
    assert placer.observed_seqs.limits(router, placer.models, router.snapshot(), idx).tolist() == [5.0]
    for t in tickets:
        router.release(t)


def test_a_queue_behind_a_full_kv_cache_teaches_no_sequence_limit() -> None:
    router, placer, scrapes = make()
    tickets = place_all(placer, 6)
    scrapes.publish(0, running=4.0, waiting=2.0, kv_usage=0.97)  # the cache was the bound
    idx = np.array(router.serving("m", "openai"), dtype=np.int64)
    assert placer.observed_seqs.limits(router, placer.models, router.snapshot(), idx).tolist() == [np.inf]
    assert placer.place(feats(6), 1, CLASS) is None  # the engine-queue test still holds it back
    router.release(tickets.pop())
    router.release(tickets.pop())
    tickets += place_all(placer, 1, start=7)  # 4 in flight, as many as the engine ran: room again
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()


def test_a_configured_max_num_seqs_is_never_replaced_by_an_observation() -> None:
    router, placer, scrapes = make(max_num_seqs=8)
    tickets = place_all(placer, 6)
    scrapes.publish(0, running=2.0, waiting=4.0)  # a configured limit wins; no engine-queue test
    tickets += place_all(placer, 2, start=6)
    assert placer.place(feats(8), 1, CLASS) is None  # 8 in flight = max_num_seqs
    for t in tickets:
        router.release(t)


def test_an_explicit_engine_waiting_max_tolerates_that_many_queued_requests() -> None:
    router, placer, scrapes = make(max_num_seqs=100, config=FullConfig(engine_waiting_max=2))
    tickets = place_all(placer, 6)
    scrapes.publish(0, running=3.0, waiting=3.0)
    assert placer.place(feats(6), 1, CLASS) is None  # about 3 queued in the engine > 2
    router.release(tickets.pop())
    tickets += place_all(placer, 1, start=7)  # about 2 queued: not more than the limit
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()


def test_a_backend_replaced_at_the_same_name_starts_without_the_old_limit() -> None:
    router, placer, scrapes = make()
    tickets = place_all(placer, 4)
    scrapes.publish(0, running=3.0, waiting=1.0)
    idx = np.array([0], dtype=np.int64)
    assert placer.observed_seqs.limits(router, placer.models, router.snapshot(), idx).tolist() == [4.0]
    for t in tickets:
        router.release(t)
    moved = [replace(spec("a"), url="http://127.0.0.1/elsewhere")]  # same name, another engine
    other = Router(
        moved, build_policy("default", {}, PolicyContext(tuple(moved))), Ledger(["a"]), ManualClock()
    )
    limits = placer.observed_seqs.limits(other, placer.models, other.snapshot(), idx)
    assert limits.tolist() == [np.inf]
