"""The admission queue's "full" test on backends whose sequence limit no config gives
(hetroute.admission.full): the engine-queue test and the observed sequence limit, through the real
Router, Ledger and default policy."""

from __future__ import annotations

from collections.abc import Callable
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


def limit_of(router: Router, placer: Placer) -> float:
    idx = np.array(router.serving("m", "openai"), dtype=np.int64)
    return float(placer.observed_seqs.limits(router, placer.models, router.snapshot(), idx)[0])


def see(router: Router, placer: Placer, scrapes: Scrapes, running: float, waiting: float) -> float:
    """One scrape, read as the queue reads it at its next placement; the limit after it."""
    scrapes.publish(0, running=running, waiting=waiting)
    return limit_of(router, placer)


def test_a_queue_seen_at_a_scrape_sets_the_limit_and_a_finish_reopens_the_backend() -> None:
    router, placer, scrapes = make()
    tickets = place_all(placer, 6)  # nothing known: neither a sequence limit nor a queue seen
    see(router, placer, scrapes, 4.0, 2.0)  # the engine could start only 4 of the 6 ...
    assert see(router, placer, scrapes, 4.0, 2.0) == 5.0  # ... and still only 4 at the next scrape
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


def test_the_observed_limit_follows_the_running_count_two_scrapes_confirm() -> None:
    router, placer, scrapes = make()
    tickets = place_all(placer, 4)
    see(router, placer, scrapes, 3.0, 1.0)
    assert see(router, placer, scrapes, 3.0, 1.0) == 4.0
    assert placer.place(feats(4), 1, CLASS) is None  # limit 3 + 1 reached
    # once at the limit with nothing waiting: not yet a contradiction
    assert see(router, placer, scrapes, 4.0, 0.0) == 4.0
    assert placer.place(feats(5), 1, CLASS) is None
    assert see(router, placer, scrapes, 4.0, 1.0) == 4.0  # the engine ran one more ...
    assert see(router, placer, scrapes, 4.0, 1.0) == 5.0  # ... at two scrapes in a row: the limit follows
    tickets += place_all(placer, 1, start=6)
    assert placer.place(feats(7), 1, CLASS) is None  # 5 in flight = 4 + 1
    for t in tickets:
        router.release(t)


def test_a_queue_seen_once_during_a_ramp_sets_no_limit_and_a_contradicted_limit_grows() -> None:
    """A burst of dispatches shows a queue the engine works off at its next steps (vLLM admits new
    prompts up to a per-step token budget): one such scrape, or two with a growing running count,
    must not cap the backend (a real run was held at 110 of 256 sequences). A limit the engine then
    reaches with nothing waiting, at two scrapes in a row, grows by an eighth."""
    router, placer, scrapes = make()
    tickets = place_all(placer, 12)
    assert see(router, placer, scrapes, 5.0, 7.0) == np.inf
    assert see(router, placer, scrapes, 9.0, 3.0) == np.inf  # still ramping up: no limit
    assert see(router, placer, scrapes, 12.0, 0.0) == np.inf  # it started them all
    tickets += place_all(placer, 4, start=12)  # so more get through
    assert see(router, placer, scrapes, 12.0, 4.0) == np.inf
    assert see(router, placer, scrapes, 12.0, 4.0) == 13.0  # a queue at the same count twice
    for t in tickets[13:]:
        router.release(t)
    tickets = tickets[:13]
    assert placer.place(feats(16), 1, CLASS) is None  # 13 in flight = 12 + 1
    assert see(router, placer, scrapes, 13.0, 0.0) == 13.0  # the engine runs all 13, nothing waits ...
    assert see(router, placer, scrapes, 13.0, 0.0) == 15.0  # ... twice: it could run more (12 + 2 + 1)
    tickets += place_all(placer, 2, start=20)  # more than the old limit gets through
    assert placer.place(feats(22), 1, CLASS) is None  # and no more than the new one
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()


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
    see(router, placer, scrapes, 3.0, 1.0)
    see(router, placer, scrapes, 3.0, 1.0)
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


def _fast_and_blind(
    slow_learned: Callable[[tuple[float, ...]], tuple[float, ...]], fast_seqs: int = 1
) -> tuple[Placer, tuple[float, ...]]:
    """A Placer over `fast` (H100, roofline prior, ``fast_seqs`` sequences at a time) and `slow`
    (nothing known: the neutral default, 64 sequences), with live models that have learned
    ``slow_learned(neutral)`` for `slow`; and the neutral default's p1..p8."""
    from hetroute.learning.live import LiveModels, PriorModel
    from hetroute.learning.settings import LearningConfig
    from hetroute.policies.backend_model import BackendModels

    fast = replace(spec("fast", models=("Llama-3-8B",)), gpu="H100-SXM", tp=1, max_num_seqs=fast_seqs)
    slow = replace(spec("slow", models=("Llama-3-8B",)), max_num_seqs=64)
    backends = [fast, slow]
    static = BackendModels.from_specs(backends).params
    fast_p = tuple(float(v) for v in static[0])
    neutral = tuple(float(v) for v in static[1])
    priors = [PriorModel(fast_p, "roofline", "roofline"), PriorModel(neutral, "default", "neutral")]
    learner = LiveModels(
        ["fast", "slow"], priors, [1e6, 1e6], [1.0, 64.0], LearningConfig(), [fast_p, slow_learned(neutral)]
    )
    router = Router(
        backends,
        build_policy("default", {}, PolicyContext(tuple(backends))),
        Ledger(["fast", "slow"]),
        ManualClock(),
        learner=learner,
    )
    return Placer(router, FullConfig()), neutral


def _spill_outcome(
    placer: Placer, first: RequestFeatures, second: RequestFeatures, waiting: int
) -> str | None:
    """Place ``first`` (it must go to the empty `fast`, which it fills), then ``second`` with ``waiting``
    requests queued: the backend it spilled to, or None when it waits."""
    ticket = placer.place(first, 1, CLASS)
    assert ticket is not None and ticket.backend_name == "fast"
    spilled = placer.place(second, waiting, CLASS)
    return None if spilled is None else spilled.backend_name


def test_the_spill_test_prices_the_learned_latency_model_not_the_static_prior() -> None:
    """Nothing known of `slow` (no GPU: the neutral default, 20 ms a step). What the learner has
    learned of it decides whether a long request spills there: learned 5 s a step, it waits for the
    full `fast` backend; learned as the default, it goes. (The spill test once read the static
    prior only: the neutral default under-priced a learned slow backend 4-8×.)"""

    def outcome(slow_learned: Callable[[tuple[float, ...]], tuple[float, ...]]) -> str | None:
        placer, neutral = _fast_and_blind(slow_learned)
        assert neutral[7] == 0.02 and neutral[4:7] == (0.0, 0.0, 0.0)  # the default nothing-known model
        r0 = RequestFeatures("r0", "Llama-3-8B", "openai", 1000, 2000, 2000)
        r1 = RequestFeatures("r1", "Llama-3-8B", "openai", 1000, 2000, 2000)
        return _spill_outcome(placer, r0, r1, 100)

    assert outcome(lambda neutral: (*neutral[:7], 5.0)) is None  # 2,000 steps of 5 s: `fast` frees first
    assert outcome(lambda neutral: neutral) == "slow"


def test_a_spilled_request_is_priced_at_the_margin_times_its_output_unless_max_tokens_caps_it() -> None:
    """The tail test prices a request as if it generated ``spill_margin`` (3) times its predicted
    output, on every backend, since a long answer on a slow backend is what ends a run late, but
    never more than its ``max_tokens``. `slow` is learned at 18 ms a step, `fast` runs about 11 ms:
    over 600 steps `slow` takes 4.3 s longer, more than the 2.2 s the full `fast` needs to free a
    slot; over 200 steps 1.5 s longer. So with the same prediction (200 tokens) a request without a
    limit waits for `fast`, and one whose ``max_tokens`` of 200 proves it short spills."""

    def outcome(max_tokens: int | None) -> str | None:
        placer, _ = _fast_and_blind(lambda neutral: (*neutral[:7], 0.018))
        assert placer.config.spill_margin == 3.0
        r0 = RequestFeatures("r0", "Llama-3-8B", "openai", 1000, 200, 200)
        r1 = RequestFeatures("r1", "Llama-3-8B", "openai", 1000, max_tokens, 200)
        return _spill_outcome(placer, r0, r1, 1)

    assert outcome(None) is None
    assert outcome(200) == "slow"
    assert outcome(2000) is None  # a loose limit proves nothing


def test_arrivals_that_keep_up_with_the_full_backends_make_any_backlog_long_enough_to_spill() -> None:
    """The backlog the tail test weighs is ``waiting / (Σ 1/T_r^f − λ)``: with one request queued and
    nothing arriving, `fast` frees a slot in 2.2 s and the request waits for it (as above); while
    requests arrive faster than `fast` serves them (a client that sends a new request per answer),
    the queue never drains, `fast` stays busy whatever happens, and the request spills to `slow`."""

    def outcome(arrivals: int) -> str | None:
        placer, _ = _fast_and_blind(lambda neutral: (*neutral[:7], 0.018))
        r0 = RequestFeatures("r0", "Llama-3-8B", "openai", 1000, 200, 200)
        r1 = RequestFeatures("r1", "Llama-3-8B", "openai", 1000, None, 200)
        for _ in range(arrivals):  # 20 at t = 0: λ = 20 / 5 s = 4/s against 0.45/s on `fast`
            placer.arrived(r1, 0.0)
        return _spill_outcome(placer, r0, r1, 1)

    assert outcome(0) is None
    assert outcome(20) == "slow"


def test_the_tail_test_also_overrides_a_policy_choice_that_has_room() -> None:
    """`fast` runs two sequences and holds one long request (2,000 tokens), so the min-max policy
    picks the empty `slow` for the next one. Priced at 600 tokens, the request takes 11.0 s on
    `slow` and 6.9 s on `fast`. With two requests queued, `fast` is busy for only 2.3 s more (two of
    its 1.15 s amortised slots), and 11.0 s is beyond 2.3 + 1.1 · 6.9 s: the request goes to
    `fast`, which has room (it used to go to `slow`, and a long answer there ended the run late).
    Behind 100 queued requests the policy's choice stands."""

    def outcome(waiting: int) -> str | None:
        placer, _ = _fast_and_blind(lambda neutral: (*neutral[:7], 0.018), fast_seqs=2)
        r0 = RequestFeatures("r0", "Llama-3-8B", "openai", 1000, 2000, 2000)
        r1 = RequestFeatures("r1", "Llama-3-8B", "openai", 1000, None, 200)
        assert placer.place(r0, 1, CLASS) is not None
        assert placer.router.decide(r1)[0].index == 1  # the policy's own choice: `slow`
        ticket = placer.place(r1, waiting, CLASS)
        return None if ticket is None else ticket.backend_name

    assert outcome(2) == "fast"
    assert outcome(100) == "slow"


def test_backends_priced_alike_are_never_too_slow_for_each_other() -> None:
    """Nothing known and nothing learned: every backend has the neutral default's flat 20 ms step.
    The tail test compares backends at the same (margin) output length, so none is slower than
    another and a short queue still spreads over all of them (an earlier form priced only the
    candidate at the margin, the best backend at its prediction, and sent all six to `a`: 52 % of
    the capacity bound on paper-b without a profile)."""
    backends = [spec(n, models=("m",)) for n in ("a", "b", "c")]  # no sequence limit: never full
    router = Router(
        backends,
        build_policy("default", {}, PolicyContext(tuple(backends))),
        Ledger(["a", "b", "c"]),
        ManualClock(),
    )
    placer = Placer(router, FullConfig())
    names = []
    for k in range(6):
        ticket = placer.place(feats(k)._replace(predicted_output_tokens=200), 2, CLASS)
        assert ticket is not None, k
        names.append(ticket.backend_name)
    assert set(names) == {"a", "b", "c"}


def test_sequence_limit_reports_the_configured_limit_else_the_learned_one_else_nan() -> None:
    """``Placer.sequence_limit`` (``hetroute_queue_sequence_limit``): what the fullness test holds a
    backend to, as the queue last read it."""
    configured = make(max_num_seqs=8)[1]
    assert configured.sequence_limit(0) == 8.0
    router, placer, scrapes = make()
    tickets = place_all(placer, 4)
    assert np.isnan(placer.sequence_limit(0))  # nothing configured, nothing learned yet
    see(router, placer, scrapes, 3.0, 1.0)
    assert np.isnan(placer.sequence_limit(0))  # one scrape with a queue teaches nothing
    see(router, placer, scrapes, 3.0, 1.0)
    assert placer.sequence_limit(0) == 4.0  # two in a row: the limit used is R + 1
    assert np.isnan(placer.sequence_limit(1))  # no such slot
    for t in tickets:
        router.release(t)
    assert router.ledger.is_zero()
