"""Prefix-aware decisions: the default's cost model, the session hint and the three baselines."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from hetroute.clock import ManualClock
from hetroute.errors import ConfigError
from hetroute.latency import LatencyParams
from hetroute.policies import PolicyContext, build_policy
from hetroute.policies.duplicate import most_held_near
from hetroute.policies.workload_minmax import MinMaxPolicy
from hetroute.prefix.hashing import ROUTER_CHUNK_CHARS, text_chunk_hashes
from hetroute.prefix.settings import PrefixConfig
from hetroute.prefix.state import PrefixState
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.types import ClusterSnapshot, EngineMetrics, RequestFeatures
from tests.unit.test_policies_workload import BOTH, FAST, SLOW, TWO, backend, profile, req, snap

PROMPT = "p" * (ROUTER_CHUNK_CHARS * 32)  # 32 chunks, 2,048 tokens at 4 characters per token
HASHES = text_chunk_hashes(PROMPT)


def prefixed(
    rid: str = "r", input_tokens: int = 2048, output: int = 50, session: str = ""
) -> RequestFeatures:
    return req(input_tokens, output, rid)._replace(
        prefix_hashes=HASHES, prefix_chunk_tokens=64.0, session=session
    )


def with_cache(s: ClusterSnapshot, matched: list[float], session_backend: int = -1) -> ClusterSnapshot:
    arr = np.array(matched, dtype=np.float64)
    return s._replace(
        prefix_matched_tokens=arr, prefix_trust=np.ones_like(arr), session_backend=session_backend
    )


def policy(name: str, backends=TWO, **params: object):  # type: ignore[no-untyped-def]
    return build_policy(name, params, PolicyContext(tuple(backends), seed=3))


THREE = np.array([0, 1, 2], dtype=np.int64)


def costs_of(default: MinMaxPolicy, seen: ClusterSnapshot) -> list[float]:
    """T_r^s per candidate of a three-backend fleet for :func:`prefixed`'s request."""
    return list(default.costs(prefixed(), seen, THREE)[0])


def test_a_cached_prefix_wins_between_equal_backends() -> None:
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    for cached_on in (0, 1):
        matched = [0.0, 0.0]
        matched[cached_on] = 2000.0
        decision = policy("balanced_minmax", twins).choose(prefixed(), with_cache(snap(twins), matched), BOTH)
        assert decision.index == cached_on


def test_a_hit_on_a_slow_backend_can_be_worth_less_than_a_miss_on_a_fast_one() -> None:
    """The cost model prices the hit: a short cached head on the 4x slower backend loses to the fast one,
    a cached prompt that leaves little to prefill wins there when the fast backend is busy."""
    default = policy("balanced_minmax")
    small_hit = with_cache(snap(TWO), [0.0, 256.0])
    assert default.choose(prefixed(), small_hit, BOTH).index == 0
    # The fast backend's drain time at which the slow one wins: 3.46 s without the cache, 3.22 s with it.
    busy_fast = with_cache(snap(TWO, workload=[3.3, 0.0]), [0.0, 2000.0])
    without = with_cache(snap(TWO, workload=[3.3, 0.0]), [0.0, 0.0])
    assert default.choose(prefixed(), busy_fast, BOTH).index == 1
    assert default.choose(prefixed(), without, BOTH).index == 0
    # cache_aware follows the match whatever the speed
    assert policy("cache_aware").choose(prefixed(), small_hit, BOTH).index == 0  # 256/2048 < 0.3
    assert policy("cache_aware").choose(prefixed(), with_cache(snap(TWO), [0.0, 1024.0]), BOTH).index == 1


def test_without_shared_prefixes_the_prefix_term_changes_nothing() -> None:
    on, off = policy("balanced_minmax", seed=5), policy("balanced_minmax", seed=5, prefix=False)
    rng = np.random.default_rng(1)
    for k in range(200):
        s = snap(TWO, workload=list(rng.uniform(0, 5, 2)), prefill_pending=list(rng.uniform(0, 9e3, 2)))
        f = req(int(rng.integers(10, 3000)), int(rng.integers(5, 500)), f"r{k}")
        a, b = on.choose(f, with_cache(s, [0.0, 0.0]), BOTH), off.choose(f, s, BOTH)
        assert (a.index, a.workload_cost) == (b.index, b.workload_cost)


def test_the_session_hint_is_soft() -> None:
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    default = policy("balanced_minmax", twins)
    near = snap(twins, workload=[0.0, 0.05])
    assert default.choose(prefixed(session="s"), with_cache(near, [0.0, 0.0], 1), BOTH).index == 1
    far = snap(twins, workload=[0.0, 30.0])
    assert default.choose(prefixed(session="s"), with_cache(far, [0.0, 0.0], 1), BOTH).index == 0
    no_hint = policy("balanced_minmax", twins, session_slack=0.0)
    assert no_hint.choose(prefixed(session="s"), with_cache(near, [0.0, 0.0], 1), BOTH).index == 0


def test_cache_aware_balances_past_its_thresholds() -> None:
    ca = policy("cache_aware")
    hit_on_busy = with_cache(snap(TWO, in_flight=[100, 10]), [2000.0, 0.0])
    assert ca.choose(prefixed(), hit_on_busy, BOTH).index == 1  # 100 − 10 > 64 and 100 > 1.5 · 10
    mild = with_cache(snap(TWO, in_flight=[60, 10]), [2000.0, 0.0])
    assert ca.choose(prefixed(), mild, BOTH).index == 0
    assert ca.choose(req(), snap(TWO, in_flight=[3, 1]), BOTH).index == 1  # no match: least loaded


def test_prefix_scorer_weighs_queue_kv_and_prefix_as_llm_d() -> None:
    ps = policy("prefix_scorer")
    m = (
        EngineMetrics(0.0, num_requests_waiting=4.0, kv_usage_frac=0.5),
        EngineMetrics(0.0, num_requests_waiting=0.0, kv_usage_frac=0.1),
    )
    s = snap(TWO, metrics=m)
    # queue: [0, 1]·2, kv: [0.5, 0.9]·2, prefix: [1, 0]·3 → [4.0, 3.8]
    assert np.allclose(ps.scores(prefixed(), with_cache(s, [2048.0, 0.0]), BOTH), [4.0, 3.8])
    assert ps.choose(prefixed(), with_cache(s, [2048.0, 0.0]), BOTH).index == 0
    assert ps.choose(prefixed(), with_cache(s, [1024.0, 0.0]), BOTH).index == 1


def test_session_hash_is_stable_and_moves_few_keys() -> None:
    four = tuple(backend(n) for n in "abcd")
    sh, sh3 = policy("session_hash", four), policy("session_hash", four)
    idx4, idx3 = np.arange(4), np.array([0, 1, 2])
    moved = 0
    for k in range(400):
        f = req(rid=f"r{k}")._replace(session=f"user-{k}")
        first = sh.choose(f, snap(four), idx4).index
        assert sh.choose(f, snap(four), idx4).index == first
        if sh3.choose(f, snap(four), idx3).index != first:
            moved += 1
            assert first == 3  # only keys of the removed backend move
    assert 50 < moved < 160


def test_the_router_records_dispatches_and_counts_only_uncached_prefill() -> None:
    clock = ManualClock()
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(SLOW, 400_000)))
    ledger = Ledger(["a", "b"])
    state = PrefixState(2, PrefixConfig())
    router = Router(twins, policy("balanced_minmax", twins), ledger, clock, prefix=state)
    first = router.route(prefixed("r1", session="u"))
    assert first.prefill_tokens == 2048 and ledger.prefill_pending_tokens[first.backend_index] == 2048
    clock.advance(1.0)
    decision, seen = router.decide(prefixed("r2", session="u"))
    assert seen.prefix_matched_tokens is not None
    assert seen.prefix_matched_tokens[first.backend_index] == 2047  # capped at I − 1, as vLLM
    assert seen.session_backend == first.backend_index
    second = router.commit(prefixed("r2", session="u"), decision, seen)
    assert second.backend_index == first.backend_index and second.prefill_tokens == 1
    for t in (first, second):
        router.release(t)
    assert ledger.is_zero() and math.isclose(state.index.chunks(first.backend_index), 32)


def test_a_backend_far_busier_than_the_least_loaded_loses_its_cache_credit() -> None:
    """The balance guard: a hot prefix cannot keep pulling requests onto one backend far busier than the
    others."""
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    default = policy("balanced_minmax", twins)
    near = with_cache(snap(twins, workload=[0.3, 0.0]), [2000.0, 0.0])
    assert default.choose(prefixed(), near, BOTH).index == 0  # within the band: the cache wins
    busy = snap(twins, workload=[2.5, 0.0])
    assert default.costs(prefixed(), with_cache(busy, [2000.0, 0.0]), BOTH)[0].tolist() == (
        default.costs(prefixed(), with_cache(busy, [0.0, 0.0]), BOTH)[0].tolist()
    )  # 2.5 s > 0 · 1.5 + 2.0 s: no credit for the cached prompt on the busy backend
    assert default.choose(prefixed(), with_cache(busy, [2000.0, 0.0]), BOTH).index == 1


def test_the_guard_measures_against_the_next_busiest_backend_not_an_idle_slow_one() -> None:
    """On a mixed fleet the latency floor keeps a slow backend light, so its drain time is no measure
    of balance: two equally busy fast backends keep their cache credit while the slow one idles (the
    guard measured against the least loaded took it from them). Only a backend far busier than every
    other loses it."""
    fleet = (
        backend("a", profile(FAST, 400_000)),
        backend("b", profile(FAST, 400_000)),
        backend("slow", profile(SLOW, 400_000)),
    )
    default = policy("balanced_minmax", fleet)

    def costs(workload: list[float], matched: list[float]) -> list[float]:
        return costs_of(default, with_cache(snap(fleet, workload=workload), matched))

    busy_pair = [3.0, 3.0, 0.0]
    assert costs(busy_pair, [2000.0, 0.0, 0.0])[0] < costs(busy_pair, [0.0, 0.0, 0.0])[0]  # credit kept
    decision = default.choose(
        prefixed(), with_cache(snap(fleet, workload=busy_pair), [2000.0, 0.0, 0.0]), THREE
    )
    assert decision.index == 0
    hot = [5.0, 1.0, 0.0]  # 5.0 s > 1.0 · 1.5 + 2.0 s: the one far busier backend loses its credit
    assert costs(hot, [2000.0, 0.0, 0.0]) == costs(hot, [0.0, 0.0, 0.0])
    assert costs(hot, [0.0, 2000.0, 0.0])[1] < costs(hot, [0.0, 0.0, 0.0])[1]


def test_a_backlog_of_waiting_prompts_takes_the_cache_credit_without_a_latency_model() -> None:
    """The guard on pending prefill tokens: a backend whose prompts waiting for a first token exceed every
    other candidate's by more than 50 % and 32,768 tokens loses its cache credit even when the model's
    drain times are level (a neutral prior misjudges them; the ledger's tokens it cannot)."""
    fleet = (
        backend("a", profile(FAST, 400_000)),
        backend("b", profile(FAST, 400_000)),
        backend("c", profile(FAST, 400_000)),
    )
    default = policy("balanced_minmax", fleet)

    def seen(pending: list[float], matched: list[float]) -> ClusterSnapshot:
        return with_cache(snap(fleet, workload=[1.0, 1.0, 1.0], prefill_pending=pending), matched)

    def costs(pending: list[float], matched: list[float]) -> list[float]:
        return costs_of(default, seen(pending, matched))

    cached, none = [2000.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    backlog = [80_000.0, 10_000.0, 0.0]  # 80,000 > 10,000 · 1.5 + 32,768
    assert costs(backlog, cached) == costs(backlog, none)
    assert default.choose(prefixed(), seen(backlog, cached), THREE).index != 0
    for level in ([40_000.0, 10_000.0, 0.0], [80_000.0, 40_000.0, 0.0]):  # within the band
        assert costs(level, cached)[0] < costs(level, none)[0]
    assert costs(backlog, [0.0, 2000.0, 0.0])[1] < costs(backlog, none)[1]  # only the backlogged one


def test_without_a_prefill_queue_price_each_excess_waiting_token_cancels_a_cached_token() -> None:
    """A backend nothing is known about is priced by the neutral default until its first fit; that model
    has no batched prefill cost (p1 = 0), so the floor has no queue term, and a cached prefix would pull
    every request sharing it into a queue nothing prices. On such a backend the credit is the cached
    tokens less the prompt tokens it has waiting beyond the least-waiting candidate (never below 0);
    a backend whose model prices the queue (p1 > 0, profiled or fitted) keeps the whole credit."""
    unknown = (backend("a"), backend("b"), backend("c"))  # no profile, no GPU label: the neutral default
    default = policy("balanced_minmax", unknown)

    def seen(
        pending: list[float], matched: list[float], learned: np.ndarray | None = None
    ) -> ClusterSnapshot:
        s = snap(unknown, workload=[1.0, 0.9, 0.9], prefill_pending=pending)
        return with_cache(s._replace(latency_params=learned), matched)

    def costs(pending: list[float], matched: list[float], learned: np.ndarray | None = None) -> list[float]:
        return costs_of(default, seen(pending, matched, learned))

    cached, none = [2000.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    level = [500.0, 500.0, 500.0]
    assert costs([1500.0, 500.0, 500.0], cached) == costs(level, [1000.0, 0.0, 0.0])  # 1,000 in excess
    assert costs([3000.0, 500.0, 500.0], cached) == costs(level, none)  # 2,500 in excess: no credit
    assert costs(level, cached)[0] < costs(level, none)[0]
    assert default.choose(prefixed(), seen(level, cached), THREE).index == 0
    lat = default.latency(prefixed(), seen([3000.0, 500.0, 500.0], cached), THREE)
    assert lat[0] == lat[1] == lat[2]  # no queue term and no credit left: level floors
    fitted = np.array([FAST.as_tuple()] * 3)  # a first fit gives p1 > 0: the floor prices the queue
    assert costs([3000.0, 500.0, 500.0], cached, fitted)[0] < costs([3000.0, 500.0, 500.0], none, fitted)[0]
    profiled = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    both = with_cache(snap(profiled, prefill_pending=[3000.0, 500.0]), [2000.0, 0.0])
    assert policy("balanced_minmax", profiled).choose(prefixed(), both, BOTH).index == 0


def test_the_saved_prefill_counts_cache_weight_times_where_the_min_max_is_indifferent() -> None:
    """``cache_weight`` F (default 3): between equal backends, the one holding r's prefix keeps r while its
    drain time exceeds the other's by less than F times the prefill the hit saves (once with F = 1); the
    min-max score still never falls below a backend's own drain time, and the ledger is charged r's true
    cost. (Equal backends are peers, where ``peer_latency``, on by default, would let r's own latency
    decide: off here, as on any fleet of unequal backends.)"""
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    default = policy("balanced_minmax", twins, peer_latency=False)
    plain = policy("balanced_minmax", twins, cache_weight=1.0, peer_latency=False)
    cached = with_cache(snap(twins), [0.0, 2000.0])
    w_hit = float(default.costs(prefixed(), cached, BOTH)[2][1])
    w_full = float(default.costs(prefixed(), with_cache(snap(twins), [0.0, 0.0]), BOTH)[2][1])
    saved = w_full - w_hit
    assert saved > w_hit > 0.0

    def home_ahead_by(excess_s: float) -> ClusterSnapshot:
        return with_cache(snap(twins, workload=[10.0, 10.0 + excess_s]), [0.0, 2000.0])

    assert plain.choose(prefixed(), home_ahead_by(0.5 * saved), BOTH).index == 1
    assert plain.choose(prefixed(), home_ahead_by(1.5 * saved), BOTH).index == 0
    decision = default.choose(prefixed(), home_ahead_by(2.5 * saved), BOTH)
    assert decision.index == 1 and math.isclose(decision.workload_cost, w_hit)
    assert decision.scores["minmax_load"] >= 10.0 + 2.5 * saved  # not below the home's own drain time
    assert default.choose(prefixed(), home_ahead_by(3.5 * saved), BOTH).index == 0


def test_between_peers_a_hit_counts_peer_prefill_weight_times_against_the_prompts_waiting_ahead() -> None:
    """``peer_latency`` (on by default): among peers the floor decides with r's own prefill counted
    ``peer_prefill_weight`` (F_p; 3 here, the default until stop 41, with no extra queue weight)
    times instead of κ (8), so a hit is not bought with a long wait. Backend a holds 2,000 of r's
    2,048 prompt tokens (saving 0.06 s of prefill) but has 39,000 more prompt tokens (0.39 s) waiting
    than b, which holds nothing: 0.39 s of wait against (1 + F_p) × 0.06 s of prefill sends r to b,
    against (1 + κ) × 0.06 s (F_p = κ) to a. (Under the balance guard on waiting prompts, so the
    credit stands.)"""
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    seen = with_cache(snap(twins, prefill_pending=[79_000.0, 40_000.0]), [2000.0, 0.0])
    saved = (FAST.p1 + FAST.p3) * 2000
    assert 4 * saved < FAST.p1 * 39_000 < 9 * saved
    default = policy("balanced_minmax", twins, peer_prefill_weight=3.0, peer_queue_weight=0.0)
    decision = default.choose(prefixed(), seen, BOTH)
    assert decision.index == 1 and decision.reason.startswith("peer latency ")
    assert default.choose_vectorised(prefixed(), seen, BOTH).reason == decision.reason
    assert (
        policy("balanced_minmax", twins, peer_prefill_weight=8.0, peer_queue_weight=0.0)
        .choose(prefixed(), seen, BOTH)
        .index
        == 0
    )
    # κ = 0 (no κ term in the floor): among peers r's prefill still counts F times, in both paths
    plain_floor = policy(
        "balanced_minmax", twins, ttft_weight=0.0, peer_prefill_weight=3.0, peer_queue_weight=0.0
    )
    assert plain_floor.choose(prefixed(), seen, BOTH).index == 1
    assert (
        plain_floor.choose_vectorised(prefixed(), seen, BOTH).reason
        == plain_floor.choose(prefixed(), seen, BOTH).reason
    )
    # the same fleet without the cached prefix: nothing to trade, the less busy backend takes r
    assert default.choose(prefixed(), with_cache(seen, [0.0, 0.0]), BOTH).index == 1


def test_between_peers_peer_queue_weight_counts_the_wait_ahead_more_times() -> None:
    """``peer_queue_weight`` X: among peers the wait behind the prompts already queued, p1 · P_s,
    counts 1 + X times against r's saved prefill, counted 1 + F_p times. Backend a holds 2,000 of r's
    tokens and has a wait of 2.5 times the saving more than b: with F_p = 3, (1 + 3) × saving keeps r
    on a with X = 0, and (1 + 1.5) × 2.5 × saving sends it to b, the same in both paths; the default
    since stop 41 (F_p = 6, X = 1.5) keeps it on a, (1 + 6) × saving > 2.5 × 2.5 × saving."""
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    saved = (FAST.p1 + FAST.p3) * 2000
    excess = 2.5 * saved / FAST.p1
    seen = with_cache(snap(twins, prefill_pending=[40_000.0 + excess, 40_000.0]), [2000.0, 0.0])
    assert (
        policy("balanced_minmax", twins, peer_prefill_weight=3.0, peer_queue_weight=0.0)
        .choose(prefixed(), seen, BOTH)
        .index
        == 0
    )
    waits = policy("balanced_minmax", twins, peer_prefill_weight=3.0, peer_queue_weight=1.5)
    decision = waits.choose(prefixed(), seen, BOTH)
    assert decision.index == 1 and decision.reason.startswith("peer latency ")
    assert waits.choose_vectorised(prefixed(), seen, BOTH).reason == decision.reason
    option = policy("balanced_minmax", twins)
    assert (option.peer_prefill_weight, option.peer_queue_weight) == (6.0, 1.5)
    assert option.choose(prefixed(), seen, BOTH).index == 0
    assert option.choose_vectorised(prefixed(), seen, BOTH).index == 0
    # without a queue term in the floor (prefill_queue false) X still weighs the wait among peers
    no_term = policy("balanced_minmax", twins, prefill_queue=False, peer_prefill_weight=3.0)
    assert (
        no_term.choose(prefixed(), seen, BOTH).reason
        == no_term.choose_vectorised(prefixed(), seen, BOTH).reason
    )
    with pytest.raises(ConfigError, match="peer_queue_weight"):
        policy("balanced_minmax", twins, peer_queue_weight=-1.0)


def test_among_peers_whose_batches_are_all_full_the_queued_prompts_count_once() -> None:
    """X prices the wait behind the queued prompts, which r shares once it is in the batch. With every
    peer's batch full (in flight ≥ max_num_seqs: a burst) r first waits for the work ahead, and X counts
    for nothing (``peers.slots_taken``). The fleet of the test above: X = 1.5 sends r to b; with both
    batches full r stays on a, as with X = 0, in both paths; with a free slot on either, X counts again."""
    twins = (backend("a", profile(FAST, 400_000)), backend("b", profile(FAST, 400_000)))
    saved = (FAST.p1 + FAST.p3) * 2000
    excess = 2.5 * saved / FAST.p1
    waits = policy("balanced_minmax", twins, peer_prefill_weight=3.0, peer_queue_weight=1.5)
    no_x = policy("balanced_minmax", twins, peer_prefill_weight=3.0, peer_queue_weight=0.0)
    seqs = int(waits.models.max_num_seqs[0])

    def seen(in_flight: list[int]) -> ClusterSnapshot:
        pending = [40_000.0 + excess, 40_000.0]
        return with_cache(snap(twins, in_flight=in_flight, prefill_pending=pending), [2000.0, 0.0])

    full = seen([seqs, seqs])
    decision = waits.choose(prefixed(), full, BOTH)
    assert decision.index == 0
    assert decision.reason == no_x.choose(prefixed(), full, BOTH).reason
    assert waits.choose_vectorised(prefixed(), full, BOTH).reason == decision.reason
    for free in ([seqs - 1, seqs], [seqs, seqs - 1]):
        decision = waits.choose(prefixed(), seen(free), BOTH)
        assert decision.index == 1, free
        assert waits.choose_vectorised(prefixed(), seen(free), BOTH).reason == decision.reason


def test_cached_tokens_are_trust_times_matched_for_every_backend_or_a_subset() -> None:
    """``prefix_cached_tokens`` gives ``trust · matched`` per candidate, whether the candidates are every
    backend (taken without gathers) or some of them, and None when nothing is matched."""
    backends = (backend("a", profile(FAST, 400_000)), backend("b", profile(SLOW, 400_000)), backend("c"))
    s = snap(backends)._replace(
        prefix_matched_tokens=np.array([640.0, 0.0, 128.0]), prefix_trust=np.array([0.5, 1.0, 0.25])
    )
    untrusted = s._replace(prefix_trust=None)
    for seen, idx, expected in (
        (s, THREE, [320.0, 0.0, 32.0]),
        (s, [0, 2], [320.0, 32.0]),
        (s, [1], [0.0]),
        (untrusted, THREE, [640.0, 0.0, 128.0]),
        (untrusted, [2], [128.0]),
    ):
        cached = seen.prefix_cached_tokens(np.asarray(idx, dtype=np.int64))
        assert cached is not None and cached.tolist() == expected
    assert s._replace(prefix_matched_tokens=None).prefix_cached_tokens(THREE) is None


MID = LatencyParams(*(2 * p for p in FAST.as_tuple()))
LONG_PROMPT = "q" * (ROUTER_CHUNK_CHARS * 160)  # 160 chunks: 10,240 tokens at 64 tokens a chunk
LONG_HASHES = text_chunk_hashes(LONG_PROMPT)


def long_request(rid: str = "r") -> RequestFeatures:
    return req(10_240, 50, rid)._replace(prefix_hashes=LONG_HASHES, prefix_chunk_tokens=64.0)


def test_a_fresh_long_prompt_is_placed_by_drain_time_among_backends_near_the_fastest() -> None:
    """``fresh_prompt_tokens`` (N = 7,168) and ``fresh_near_ratio`` (ρ = 3): a 10,240-token prompt whose
    head (512 tokens) only is cached somewhere leaves ≥ N tokens cached nowhere, so its κ term is 0 on
    the backends prefilling it within 3 × the fastest one's time (fast, and mid at 2 ×) and κ times the
    excess over the fastest on the 4 × slower one. With κ on every backend the busy fast one takes it
    (κ · 0.31 s of its own prefill outweighs 2 s of drain time); as a fresh prompt the idle mid one
    does. A slower backend keeps its penalty: with fast and mid both busy, r stays off the idle slow
    one, which it would join if its κ term were dropped as well."""
    fleet = (
        backend("fast", profile(FAST, 800_000)),
        backend("mid", profile(MID, 800_000)),
        backend("slow", profile(SLOW, 800_000)),
    )
    default = policy("balanced_minmax", fleet)
    off = policy("balanced_minmax", fleet, fresh_prompt_tokens=0)
    no_slow_penalty = policy("balanced_minmax", fleet, fresh_near_ratio=10.0)
    head = [512.0, 0.0, 0.0]

    def seen(workload: list[float], matched: list[float] = head) -> ClusterSnapshot:
        return with_cache(snap(fleet, workload=workload), matched)

    fast_busy = seen([2.0, 0.0, 0.0])
    assert off.choose(long_request(), fast_busy, THREE).index == 0
    decision = default.choose(long_request(), fast_busy, THREE)
    assert decision.index == 1
    assert default.choose_vectorised(long_request(), fast_busy, THREE).reason == decision.reason
    # most of the prompt cached on fast: not fresh (10,240 − 6,144 < N), κ keeps it there
    assert default.choose(long_request(), seen([2.0, 0.0, 0.0], [6144.0, 0.0, 0.0]), THREE).index == 0
    # the head cached nowhere: the decision without the prefix term, as for any unshared prompt
    bare = snap(fleet, workload=[2.0, 0.0, 0.0])
    assert (
        default.choose(long_request(), bare, THREE).index
        == off.choose(long_request(), bare, THREE).index
        == 0
    )
    both_busy = seen([3.0, 3.0, 0.0])
    assert default.choose(long_request(), both_busy, THREE).index == 0
    assert no_slow_penalty.choose(long_request(), both_busy, THREE).index == 2
    knobs = (default.fresh_prompt_tokens, default.fresh_near_ratio, default.fresh_queue_weight)
    assert knobs == (7168, 3.0, 1.5)
    assert policy("workload_minmax", fleet).fresh_prompt_tokens == 0  # off outside balanced_minmax
    for bad in ({"fresh_near_ratio": 0.5}, {"fresh_prompt_tokens": -1}, {"fresh_queue_weight": -1.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            policy("balanced_minmax", fleet, **bad)
    with pytest.raises(ConfigError, match="fresh_prompt_tokens"):
        policy("memory_minmax", fleet, fresh_prompt_tokens=100)  # no prefill term to change


def test_among_peers_a_fresh_prompt_decides_as_any_other() -> None:
    """Among peers κ plays no part (``peer_latency`` prices r's own prefill F_p times instead), so the
    fresh-prompt rule leaves their decisions as they were."""
    assert_peers_decide_as_without({"fresh_prompt_tokens": 0}, lambda rng: [512.0, 0.0, 0.0], seed=7)


def assert_peers_decide_as_without(
    off_params: dict[str, object], matched: Callable[[np.random.Generator], list[float]], seed: int
) -> None:
    """On three equal backends (peers), 50 random loads and queues with ``matched`` tokens cached: the
    default decides exactly as with ``off_params``."""
    peers = tuple(backend(n, profile(FAST, 800_000)) for n in "abc")
    default = policy("balanced_minmax", peers)
    off = policy("balanced_minmax", peers, **off_params)
    rng = np.random.default_rng(seed)
    for k in range(50):
        s = with_cache(
            snap(peers, workload=list(rng.uniform(0, 3, 3)), prefill_pending=list(rng.uniform(0, 3e4, 3))),
            matched(rng),
        )
        a, b = default.choose(long_request(f"r{k}"), s, THREE), off.choose(long_request(f"r{k}"), s, THREE)
        assert (a.index, a.reason, a.workload_cost) == (b.index, b.reason, b.workload_cost)


def test_fresh_queue_weight_counts_the_prompts_queued_ahead_of_a_fresh_prompt_more_times() -> None:
    """``fresh_queue_weight`` (X_f, 1.5 in ``balanced_minmax``): a fresh prompt's floor counts the prompts
    already waiting for a first token 1 + X_f times. With 80,000 prompt tokens waiting on the fast
    backend (0.8 s at p1) and none on the 2 × slower one, counted once (X_f = 0) they still leave r on
    the fast one, whose drain time is lower; the default's X_f = 1.5 sends it to the other. (The floor's
    queue term is on, as by default.)"""
    pair = (backend("fast", profile(FAST, 800_000)), backend("mid", profile(MID, 800_000)))
    seen = with_cache(snap(pair, workload=[1.0, 1.6], prefill_pending=[80_000.0, 0.0]), [512.0, 0.0])
    once = policy("balanced_minmax", pair, fresh_queue_weight=0.0)
    weighted = policy("balanced_minmax", pair)
    assert once.choose(long_request(), seen, BOTH).index == 0
    decision = weighted.choose(long_request(), seen, BOTH)
    assert decision.index == 1
    assert weighted.choose_vectorised(long_request(), seen, BOTH).reason == decision.reason


def test_duplicate_weight_prices_prefilling_again_what_another_backend_holds() -> None:
    """``duplicate_weight`` (κ_d, 16 in ``balanced_minmax``): outside peers, the prefill of the tokens
    another candidate near the fastest holds counts κ_d more times in the floor. Both backends idle, the
    2 × slower one holding 4,096 of a 10,240-token prompt (not fresh: 6,144 < N tokens cached nowhere):
    r's own latency alone (κ_d = 0) prefers the fast one's full prefill, 9 · T(10,240) against
    9 · 2 · T(6,144); priced as a duplicate of the 4,096 held tokens the fast one costs 16 · T(4,096)
    more and the holder takes r. The holder pays nothing; with nothing held anywhere, for a fresh prompt
    (3,072 held: 7,168 cached nowhere, placed by drain time, :mod:`~hetroute.policies.fresh`) and where
    the holder is not near the fastest backend (4 × slower, ρ = 3) the term is absent."""
    pair = (backend("fast", profile(FAST, 800_000)), backend("mid", profile(MID, 800_000)))
    default = policy("balanced_minmax", pair)
    off = policy("balanced_minmax", pair, duplicate_weight=0.0)
    assert default.duplicate_weight == 16.0 and off.duplicate_weight == 0.0
    held = with_cache(snap(pair), [0.0, 4096.0])
    assert off.choose(long_request(), held, BOTH).index == 0
    decision = default.choose(long_request(), held, BOTH)
    assert decision.index == 1
    assert default.choose_vectorised(long_request(), held, BOTH).reason == decision.reason
    lat = default.latency(long_request(), held, BOTH)
    floor, _, _ = default._floor(long_request(), held, BOTH, duplicate=True)
    assert floor[1] == lat[1]  # the holder pays nothing
    extra = floor[0] - lat[0]
    assert extra == pytest.approx(16.0 * (FAST.p1 + FAST.p3) * 4096.0)
    for seen in (snap(pair), with_cache(snap(pair), [0.0, 3072.0])):  # nothing held; a fresh prompt
        a, b = default.choose(long_request(), seen, BOTH), off.choose(long_request(), seen, BOTH)
        assert (a.index, a.reason) == (b.index, b.reason)
    far = (pair[0], backend("slow", profile(SLOW, 800_000)))
    far_held = with_cache(snap(far), [0.0, 4096.0])
    assert policy("balanced_minmax", far).latency(long_request(), far_held, BOTH).tolist() == list(
        policy("balanced_minmax", far)._floor(long_request(), far_held, BOTH, duplicate=True)[0]
    )
    assert policy("workload_minmax", pair).duplicate_weight == 0.0  # off outside balanced_minmax
    with pytest.raises(ConfigError, match="duplicate_weight"):
        policy("balanced_minmax", pair, duplicate_weight=-1.0)
    with pytest.raises(ConfigError, match="duplicate_weight"):
        policy("memory_minmax", pair, duplicate_weight=1.0)  # no floor to price it in


def test_among_peers_the_duplicate_price_plays_no_part() -> None:
    """Among peers ``peer_latency`` decides by r's own latency, with no κ and no duplicate price (with
    ``peer_latency`` off, 4 of these 50 decisions change)."""
    assert_peers_decide_as_without(
        {"duplicate_weight": 0.0}, lambda rng: list(rng.choice([0.0, 1024.0, 4096.0], 3)), seed=11
    )


def test_most_held_near_is_the_largest_credit_among_candidates_near_the_fastest() -> None:
    """m* equals its definition, max{cached_s : T_s ≤ ρ · min T} with T = max(slope · I + intercept, 0),
    on random fleets: when the largest holder is near (the shortcut: only the minimum is computed),
    when it is far (the full mask), with lines clamped at 0 and with nothing held."""
    rng = np.random.default_rng(5)
    far_largest = 0
    for _ in range(400):
        n = int(rng.integers(2, 9))
        slope = rng.uniform(-1e-5, 4e-4, n)
        intercept = rng.uniform(-0.2, 0.05, n)
        cached = rng.choice([0.0, 512.0, 1024.0, 3072.0], n) * (rng.random() < 0.9)
        tokens = float(rng.integers(1, 8192))
        full = np.maximum(slope * tokens + intercept, 0.0)
        near = full <= 3.0 * full.min()
        expected = float(cached[near].max())
        far_largest += int(not near[int(cached.argmax())] and cached.max() > 0.0)
        assert most_held_near(cached, slope, intercept, tokens, 3.0) == expected
    assert far_largest > 20  # the fallback ran, not only the shortcut
