"""Peer fleets and the min-max's ``peer_latency`` option, on by default in ``balanced_minmax``
(docs/prefix.md, "``peer_latency``: equal backends decide by the request's own latency").

Candidates are **peers** when the router has every reason to think they are the same engine on the same
hardware:

- the same static latency model (``BackendModels.params``: the same profile, or the same catalog prior
  for the same GPU, TP, model and engine, or all on the neutral default);
- the same ``max_num_seqs``;
- the same KV capacity, known for each (reported by the engine or resolved from a profile, the config or
  the catalog; equal fallbacks say nothing about the hardware);
- on the neutral default, also the same live model (the snapshot's ``latency_params`` rows identical:
  members of one nothing-known pool, which publish one fit; a member whose own traffic says it differs
  leaves the pool and so the peers, see ``LiveModels._pool_nothing_known``).

On a fleet of peers the min-max's drain-time balance has nothing to trade between unequal machines;
:func:`peer_pick` lets r's own predicted latency decide there instead (the floor ``lat_r^s``: the prompts
waiting ahead of r, r's κ-weighted prefill and its decode next to the backend's batch, so it follows
the backend's load; between peers r's own prefill counts F_p times instead of κ and the wait behind
the queued prompts 1 + X times, :func:`peer_latency_s`). Why: under the min-max a backend that holds
the makespan takes only requests whose floor exceeds it everywhere else (long outputs), which keeps it
on top, while long prompts queue on the others; on four equal A100s at 1.2 load that lengthened the
p99 TTFT by 12-14 % against SGLang's cache-aware policy (docs/prefix.md).

A peer that slows down (throttled, a noisy neighbour) stays a peer: peers are judged by what the router
was told, and equal backends' own live fits differ too much (0.45-2.6× on the same requests) to tell a
2× slowdown from noise. The floor sees its queue and batch, not its speed, so it takes about a fifth
of the requests instead of the min-max's seventh: on four A100s with one slowed 2× (Mooncake at 1.2),
throughput −3 % (median of three seeds) and p99 TTFT about half the min-max's (docs/prefix.md; measured
with stop 40's weights among peers, not since).
"""

from __future__ import annotations

import numpy as np

from hetroute.policies.backend_model import NEUTRAL_PARAMS, BackendModels
from hetroute.types import ClusterSnapshot, FloatArray, IntArray

_NEUTRAL_ROW = np.array(NEUTRAL_PARAMS.as_tuple(), dtype=np.float64)


def all_peers(models: BackendModels, snapshot: ClusterSnapshot, candidates: IntArray) -> bool:
    """Whether every candidate is a peer of the first (module docstring); False for fewer than two."""
    if candidates.size < 2:
        return False
    static = models.params[candidates]
    first = static[0]
    if not bool((static == first).all()):
        return False
    seqs = models.max_num_seqs[candidates]
    if not bool((seqs == seqs[0]).all()):
        return False
    reported = snapshot.kv_capacity_tokens[candidates]
    resolved = models.static_capacity_tokens[candidates]
    capacity = np.where(np.isfinite(reported), reported, resolved)
    if not bool(np.isfinite(capacity).all()) or not bool((capacity == capacity[0]).all()):
        return False
    if snapshot.latency_params is not None and bool((first == _NEUTRAL_ROW).all()):
        live = snapshot.latency_params[candidates]
        return bool((live == live[0]).all())
    return True


def peer_latency_s(
    lat: FloatArray,
    own_prefill_s: FloatArray | None,
    ttft_weight: float,
    prefill_weight: float,
    queue_s: FloatArray | None = None,
    queue_weight: float = 0.0,
) -> FloatArray:
    """What decides among peers: the floor ``lat`` (κ = ``ttft_weight`` times r's own uncached prefill,
    once the prompts waiting ahead, ``queue_s`` = p1 · P_s) with that prefill, ``own_prefill_s`` =
    T_prefill(1, I_r − cached_s) per candidate, counted F_p = ``prefill_weight`` times instead and the
    wait counted 1 + X (X = ``queue_weight``) times:

        lat_peer_r^s = lat_r^s − (κ − F_p) · T_prefill(1, I_r − cached_s) + X · p1 · P_s

    (``lat`` itself where κ = F_p and X = 0; ``own_prefill_s`` is needed only where κ ≠ F_p, ``queue_s``
    only where X ≠ 0).

    Why F_p: between peers r's own prefill differs only by what its cached prefix saves, so κ (8 in
    ``balanced_minmax``, chosen to push misses onto faster machines) would count a hit eight times
    against the prompts waiting ahead of it. On four equal A100s with RAG documents at 0.7 load that
    lengthened the p99 TTFT to ×1.19 of the default without the prefix term (0.755 against 0.633 s).
    X weighs the wait behind the prompts queued at a holder against that saving. ``balanced_minmax``
    uses F_p = 6 and X = 1.5 since stop 41 (F_p = 3 and X = 0 before), which brought every homogeneous
    cell of the prefix benchmark within 3 % of the best baseline (docs/prefix.md, "Stop 41")."""
    out = lat
    if ttft_weight != prefill_weight:
        if own_prefill_s is None:
            raise ValueError("peer_latency_s: own_prefill_s is needed where ttft_weight != prefill_weight")
        out = out - (ttft_weight - prefill_weight) * own_prefill_s
    if queue_weight != 0.0:
        if queue_s is None:
            raise ValueError("peer_latency_s: queue_s is needed where queue_weight != 0")
        out = out + queue_weight * queue_s
    return out


def slots_taken(requests_in_flight: IntArray, max_num_seqs: FloatArray) -> bool:
    """Whether every candidate already runs as many requests as its batch holds (in flight ≥
    ``max_num_seqs``, both aligned with the candidates): then X counts for nothing among peers.

    X prices the wait behind prompts queued for a prefill, which r shares once it is admitted to the
    batch. With every peer's batch full (a burst: requests queued in the engines for a slot) r waits for
    running requests to finish first, which the drain time already prices; the queued prompt tokens
    then only say where the earlier requests of the burst went, and balancing them instead of the work
    cost four equal A100s a median 3.4 % of throughput on ShareGPT at rate ∞ (seeds 1-6; docs/prefix.md,
    "Stop 41", its "Rate ∞" bullet, fixed at stop 43). At the prefix benchmark's stored rates no batch
    fills on every peer, so those tables decide exactly as without this rule."""
    return bool((requests_in_flight >= max_num_seqs).all())


def peer_pick(lat: FloatArray, chosen: int) -> int:
    """The candidate with the smallest predicted latency ``lat`` (the first such in candidate order), or
    ``chosen`` unless one is strictly below its latency. Used only where :func:`all_peers` holds."""
    k = int(np.argmin(lat))  # the first smallest
    return k if float(lat[k]) < float(lat[chosen]) else chosen


class PeerMemo:
    """:func:`all_peers`, memoised: the answer is kept while the models' arrays and the snapshot's KV
    capacities and live parameters are the same read-only objects (replaced whole, never changed in
    place, as :class:`~hetroute.policies.minmax_scalar.ListCache` relies on too) and the candidates are
    the same backends. Holding the arrays keeps them alive, so identity cannot be reused. Inputs that can
    still be written to are tested every time."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[tuple[object, ...], IntArray, bool] | None = None

    def __call__(self, models: BackendModels, snapshot: ClusterSnapshot, candidates: IntArray) -> bool:
        arrays = (
            models.params,
            models.max_num_seqs,
            models.static_capacity_tokens,
            snapshot.kv_capacity_tokens,
            snapshot.latency_params,
        )
        held = self._held
        if (
            held is not None
            and all(a is b for a, b in zip(held[0], arrays, strict=True))
            and (
                (held[1] is candidates and not candidates.flags.writeable)
                or np.array_equal(held[1], candidates)
            )
        ):
            return held[2]
        answer = all_peers(models, snapshot, candidates)
        if all(a is None or not a.flags.writeable for a in arrays):
            kept = candidates.copy() if candidates.flags.writeable else candidates
            self._held = (arrays, kept, answer)
        return answer
