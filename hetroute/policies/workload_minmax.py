"""``workload_minmax``: the paper's scheduler ("OS", Xiong et al. Eq. 5-8, Algorithm 2, fixed).

Per request r and candidate s (method.md §5):

    b_r^s     = clip(floor(cap_s / (I_r + Õ_r)), 1, max_num_seqs_s)
    T_r^s     = (T_prefill(b, I_r) + T_decode(b, I_r, Õ_r)) / b              (backend_model.py)
    kvusage_s = Σ_{in flight on s} (I + generated + remaining Õ) / cap_s    (may exceed 1)
    w_r^s     = T_r^s · exp(θ · kvusage_s)
    c         = argmin_s max( max_{j≠s} L_j , L_s + w_r^s )

``L_j = snapshot.workload[j]`` over **all** backends (not only candidates); the minimum starts at
+∞ (the paper's pseudo-code starts at 0); ties go to the smallest ``L_s + w_r^s`` (with the latency
floor: the smallest ``max(L_s + w_r^s, lat)``), then to the fewest prompt tokens waiting for a first
token (the ledger's ``prefill_pending_tokens``), then to a seeded random choice. The decision's
``workload_cost`` is ``w_r^c``: the router adds it to ``L_c`` and the
ledger removes it exactly once when the request ends, whatever the outcome; the ledger also carries
``I + Õ`` as running tokens and replaces predicted tokens with generated ones as they stream
(closing the loop). The exponent is capped at ``MAX_EXPONENT`` so a load can never become ∞.

The KV signal (``kv_signal``): ``ledger`` (default, the estimate above), ``paper`` (the paper's
open-loop Σ (I + Õ) / cap with Õ as predicted at dispatch, never corrected), ``engine`` (the engine's
``kv_usage_frac`` plus ``num_requests_waiting`` × the ledger's mean tokens per request / cap), or
``max`` (the larger of the two). ``engine``/``max`` need the metric on *every* candidate; if any
candidate lacks it, all candidates use the ledger estimate (same signal for all).

Params: ``theta`` (θ ≥ 0, default 2, the paper's value), ``kv_signal``, ``batch_kv`` (``full``:
b from I + Õ as the paper; ``average``: from I + Õ/2, the mean footprint under continuous batching),
``latency_floor`` (default false; the latency floor of ``balanced_minmax``), ``prefix`` / ``cache_weight``
(default false / 1: prefix-cache credit and its weight in the drain-time comparison, see
``balanced_minmax`` and docs/prefix.md), ``prefill_queue`` and
``ttft_weight`` (default false / 0; the floor's prefill terms, see ``balanced_minmax``: they act only
inside the latency floor), ``explore_share`` / ``explore_min_samples`` /
``explore_max_output_tokens`` (default 0.02 / 3 / 256: the bounded exploration of backends the live
learner has few observations of, see :meth:`MinMaxPolicy._explore`; inert without live learning),
``peer_latency`` (default false, true in ``balanced_minmax``: where every candidate is a peer, the
same engine on the same hardware as far as the router knows, the smallest predicted latency decides
instead of the min-max, see :mod:`.peers` and docs/prefix.md), ``peer_prefill_weight`` /
``peer_queue_weight`` (default 1 / 0, 6 / 1.5 in ``balanced_minmax``: among peers r's own prefill counts
F_p times instead of κ and the wait behind the prompts already queued 1 + X times,
:func:`~.peers.peer_latency_s`, or once while every peer's batch is full, :func:`~.peers.slots_taken`),
``fresh_prompt_tokens`` / ``fresh_near_ratio`` / ``fresh_queue_weight`` (default 0 = off / 3 / 0,
7,168 / 3 / 1.5 in ``balanced_minmax``: outside a fleet of peers, the κ term of a prompt with that many
tokens cached on no candidate, and the prompts queued ahead of it counted 1 + X_f times, see
:mod:`.fresh`), ``duplicate_weight`` (default 0 = off, 16 in ``balanced_minmax``: outside a fleet of
peers, the prefill of what a backend near the fastest holds and s lacks counts κ_d more times in s's
floor, see :mod:`.duplicate`), ``seed``.

With live learning the latency parameters come from the snapshot (``latency_params``), not from the
static :class:`BackendModels` resolved at construction.
``memory_minmax`` (T ≡ 1) and ``balanced_minmax`` reuse :class:`MinMaxPolicy`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np

from hetroute.fields import UNIT, NonNegativeInt, PositiveInt, Range
from hetroute.policies.backend_model import BackendModels, uncached_tokens
from hetroute.policies.base import PolicyContext, read_params, seeded_rng
from hetroute.policies.duplicate import DuplicateSlopes, duplicate_terms, most_held_near
from hetroute.policies.fresh import FRESH_NEAR_RATIO, fresh_kappa_terms, is_fresh, may_be_fresh
from hetroute.policies.minmax_scalar import MAX_EXPONENT as MAX_EXPONENT
from hetroute.policies.minmax_scalar import (
    PREFIX_BALANCE_ABS_S,
    PREFIX_BALANCE_REL,
    PREFIX_PENDING_ABS_TOKENS,
    PREFIX_PENDING_REL,
    SCALAR_MAX_BACKENDS,
    ListCache,
    choose_forced,
    choose_scalar,
    output_bound,
)
from hetroute.policies.peers import PeerMemo, peer_latency_s, peer_pick, slots_taken
from hetroute.types import BoolArray, ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision

KvSignal = Literal["ledger", "paper", "engine", "max"]
BatchKv = Literal["full", "average"]
KV_SIGNALS: tuple[KvSignal, ...] = ("ledger", "paper", "engine", "max")
BATCH_KV: tuple[BatchKv, ...] = ("full", "average")
EXPLORE_SHARE = 0.02
"""Default ``explore_share``: at most 2 % of requests go to a backend that is still being learned."""
EXPLORE_MIN_SAMPLES = 3
"""Default ``explore_min_samples``: observations after which a backend is no longer explored."""
EXPLORE_MAX_OUTPUT_TOKENS = 256
"""Default ``explore_max_output_tokens``: only requests this short (``output_bound``) are used as probes."""


@dataclass(frozen=True, slots=True)
class MinMaxParams:
    """``policy.params`` of the min-max family; each policy gives its own defaults (``build_minmax``), and
    the unit-time variant (``memory_minmax``) takes none of :data:`TIME_ONLY_PARAMS`. ``seed`` None: the
    router's seed."""

    theta: Annotated[float, Range(minimum=0, maximum=100)] = 2.0
    kv_signal: KvSignal = "ledger"
    batch_kv: BatchKv = "full"
    latency_floor: bool = False
    prefill_queue: bool = False
    ttft_weight: Annotated[float, Range(minimum=0, maximum=1000)] = 0.0
    explore_share: Annotated[float, UNIT] = EXPLORE_SHARE
    explore_min_samples: NonNegativeInt = EXPLORE_MIN_SAMPLES
    explore_max_output_tokens: PositiveInt = EXPLORE_MAX_OUTPUT_TOKENS
    prefix: bool = False
    cache_weight: Annotated[float, Range(minimum=1, maximum=100)] = 1.0
    session_slack: Annotated[float, Range(minimum=0, maximum=10)] = 0.0
    peer_latency: bool = False
    peer_prefill_weight: Annotated[float, Range(minimum=0, maximum=1000)] = 1.0
    peer_queue_weight: Annotated[float, Range(minimum=0, maximum=1000)] = 0.0
    fresh_prompt_tokens: NonNegativeInt = 0
    fresh_near_ratio: Annotated[float, Range(minimum=1, maximum=1000)] = FRESH_NEAR_RATIO
    fresh_queue_weight: Annotated[float, Range(minimum=0, maximum=1000)] = 0.0
    duplicate_weight: Annotated[float, Range(minimum=0, maximum=1000)] = 0.0
    seed: int | None = None


TIME_ONLY_PARAMS = (
    "batch_kv",
    "latency_floor",
    "prefill_queue",
    "ttft_weight",
    "prefix",
    "cache_weight",
    "peer_latency",
    "peer_prefill_weight",
    "peer_queue_weight",
    "fresh_prompt_tokens",
    "fresh_near_ratio",
    "fresh_queue_weight",
    "duplicate_weight",
)


def kv_usage(snapshot: ClusterSnapshot, idx: IntArray, cap: FloatArray, signal: KvSignal) -> FloatArray:
    """kvusage_s for backends ``idx`` from the chosen signal (ledger fallback for all, see module doc)."""
    if signal == "paper":
        paper: FloatArray = (
            snapshot.input_tokens_in_flight[idx] + snapshot.predicted_output_tokens_in_flight[idx]
        ) / cap
        return paper
    ledger: FloatArray = snapshot.kv_tokens_in_flight[idx] / cap
    if signal == "ledger":
        return ledger
    fracs: list[float] = []
    waiting: list[float] = []
    has_waiting = True
    for i in idx:
        m = snapshot.metrics[int(i)]
        if m is None or m.kv_usage_frac is None:
            return ledger
        fracs.append(m.kv_usage_frac)
        if m.num_requests_waiting is None:
            has_waiting = False
        else:
            waiting.append(m.num_requests_waiting)
    engine: FloatArray = np.array(fracs, dtype=np.float64)
    if has_waiting:
        n = np.maximum(snapshot.requests_in_flight[idx], 1)
        per_request = snapshot.kv_tokens_in_flight[idx] / n
        engine = engine + np.array(waiting, dtype=np.float64) * per_request / cap
    if signal == "engine":
        return engine
    out: FloatArray = np.maximum(engine, ledger)
    return out


class _Unset:
    """Marks an argument not passed (None is a value: no cache credit)."""


UNSET = _Unset()


ALL_UNPRICED: BoolArray = np.ones(0, dtype=np.bool_)
"""``MinMaxPolicy._unpriced``'s answer when no backend's model prices the prefill queue (compared by
identity: every candidate is then one). Empty and read-only: a marker, never indexed."""
ALL_UNPRICED.flags.writeable = False


class MinMaxPolicy:
    """The min-max mapper over w = T · exp(θ · g(kvusage)); see the module docstring."""

    def __init__(
        self,
        name: str,
        models: BackendModels,
        rng: random.Random,
        *,
        theta: float = 2.0,
        unit_time: bool = False,
        kv_signal: KvSignal = "ledger",
        batch_kv: BatchKv = "full",
        overflow_only: bool = False,
        latency_floor: bool = False,
        prefill_queue: bool = False,
        ttft_weight: float = 0.0,
        explore_share: float = 0.0,
        explore_min_samples: int = 0,
        explore_max_output_tokens: int = 0,
        prefix: bool = False,
        cache_weight: float = 1.0,
        session_slack: float = 0.0,
        peer_latency: bool = False,
        peer_prefill_weight: float = 1.0,
        peer_queue_weight: float = 0.0,
        fresh_prompt_tokens: int = 0,
        fresh_near_ratio: float = FRESH_NEAR_RATIO,
        fresh_queue_weight: float = 0.0,
        duplicate_weight: float = 0.0,
    ) -> None:
        self.name = name
        self.duplicate_weight = duplicate_weight
        self.duplicate_slopes = DuplicateSlopes(duplicate_weight)  # the term's per-backend constants
        self.fresh_queue_weight = fresh_queue_weight
        self.fresh_prompt_tokens = fresh_prompt_tokens
        self.fresh_near_ratio = fresh_near_ratio
        self.peer_latency = peer_latency
        self.peer_prefill_weight = peer_prefill_weight
        self.peer_queue_weight = peer_queue_weight
        self.peers = PeerMemo()  # whether every candidate is a peer, for peer_latency
        self.prefix = prefix
        self.cache_weight = cache_weight
        self.session_slack = session_slack
        self.explore_share = explore_share
        self.explore_min_samples = explore_min_samples
        self.explore_max_output_tokens = explore_max_output_tokens
        self.ttft_weight = ttft_weight
        self.latency_floor = latency_floor
        self.prefill_queue = prefill_queue
        self.models = models
        self.theta = theta
        self.unit_time = unit_time
        self.kv_signal = kv_signal
        self.batch_kv = batch_kv
        self.overflow_only = overflow_only
        self.lists = ListCache()  # the scalar path's list copies of rarely replaced arrays
        self._unpriced_held: tuple[FloatArray, BoolArray | None] | None = None
        self._rng = rng

    def costs(
        self,
        features: RequestFeatures,
        snapshot: ClusterSnapshot,
        candidates: IntArray,
        cached: FloatArray | None | _Unset = UNSET,
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(T_r^s, kvusage_s, w_r^s) for every candidate; ``cached`` as :meth:`_cached` gives it (computed
        here when not passed)."""
        t, u, w, _ = self._costs(features, snapshot, candidates, cached, saved=False)
        return t, u, w

    def _costs(
        self,
        features: RequestFeatures,
        snapshot: ClusterSnapshot,
        candidates: IntArray,
        cached: FloatArray | None | _Unset,
        *,
        saved: bool,
        uncached: FloatArray | None = None,
    ) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray | None]:
        """:meth:`costs` and, with ``saved``, the part of w_r^s the cached tokens save
        (``(p1·b + p3)·cached/b · e^(θ·g)``, for ``cache_weight``); ``uncached``: ``uncached_tokens``
        of ``cached`` when the caller has it."""
        cap = self.models.capacity_tokens(snapshot, candidates)
        if isinstance(cached, _Unset):
            cached = self._cached(snapshot, candidates)
        i = float(features.input_tokens)
        o = float(features.predicted_output_tokens)
        t_saved: FloatArray | None = None
        if self.unit_time:
            t: FloatArray = np.ones(len(candidates), dtype=np.float64)
        else:
            batch_cap = cap if self.batch_kv == "full" else cap * (i + o) / max(1.0, i + o / 2.0)
            t, t_saved = self.models.amortised_and_saved_s(
                candidates,
                i,
                o,
                batch_cap,
                snapshot.latency_params,
                cached,
                saved=saved,
                uncached_tokens=uncached,
            )
        u = kv_usage(snapshot, candidates, cap, self.kv_signal)
        g = np.maximum(u - 1.0, 0.0) if self.overflow_only else u
        factor = np.exp(np.minimum(self.theta * g, MAX_EXPONENT))
        w: FloatArray = t * factor
        w_saved: FloatArray | None = None if t_saved is None else t_saved * factor
        return t, u, w, w_saved

    def latency(
        self,
        features: RequestFeatures,
        snapshot: ClusterSnapshot,
        candidates: IntArray,
        cached: FloatArray | None | _Unset = UNSET,
    ) -> FloatArray:
        """Predicted latency of r if it starts now on each candidate, next to its in-flight requests."""
        return self._floor(features, snapshot, candidates, cached)[0]

    def _floor(
        self,
        features: RequestFeatures,
        snapshot: ClusterSnapshot,
        candidates: IntArray,
        cached: FloatArray | None | _Unset = UNSET,
        uncached: FloatArray | None = None,
        *,
        fresh: bool = False,
        duplicate: bool = False,
    ) -> tuple[FloatArray, FloatArray | None, FloatArray | None]:
        """:meth:`latency`, r's own prefill on each candidate, T_prefill(1, I − cached), where the κ
        term computed it (else None), and the wait behind the prompts already queued, p1 · P_s, where
        ``prefill_queue`` computed it (else None), for :func:`~.peers.peer_latency_s`; ``uncached`` as
        in :meth:`_costs`; ``fresh``: r is a fresh prompt, its κ term :func:`~.fresh.fresh_kappa_terms`
        and its queue term counted 1 + ``fresh_queue_weight`` times; ``duplicate``: r has cache
        credit and is neither fresh nor decided among peers, and the prefill of the tokens a candidate
        near the fastest holds counts ``duplicate_weight`` more times on the others
        (:mod:`~.duplicate`)."""
        n = snapshot.requests_in_flight[candidates].astype(np.float64)
        context = (
            snapshot.input_tokens_in_flight[candidates] + snapshot.generated_tokens_in_flight[candidates]
        )
        mean_context = (context + features.input_tokens) / (n + 1.0)
        params = snapshot.latency_params
        if isinstance(cached, _Unset):
            cached = self._cached(snapshot, candidates)
        out = self.models.request_latency_s(
            candidates,
            features.input_tokens,
            features.predicted_output_tokens,
            n + 1.0,
            mean_context,
            params,
            cached,
            uncached_tokens=uncached,
        )
        queue: FloatArray | None = None
        if self.prefill_queue:
            pending = snapshot.prefill_pending_tokens[candidates]
            queue = self.models.prefill_queue_s(candidates, pending, params)
            out = out + queue
        own_prefill: FloatArray | None = None
        if self.ttft_weight > 0.0:
            # κ weights r's own prefill on each backend: the uncached part of its prompt, its TTFT on an
            # idle backend (docs/prefix.md, "The cost model").
            own_prefill = self.models.prefill_s(
                candidates, features.input_tokens, params, cached, uncached_tokens=uncached
            )
            if fresh:
                full = self.models.prefill_s(candidates, features.input_tokens, params)
                out = out + fresh_kappa_terms(self.ttft_weight, own_prefill, full, self.fresh_near_ratio)
            else:
                out = out + self.ttft_weight * own_prefill
        if fresh and queue is not None and self.fresh_queue_weight != 0.0:
            out = out + self.fresh_queue_weight * queue  # the queue ahead of a fresh prompt: 1 + X_f times
        if duplicate and cached is not None and self.duplicate_weight > 0.0:
            slope, intercept, price = self.duplicate_slopes(self.models.params if params is None else params)
            if candidates.size != slope.size:  # else every backend, in order (sorted, distinct)
                slope, intercept, price = slope[candidates], intercept[candidates], price[candidates]
            most = most_held_near(
                cached, slope, intercept, float(max(features.input_tokens, 0)), self.fresh_near_ratio
            )
            if most > 0.0:  # m*: some backend near the fastest holds part of r's prompt
                out = out + duplicate_terms(price, most - cached)
        return out, own_prefill, queue

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        """The min-max choice: with one candidate only its cost (``choose_forced``); in scalar Python
        for a small fleet (:mod:`.minmax_scalar`, the same decision bit for bit), else over arrays
        (:meth:`choose_vectorised`)."""
        if candidates.size == 1:
            forced = choose_forced(self, features, snapshot, candidates)
            if forced is not None:
                return forced
        if snapshot.workload.size <= SCALAR_MAX_BACKENDS:
            decision = choose_scalar(self, self._rng, features, snapshot, candidates)
            if decision is not None:
                return decision
        return self.choose_vectorised(features, snapshot, candidates)

    def choose_vectorised(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        """The min-max choice over numpy arrays (any fleet size, every KV signal)."""
        cached = self._cached(snapshot, candidates)  # once per decision, for both terms
        # I − cached, once for every term that prices r's prefill
        uncached = None if cached is None else uncached_tokens(features.input_tokens, cached)
        # cached ≥ 0 (trust · matched, net credit clamped at 0), so nonzero means some credit
        credit = cached is not None and bool(np.count_nonzero(cached))
        weighted = credit and self.cache_weight != 1.0
        t, u, w, w_saved = self._costs(
            features, snapshot, candidates, cached, saved=weighted, uncached=uncached
        )
        loads = snapshot.workload
        base = loads[candidates]
        own = base + w
        rank = own  # what breaks ties between equal min-max scores
        if w_saved is not None:
            # The prefill a hit saves counts cache_weight times where the min-max is indifferent (the
            # tie-break); the makespan score keeps D ≥ L_s and the ledger is charged w (docs/prefix.md).
            rank = own - (self.cache_weight - 1.0) * np.maximum(w_saved, 0.0)
            own = np.maximum(rank, base)
        lat: FloatArray | None = None
        own_prefill: FloatArray | None = None
        queue: FloatArray | None = None
        # peer_latency: whether every candidate is a peer (memoised), asked before the floor, whose κ
        # term a fresh prompt changes only among non-peers (.fresh)
        peered = self.peer_latency and self.latency_floor and self.peers(self.models, snapshot, candidates)
        if self.latency_floor:
            fresh = (
                not peered
                and cached is not None
                and may_be_fresh(features.input_tokens, self.fresh_prompt_tokens)
                and is_fresh(features.input_tokens, float(cached.max()), self.fresh_prompt_tokens)
            )
            lat, own_prefill, queue = self._floor(
                features,
                snapshot,
                candidates,
                cached,
                uncached,
                fresh=fresh,
                duplicate=credit and not (peered or fresh),
            )
            own = np.maximum(own, lat)
            rank = own if w_saved is None else np.maximum(rank, lat)
        if loads.size >= 2:
            top = int(np.argmax(loads))
            second, first = (float(v) for v in np.partition(loads, loads.size - 2)[-2:])
            others: FloatArray = np.where(candidates == top, second, first)
            score: FloatArray = np.maximum(others, own)
        else:
            score = own
        best = float(score.min())
        tied = np.flatnonzero(score <= best + 1e-12 * max(1.0, abs(best)))
        if tied.size > 1:
            own_tied = rank[tied]
            tied = tied[own_tied <= float(own_tied.min()) + 1e-12 * max(1.0, abs(float(own_tied.min())))]
            if tied.size > 1:  # then the fewest prompt tokens waiting for a first token (module doc)
                waiting = snapshot.prefill_pending_tokens[candidates[tied]]
                tied = tied[waiting <= float(waiting.min())]
        k = int(tied[self._rng.randrange(tied.size)]) if tied.size > 1 else int(tied[0])
        peer_k = -1  # where peer_latency moved r, if it did (the reason then says so)
        if peered and lat is not None:
            if own_prefill is None and self.ttft_weight != self.peer_prefill_weight:
                own_prefill = self.models.prefill_s(
                    candidates,
                    features.input_tokens,
                    snapshot.latency_params,
                    cached,
                    uncached_tokens=uncached,
                )
            queue_weight = self.peer_queue_weight
            if queue_weight != 0.0 and slots_taken(
                snapshot.requests_in_flight[candidates], self.models.max_num_seqs[candidates]
            ):
                queue_weight = 0.0  # every batch full: r waits for the work ahead (peers.slots_taken)
            if queue is None and queue_weight != 0.0:  # no queue term in the floor itself
                queue = self.models.prefill_queue_s(
                    candidates, snapshot.prefill_pending_tokens[candidates], snapshot.latency_params
                )
            lat = peer_latency_s(
                lat, own_prefill, self.ttft_weight, self.peer_prefill_weight, queue, queue_weight
            )
            minmax_k, k = k, peer_pick(lat, k)
            peer_k = k if k != minmax_k else -1
        k = self._keep_session(snapshot, candidates, score, own, k)
        explored = self._explore(features, snapshot, candidates, k)
        if explored is not None:
            k = explored
        index = int(candidates[k])
        cost = float(w[k])
        if not math.isfinite(cost):  # pragma: no cover - guarded by MAX_EXPONENT; never charge ∞
            cost = float(np.finfo(np.float64).max) / 4
        what = "explore (few samples)" if explored is not None else f"min-max load {best:.4g}"
        if explored is None and lat is not None and k == peer_k:
            what = f"peer latency {float(lat[k]):.4g}s ({what})"
        return RoutingDecision(
            index=index,
            reason=f"{what}: T={t[k]:.4g}s kvusage={u[k]:.3f} w={cost:.4g}",
            workload_cost=cost,
            scores={"minmax_load": best, "T_s": float(t[k]), "kv_usage": float(u[k]), "w": cost},
        )

    def _cached(self, snapshot: ClusterSnapshot, candidates: IntArray) -> FloatArray | None:
        """Estimated cached tokens per candidate for the cost model, or None (no prefix term).

        Balance guard: the candidate whose drain time L_s exceeds every other candidate's by more
        than ``PREFIX_BALANCE_REL`` (relative) and ``PREFIX_BALANCE_ABS_S`` gets no cache credit, so one
        backend holding a hot prefix cannot keep pulling its requests into a backlog no other backend
        has; the next request that goes elsewhere replicates the prefix there (the role of SGLang's
        balance thresholds, in drain time instead of request counts). The reference is the next
        busiest candidate, not the least loaded: on a mixed fleet the least loaded is usually a slow
        backend the latency floor keeps light, and measured against it the fast backends lost their
        cache credit at every moderate load (docs/prefix.md).

        The same guard on the ledger's pending prefill tokens (prompts without a first token yet):
        the candidate holding more than ``PREFIX_PENDING_REL`` and ``PREFIX_PENDING_ABS_TOKENS`` above
        every other candidate gets no credit either. It needs no latency model, so it still holds
        where the model's drain times are on the wrong scale (nothing known, a neutral prior).

        Before both guards, a candidate whose model prices no prefill queue (p1 ≤ 0: the neutral
        default before the backend's first fit) keeps only ``cached − (P_s − min P)``, at least 0: each
        prompt token it has waiting beyond the least-waiting candidate cancels one cached token. Its
        floor has no ``p1 · P_s`` term, so a full credit would pull every request sharing its prefix
        into a queue nothing prices (docs/prefix.md, "Before the first fit")."""
        if not self.prefix:
            return None
        cached = snapshot.prefix_cached_tokens(candidates)
        if cached is None or candidates.size < 2:
            return cached
        pending = snapshot.prefill_pending_tokens[candidates]
        out: FloatArray = cached
        unpriced = self._unpriced(snapshot)
        if unpriced is not None:
            blind = None if unpriced is ALL_UNPRICED else unpriced[candidates]
            if blind is None or bool(blind.any()):
                net = pending - np.minimum.reduce(pending)
                np.subtract(cached, net, out=net)
                np.maximum(net, 0.0, out=net)
                out = net if blind is None else np.where(blind, net, cached)
        for values, rel, margin in (
            (snapshot.workload[candidates], PREFIX_BALANCE_REL, PREFIX_BALANCE_ABS_S),
            (pending, PREFIX_PENDING_REL, PREFIX_PENDING_ABS_TOKENS),
        ):
            top = int(values.argmax())
            if not out[top] > 0.0:
                continue  # the busiest candidate has no credit to lose (the common case)
            largest = float(values[top])
            values[top] = -np.inf  # values is this call's own copy (fancy indexing): the rest's largest
            if largest > float(np.maximum.reduce(values)) * (1.0 + rel) + margin:
                if out is cached:
                    out = cached.copy()
                out[top] = 0.0
        return out

    def _unpriced(self, snapshot: ClusterSnapshot) -> BoolArray | None:
        """Per backend, whether its latency model prices no prefill queue (p1 ≤ 0: the neutral default
        before a first fit); None when none does, :data:`ALL_UNPRICED` when all do. Kept while the
        parameter array in use is the same read-only object (replaced whole at a refit, like
        :class:`ListCache`'s arrays)."""
        params = self.models.params if snapshot.latency_params is None else snapshot.latency_params
        held = self._unpriced_held
        if held is not None and held[0] is params:
            return held[1]
        mask: BoolArray = params[:, 0] <= 0.0
        out = (ALL_UNPRICED if bool(mask.all()) else mask) if bool(mask.any()) else None
        if not params.flags.writeable:
            self._unpriced_held = (params, out)
        return out

    def _keep_session(
        self, snapshot: ClusterSnapshot, candidates: IntArray, score: FloatArray, own: FloatArray, chosen: int
    ) -> int:
        """Session affinity as a soft hint: the session's last backend when the load model rates it about
        as good as ``chosen``: both its min-max score (the cluster's makespan) and its own predicted
        finish for r within ``session_slack`` of ``chosen``'s; else ``chosen``."""
        home = snapshot.session_backend
        if home < 0 or self.session_slack <= 0.0:
            return chosen
        where = np.flatnonzero(candidates == home)
        if where.size == 0:
            return chosen
        j = int(where[0])
        slack = 1.0 + self.session_slack
        agree = (
            float(score[j]) <= float(score[chosen]) * slack and float(own[j]) <= float(own[chosen]) * slack
        )
        return j if agree else chosen

    def _explore(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray, chosen: int
    ) -> int | None:
        """The candidate to explore instead of ``chosen``, or None (bounded, decaying, cheap exploration).

        Only with a learned model (``snapshot.model_samples``), only for a short request (its
        :func:`output_bound` ≤ ``explore_max_output_tokens``) and only onto an idle backend, so a probe
        costs one short request its run on the probed backend (about 17 s for 250 tokens on an emulated L4)
        and never queues behind anything: the
        idle candidate with the fewest observations, n, is taken with probability
        ``explore_share · (1 − n / explore_min_samples)`` when n < ``explore_min_samples`` and it is not
        already the choice. Each backend thus gets at most about ``explore_min_samples`` such probes,
        and none once it has that many observations (again after a detected drift, which restarts its
        count). No random draw happens otherwise, so a fully learned fleet decides as the plain policy.
        """
        samples = snapshot.model_samples
        if (
            self.explore_share <= 0.0
            or samples is None
            or candidates.size < 2
            or output_bound(features) > self.explore_max_output_tokens
        ):
            return None
        idle = snapshot.requests_in_flight[candidates] == 0
        counts = np.where(idle, samples[candidates], np.inf)
        k = int(np.argmin(counts))
        deficit = 1.0 - float(counts[k]) / max(self.explore_min_samples, 1)
        if deficit <= 0.0 or k == chosen:
            return None
        return k if self._rng.random() < self.explore_share * deficit else None


def build_minmax(
    name: str,
    params: Mapping[str, object],
    ctx: PolicyContext,
    defaults: MinMaxParams,
    *,
    unit_time: bool = False,
    overflow_only: bool = False,
) -> MinMaxPolicy:
    """Validate ``params`` (overriding ``defaults``) and build a :class:`MinMaxPolicy`."""
    p = read_params(MinMaxParams, params, name, base=defaults, exclude=TIME_ONLY_PARAMS if unit_time else ())
    return MinMaxPolicy(
        name,
        ctx.backend_models or BackendModels.from_specs(ctx.backends),
        seeded_rng(p.seed, ctx),
        theta=p.theta,
        unit_time=unit_time,
        kv_signal=p.kv_signal,
        batch_kv=p.batch_kv,
        overflow_only=overflow_only,
        latency_floor=p.latency_floor,
        prefill_queue=p.prefill_queue,
        ttft_weight=p.ttft_weight,
        explore_share=p.explore_share,
        explore_min_samples=p.explore_min_samples,
        explore_max_output_tokens=p.explore_max_output_tokens,
        prefix=p.prefix and not unit_time,
        cache_weight=p.cache_weight,
        session_slack=p.session_slack,
        peer_latency=p.peer_latency,
        peer_prefill_weight=p.peer_prefill_weight,
        peer_queue_weight=p.peer_queue_weight,
        fresh_prompt_tokens=p.fresh_prompt_tokens,
        fresh_near_ratio=p.fresh_near_ratio,
        fresh_queue_weight=p.fresh_queue_weight,
        duplicate_weight=p.duplicate_weight,
    )


def from_config(params: Mapping[str, object], ctx: PolicyContext) -> MinMaxPolicy:
    """``workload_minmax``: the paper's formula, θ default 2."""
    return build_minmax("workload_minmax", params, ctx, MinMaxParams(theta=2.0))
