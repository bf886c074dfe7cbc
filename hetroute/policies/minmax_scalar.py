"""The min-max mapper's decision in plain Python floats, for small fleets.

Owns :func:`choose_scalar`, the same decision as ``MinMaxPolicy.choose_vectorised`` (same index,
reason, cost, scores and the same draws from the policy's RNG) computed candidate by candidate: at a
handful of backends numpy's per-call overhead (≈ 1 µs per operation on 2-element arrays, some forty
operations per decision) dominates, and scalar arithmetic is several times cheaper. Every
expression evaluates the same IEEE-754 float64 operations in the same order as the array code, so the
results are bit-identical; the one transcendental, ``exp``, is still evaluated by numpy over an array of
the candidates (or skipped when every exponent is 0, where it is exactly 1; for a single candidate,
:func:`choose_forced`, on the scalar: the same ufunc and the same value). ``tests/unit/
test_minmax_scalar.py`` checks the equivalence on many random snapshots.

Used by ``MinMaxPolicy.choose`` when the fleet has at most :data:`SCALAR_MAX_BACKENDS` backends;
returns None for what it does not cover (the ``engine``/``max`` KV signals), and the array path decides.
"""

from __future__ import annotations

import math
import random
from typing import Any, Protocol

import numpy as np

from hetroute.policies.backend_model import BackendModels
from hetroute.policies.duplicate import duplicate_term
from hetroute.policies.fresh import fresh_kappa_term, is_fresh, may_be_fresh
from hetroute.policies.peers import PeerMemo
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision

SCALAR_MAX_BACKENDS = 12
"""Fleets up to this size are decided in scalar Python. Measured for the default policy (``choose``
alone, one core): 28 against 55 µs at 8 backends, about equal at 16, slower beyond."""

MAX_EXPONENT = 30.0
"""Cap on θ·kvusage: e^30 ≈ 1e13 keeps loads finite and releases exact enough in float64."""
PREFIX_BALANCE_REL = 0.5
"""Prefix balance guard: no cache credit on the candidate whose drain time exceeds every other
candidate's by more than this (relative) and :data:`PREFIX_BALANCE_ABS_S` (``MinMaxPolicy._cached``)."""
PREFIX_BALANCE_ABS_S = 2.0
PREFIX_PENDING_REL = 0.5
"""Prefix balance guard on the prompts waiting for a first token: no cache credit on the candidate whose
pending prefill tokens exceed every other candidate's by more than this (relative) and
:data:`PREFIX_PENDING_ABS_TOKENS`. Counted from the ledger, so it holds when the latency model is wrong
(a neutral prior, nothing known: docs/prefix.md)."""
PREFIX_PENDING_ABS_TOKENS = 32768.0
ONLY_CANDIDATE = "only candidate"
"""The reason of a decision with a single candidate (:func:`choose_forced`); T, kvusage and w are in its
scores."""


class ListCache:
    """Plain-list copies (``tolist``) of the arrays the decision reads whole every time but that change
    only now and then (latency parameters at a refit, KV capacities at a scrape, the backends' static
    limits at a membership change). Those arrays are replaced whole, never changed in place, so an
    array object seen before has the same values: its list is reused. An array that can still be
    written to is converted every time (nothing promises it stays the same)."""

    __slots__ = ("_arrays",)

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray[Any, Any], list[Any]]] = {}

    def get(self, key: str, array: np.ndarray[Any, Any]) -> list[Any]:
        """``array.tolist()``, reused while ``key`` names the same read-only array object."""
        held = self._arrays.get(key)
        if held is not None and held[0] is array:
            return held[1]
        out: list[Any] = array.tolist()
        if not array.flags.writeable:
            self._arrays[key] = (array, out)
        return out


class MinMaxSettings(Protocol):
    """What the decision reads of a :class:`~hetroute.policies.workload_minmax.MinMaxPolicy`."""

    @property
    def lists(self) -> ListCache: ...

    @property
    def models(self) -> BackendModels: ...
    @property
    def theta(self) -> float: ...
    @property
    def unit_time(self) -> bool: ...
    @property
    def kv_signal(self) -> str: ...
    @property
    def batch_kv(self) -> str: ...
    @property
    def overflow_only(self) -> bool: ...
    @property
    def latency_floor(self) -> bool: ...
    @property
    def prefill_queue(self) -> bool: ...
    @property
    def ttft_weight(self) -> float: ...
    @property
    def explore_share(self) -> float: ...
    @property
    def explore_min_samples(self) -> int: ...
    @property
    def explore_max_output_tokens(self) -> int: ...
    @property
    def prefix(self) -> bool: ...
    @property
    def cache_weight(self) -> float: ...
    @property
    def session_slack(self) -> float: ...
    @property
    def peer_latency(self) -> bool: ...
    @property
    def peer_prefill_weight(self) -> float: ...
    @property
    def peer_queue_weight(self) -> float: ...
    @property
    def peers(self) -> PeerMemo: ...

    @property
    def fresh_prompt_tokens(self) -> int: ...

    @property
    def fresh_near_ratio(self) -> float: ...

    @property
    def fresh_queue_weight(self) -> float: ...

    @property
    def duplicate_weight(self) -> float: ...


def _peer_pick(lat: list[float], chosen: int) -> int:
    """:func:`~hetroute.policies.peers.peer_pick` over a list (the same comparisons, the same index)."""
    low = min(lat)
    if not low < lat[chosen]:
        return chosen
    return lat.index(low)


def output_bound(features: RequestFeatures) -> int:
    """The most output tokens the request is expected to run to, for choosing exploration probes: the
    client's ``max_tokens`` when it set one (a hard cap: the predictor's estimate is clamped to it, and a
    request predicted short may still run to it), else the predicted output. With ``max_tokens`` set, a
    probe therefore runs at most ``explore_max_output_tokens`` tokens on the probed backend
    (docs/learning.md)."""
    cap = features.max_tokens
    return features.predicted_output_tokens if cap is None else cap


def _cached(
    policy: MinMaxSettings, snap: ClusterSnapshot, cand: list[int], loads: list[float]
) -> list[float] | None:
    """``MinMaxPolicy._cached`` per candidate: the credit less the excess waiting tokens where p1 ≤ 0,
    then the two balance guards."""
    if not policy.prefix or snap.prefix_matched_tokens is None:
        return None
    matched = snap.prefix_matched_tokens.tolist()
    trust = snap.prefix_trust
    if trust is None:
        cached = [matched[c] for c in cand]
    else:
        tr = trust.tolist()
        cached = [matched[c] * tr[c] for c in cand]
    if len(cand) < 2:
        return cached
    pending: list[float] = snap.prefill_pending_tokens.tolist()
    params = policy.models.params if snap.latency_params is None else snap.latency_params
    rows: list[list[float]] = policy.lists.get("params", params)
    unpriced = [k for k, c in enumerate(cand) if rows[c][0] <= 0.0]  # p1 ≤ 0: no prefill-queue term
    if unpriced:
        least = min(pending[c] for c in cand)
        for k in unpriced:
            net = cached[k] - (pending[cand[k]] - least)
            cached[k] = 0.0 if net < 0.0 else net
    for values, rel, margin in (
        (loads, PREFIX_BALANCE_REL, PREFIX_BALANCE_ABS_S),
        (pending, PREFIX_PENDING_REL, PREFIX_PENDING_ABS_TOKENS),
    ):
        top = second = -math.inf
        k_top = 0
        for k, c in enumerate(cand):
            value = values[c]
            if value > top:
                top, second, k_top = value, top, k
            elif value > second:
                second = value
        if top > second * (1.0 + rel) + margin:
            cached[k_top] = 0.0
    return cached


def choose_scalar(
    policy: MinMaxSettings,
    rng: random.Random,
    features: RequestFeatures,
    snap: ClusterSnapshot,
    candidates: IntArray,
) -> RoutingDecision | None:
    """The decision of ``policy`` drawing its tie-breaks and explorations from ``rng`` (the policy's
    own), or None when the array path must decide (see the module docstring)."""
    if policy.kv_signal not in ("ledger", "paper"):
        return None
    cand: list[int] = candidates.tolist()
    loads: list[float] = snap.workload.tolist()
    cached = _cached(policy, snap, cand, loads)
    n_req = snap.requests_in_flight.tolist()
    # peer_latency: whether every candidate is a peer (memoised), asked first so that only a fleet of
    # peers has its peer latencies priced
    peered = policy.peer_latency and policy.latency_floor and policy.peers(policy.models, snap, candidates)
    fresh = (
        policy.latency_floor
        and not peered
        and cached is not None
        and may_be_fresh(features.input_tokens, policy.fresh_prompt_tokens)
        and is_fresh(features.input_tokens, max(cached), policy.fresh_prompt_tokens)
    )
    t_list, u_list, w_list, lat_list, saved_list, peer_list = _costs(
        policy, features, snap, cand, cached, n_req, peered, fresh
    )
    own = [loads[c] + w for c, w in zip(cand, w_list, strict=True)]
    rank = own
    # max(a, b) of two floats as the builtin's own comparison, b if b > a else a (as in _costs)
    if saved_list is not None:
        weight = policy.cache_weight - 1.0
        rank = [a - weight * (0.0 if x < 0.0 else x) for a, x in zip(own, saved_list, strict=True)]
        own = [(load if load > d else d) for d, load in zip(rank, (loads[c] for c in cand), strict=True)]
    if policy.latency_floor:
        own = [(b if b > a else a) for a, b in zip(own, lat_list, strict=True)]
        rank = (
            own if saved_list is None else [(b if b > a else a) for a, b in zip(rank, lat_list, strict=True)]
        )
    if len(loads) >= 2:
        first = max(loads)
        top = loads.index(first)
        ranked = sorted(loads)
        second = ranked[-2]
        score = []
        for c, a in zip(cand, own, strict=True):
            other = second if c == top else first
            score.append(a if a > other else other)
    else:
        score = own
    best = min(score)
    cut = best + 1e-12 * max(1.0, abs(best))
    tied = [k for k, v in enumerate(score) if v <= cut]
    if len(tied) > 1:
        low = min(rank[k] for k in tied)
        cut_own = low + 1e-12 * max(1.0, abs(low))
        tied = [k for k in tied if rank[k] <= cut_own]
        if len(tied) > 1:
            pending = snap.prefill_pending_tokens
            least = min(pending[cand[k]] for k in tied)
            tied = [k for k in tied if pending[cand[k]] <= least]
    k = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
    peer_k = -1  # where peer_latency moved r, if it did (the reason then says so)
    if peered:
        lat_list = peer_list
        minmax_k, k = k, _peer_pick(lat_list, k)
        peer_k = k if k != minmax_k else -1
    k = _keep_session(policy, snap, cand, score, own, k)
    explored = _explore(policy, rng, features, snap, cand, n_req, k)
    if explored is not None:
        k = explored
    cost = w_list[k]
    if not math.isfinite(cost):  # pragma: no cover - guarded by MAX_EXPONENT; never charge ∞
        cost = float(np.finfo(np.float64).max) / 4
    what = "explore (few samples)" if explored is not None else f"min-max load {best:.4g}"
    if explored is None and k == peer_k:
        what = f"peer latency {lat_list[k]:.4g}s ({what})"
    t_k, u_k = t_list[k], u_list[k]
    return RoutingDecision(
        index=cand[k],
        reason=f"{what}: T={t_k:.4g}s kvusage={u_k:.3f} w={cost:.4g}",
        workload_cost=cost,
        scores={"minmax_load": best, "T_s": t_k, "kv_usage": u_k, "w": cost},
    )


def choose_forced(
    policy: MinMaxSettings, features: RequestFeatures, snap: ClusterSnapshot, candidates: IntArray
) -> RoutingDecision | None:
    """The decision when ``candidates`` holds a single backend, or None when the general path must
    decide (several candidates, or the ``engine``/``max`` KV signals).

    The one candidate is chosen whatever its score, and neither the tie-break nor exploration draws
    from the RNG with one candidate, so only the cost it is charged is computed: w_r^c, the value
    :func:`choose_scalar` and the array path charge, bit for bit (their T and kvusage, without the
    latency floor, the cache weight's saving and the min-max score, which only rank candidates).
    Its reason is :data:`ONLY_CANDIDATE` (no numbers: formatting three floats was a sizeable share of
    this function's cost in a profile under load) and its scores omit ``minmax_load``."""
    if candidates.size != 1 or policy.kv_signal not in ("ledger", "paper"):
        return None
    c = int(candidates[0])
    t, u, cost = _forced_cost(policy, features, snap, c, _forced_cached(policy, snap, c))
    if not math.isfinite(cost):  # pragma: no cover - guarded by MAX_EXPONENT; never charge ∞
        cost = float(np.finfo(np.float64).max) / 4
    return RoutingDecision(
        index=c, reason=ONLY_CANDIDATE, workload_cost=cost, scores={"T_s": t, "kv_usage": u, "w": cost}
    )


def _forced_cached(policy: MinMaxSettings, snap: ClusterSnapshot, c: int) -> float | None:
    """:func:`_cached` for the single candidate ``c`` (the balance guard cannot exclude the least
    loaded candidate itself)."""
    matched = snap.prefix_matched_tokens
    if not policy.prefix or matched is None:
        return None
    trust = snap.prefix_trust
    return float(matched[c]) if trust is None else float(matched[c]) * float(trust[c])


def _forced_cost(
    policy: MinMaxSettings, features: RequestFeatures, snap: ClusterSnapshot, c: int, cached: float | None
) -> tuple[float, float, float]:
    """(T, kvusage, w) of :func:`_costs` for the one candidate ``c``, read from the snapshot item by
    item (no list copies of the whole fleet)."""
    models = policy.models
    if policy.kv_signal == "ledger":
        kv = (
            float(snap.input_tokens_in_flight[c])
            + float(snap.generated_tokens_in_flight[c])
            + float(snap.remaining_predicted_tokens[c])
        )
    else:
        kv = float(snap.input_tokens_in_flight[c]) + float(snap.predicted_output_tokens_in_flight[c])
    params = models.params if snap.latency_params is None else snap.latency_params
    row: list[float] = policy.lists.get("params", params)[c]
    request = _Request(features)
    t_c, u_c, x, _ = _cost_terms(
        policy,
        request,
        row,
        float(snap.kv_capacity_tokens[c]),
        float(models.fallback_capacity_tokens[c]),
        float(models.max_num_seqs[c]),
        kv,
        request.ia if cached is None else request.ia - cached,
    )
    return t_c, u_c, (t_c * float(np.exp(x)) if x != 0.0 else t_c)


class _Request:
    """The request's sizes as :func:`_cost_terms` uses them (``amortised_request_s``'s own clamps)."""

    __slots__ = ("i", "o", "ia", "oa", "per_request", "s_tok")

    def __init__(self, features: RequestFeatures) -> None:
        self.i = i = float(features.input_tokens)
        self.o = o = float(features.predicted_output_tokens)
        self.ia = ia = float(max(i, 0))
        self.oa = oa = float(max(o, 0))
        self.per_request = max(1.0, ia + oa)
        self.s_tok = oa * ia + oa * (oa + 1.0) / 2.0


def _cost_terms(
    policy: MinMaxSettings,
    r: _Request,
    row: list[float],
    cap: float,
    fallback_cap: float,
    seqs: float,
    kv: float,
    uncached: float,
) -> tuple[float, float, float, float]:
    """One candidate's T_r^s, kvusage, capped exponent θ·g and batch b (Eq. 5-6, method.md §5), for
    prompt tokens ``uncached`` to prefill (clamped at 0) and KV ``kv`` in flight. Each max(a, b) /
    min(a, b) of two floats is written as the builtin's own comparison (b if b > a else a / b if b < a
    else a): the same value, NaN included, at a quarter of the cost."""
    cap = cap if math.isfinite(cap) else fallback_cap
    cap = 1.0 if cap < 1.0 else cap
    iu = 0.0 if uncached < 0.0 else uncached
    b = 1.0
    if policy.unit_time:
        t_c = 1.0
    else:
        p1, p2, p3, p4, p5, p6, p7, p8 = row
        i, o, oa, s_tok = r.i, r.o, r.oa, r.s_tok
        if policy.batch_kv == "full":
            bcap = cap
        else:
            half = i + o / 2.0
            bcap = cap * (i + o) / (half if half > 1.0 else 1.0)
        b = float(math.floor(bcap / r.per_request))
        b = 1.0 if b < 1.0 else b
        b = seqs if seqs < b else b
        total = p1 * b * iu + p2 * b + p3 * iu + p4 + p5 * b * s_tok + p6 * b * oa + p7 * s_tok + p8 * oa
        t_c = (0.0 if total < 0.0 else total) / b
    u_c = kv / cap
    if policy.overflow_only:
        g = u_c - 1.0
        g = 0.0 if g < 0.0 else g
    else:
        g = u_c
    x = policy.theta * g
    return t_c, u_c, (MAX_EXPONENT if x > MAX_EXPONENT else x), b


def _costs(
    policy: MinMaxSettings,
    features: RequestFeatures,
    snap: ClusterSnapshot,
    cand: list[int],
    cached: list[float] | None,
    n_req: list[int],
    peered: bool = False,
    fresh: bool = False,
) -> tuple[list[float], list[float], list[float], list[float], list[float] | None, list[float]]:
    """Per candidate: T_r^s, kvusage, the cost w = T·e^(θ·kvusage), (with the latency floor) the
    request's own predicted latency, (with a ``cache_weight`` ≠ 1 and some cache credit) the part of
    w the cached tokens save, and (``peered``: every candidate a peer, with the floor) the latency that
    decides among peers (:func:`~hetroute.policies.peers.peer_latency_s`), in the array path's operation order
    (Eq. 5-6, method.md §5); ``fresh``: r is a fresh prompt (:mod:`~hetroute.policies.fresh`)."""
    models, lists = policy.models, policy.lists
    caps_snap: list[float] = lists.get("caps", snap.kv_capacity_tokens)
    fallback: list[float] = lists.get("fallback", models.fallback_capacity_tokens)
    seqs: list[float] = lists.get("seqs", models.max_num_seqs)
    params = models.params if snap.latency_params is None else snap.latency_params
    all_rows: list[list[float]] = lists.get("params", params)
    rows = [all_rows[c] for c in cand]
    in_fl = snap.input_tokens_in_flight.tolist()
    gen = snap.generated_tokens_in_flight.tolist()
    if policy.kv_signal == "ledger":
        rem = snap.remaining_predicted_tokens.tolist()
        kv = [in_fl[c] + gen[c] + rem[c] for c in cand]
    else:
        pred = snap.predicted_output_tokens_in_flight.tolist()
        kv = [in_fl[c] + pred[c] for c in cand]
    peer_weight = policy.ttft_weight - policy.peer_prefill_weight  # κ − F_p (peers.peer_latency_s)
    queue_weight = policy.peer_queue_weight  # X
    if peered and queue_weight != 0.0 and all(n_req[c] >= seqs[c] for c in cand):
        queue_weight = 0.0  # every batch full: r waits for the work ahead (peers.slots_taken)
    peers_priced = peered and policy.latency_floor and (peer_weight != 0.0 or queue_weight != 0.0)
    prefill_queue = policy.prefill_queue
    wanted = prefill_queue or (peers_priced and queue_weight != 0.0)
    pending = snap.prefill_pending_tokens.tolist() if wanted else None
    input_tokens, output_tokens = features.input_tokens, features.predicted_output_tokens
    request = _Request(features)
    ia = request.ia
    # request_latency_s / prefill_s clamp the integer arguments
    il = float(max(input_tokens, 0))
    ol = float(max(output_tokens, 0))
    unit_time = policy.unit_time
    weighted = (
        cached is not None and policy.cache_weight != 1.0 and not unit_time and any(x > 0.0 for x in cached)
    )
    latency_floor = policy.latency_floor
    kappa = policy.ttft_weight
    full: list[float] = []  # T_prefill(1, I) per candidate, for a fresh prompt's κ term
    fastest = 0.0
    ratio = policy.fresh_near_ratio
    fresh_terms = fresh and kappa > 0.0
    # outside peers, the prefill of tokens a backend near the fastest holds counts κ_d more times
    # (.duplicate): m* the most such a backend holds
    duplicate = (
        policy.duplicate_weight
        if latency_floor and not (peered or fresh) and cached is not None and max(cached) > 0.0
        else 0.0
    )
    if fresh_terms:
        for row in rows:
            v = row[0] * il + row[1] + row[2] * il + row[3]
            full.append(0.0 if v < 0.0 else v)
        fastest = min(full)
    most = 0.0
    held: list[float] = []  # cached per candidate, where the duplicate price applies
    if duplicate > 0.0 and cached is not None:
        near_full = []
        for row in rows:
            v = (row[0] + row[2]) * il + (row[1] + row[3])
            near_full.append(0.0 if v < 0.0 else v)
        bound = ratio * min(near_full)
        # cached ≥ 0, so the largest credit near the fastest is ≥ 0 as well
        most = max(c for c, f in zip(cached, near_full, strict=True) if f <= bound)
        if most > 0.0:
            held = cached
        else:
            duplicate = 0.0
    # the queue ahead of a fresh prompt counts 1 + X_f times (with the floor's queue term)
    fresh_queue = policy.fresh_queue_weight if fresh and prefill_queue else 0.0
    saved_t: list[float] = []
    t_list: list[float] = []
    u_list: list[float] = []
    x_list: list[float] = []
    lat_list: list[float] = []
    peer_list: list[float] = []
    for k, c in enumerate(cand):
        row = rows[k]
        seq_c = seqs[c]
        uncached = ia if cached is None else ia - cached[k]
        t_c, u_c, x, b = _cost_terms(policy, request, row, caps_snap[c], fallback[c], seq_c, kv[k], uncached)
        t_list.append(t_c)
        u_list.append(u_c)
        x_list.append(x)
        if weighted:
            p1, p3 = row[0], row[2]
            iu = 0.0 if uncached < 0.0 else uncached
            saved_t.append((p1 * b + p3) * (ia - iu) / b)
        if latency_floor:
            # max(a, b) / min(a, b) of two floats as the builtin's own comparison (as in _cost_terms)
            p1, p2, p3, p4, p5, p6, p7, p8 = row
            n = float(n_req[c])
            mean_context = (in_fl[c] + gen[c] + input_tokens) / (n + 1.0)
            if cached is None:
                iul = il
            else:
                iul = il - cached[k]
                iul = 0.0 if iul < 0.0 else iul
            bl = n + 1.0
            bl = 1.0 if bl < 1.0 else bl
            bl = seq_c if seq_c < bl else bl
            kv_len = mean_context + ol / 2.0
            prefill = p1 * iul + p2 + p3 * iul + p4
            step = p5 * bl * kv_len + p6 * bl + p7 * kv_len + p8
            lat = prefill + ol * step
            lat = 0.0 if lat < 0.0 else lat
            queue = 0.0
            if pending is not None:
                waiting = pending[c]
                queue = (0.0 if p1 < 0.0 else p1) * (0.0 if waiting < 0.0 else waiting)
                if prefill_queue:
                    lat = lat + queue
            if kappa > 0.0:
                own_prefill = 0.0 if prefill < 0.0 else prefill
                if fresh_terms:
                    lat = lat + fresh_kappa_term(kappa, own_prefill, full[k], fastest, ratio)
                else:
                    lat = lat + kappa * own_prefill
            if fresh_queue != 0.0:
                lat = lat + fresh_queue * queue
            if duplicate > 0.0:
                lat = lat + duplicate_term(duplicate, p1 + p3, most - held[k])
            lat_list.append(lat)
            if peers_priced:
                peer = lat - peer_weight * (0.0 if prefill < 0.0 else prefill) if peer_weight != 0.0 else lat
                peer_list.append(peer + queue_weight * queue if queue_weight != 0.0 else peer)
    saved_list: list[float] | None = saved_t if weighted else None
    if any(x != 0.0 for x in x_list):  # exp(0) is exactly 1; otherwise numpy's exp, as the arrays do
        factors = np.exp(np.array(x_list)).tolist()
        w_list = [t * e for t, e in zip(t_list, factors, strict=True)]
        if saved_list is not None:
            saved_list = [t * e for t, e in zip(saved_list, factors, strict=True)]
    else:
        w_list = t_list
    return t_list, u_list, w_list, lat_list, saved_list, (peer_list if peers_priced else lat_list)


def _keep_session(
    policy: MinMaxSettings,
    snap: ClusterSnapshot,
    cand: list[int],
    score: list[float],
    own: list[float],
    chosen: int,
) -> int:
    """``MinMaxPolicy._keep_session`` on lists."""
    home = snap.session_backend
    if home < 0 or policy.session_slack <= 0.0 or home not in cand:
        return chosen
    j = cand.index(home)
    slack = 1.0 + policy.session_slack
    agree = score[j] <= score[chosen] * slack and own[j] <= own[chosen] * slack
    return j if agree else chosen


def _explore(
    policy: MinMaxSettings,
    rng: random.Random,
    features: RequestFeatures,
    snap: ClusterSnapshot,
    cand: list[int],
    n_req: list[int],
    chosen: int,
) -> int | None:
    """``MinMaxPolicy._explore`` on lists (the same single RNG draw, under the same conditions)."""
    samples = snap.model_samples
    if (
        policy.explore_share <= 0.0
        or samples is None
        or len(cand) < 2
        or output_bound(features) > policy.explore_max_output_tokens
    ):
        return None
    per: list[float] = policy.lists.get("samples", samples)
    counts = [float(per[c]) if n_req[c] == 0 else math.inf for c in cand]
    low = min(counts)
    k = counts.index(low)
    deficit = 1.0 - low / max(policy.explore_min_samples, 1)
    if deficit <= 0.0 or k == chosen:
        return None
    return k if rng.random() < policy.explore_share * deficit else None
