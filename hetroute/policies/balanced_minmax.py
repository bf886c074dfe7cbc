"""``balanced_minmax``: the paper's min-max mapper, made to balance predicted finish times.

Same mapper and the same release-exactly-once accounting as ``workload_minmax`` (method.md §5);
what changes is the cost and a latency floor:

    w_r^s   = T_r^s · exp(θ · max(kvusage_s − 1, 0))                       (θ default 0: w = T_r^s)
    lat_r^s = p1_s · P_s + (1 + κ) · T_prefill(1, U_r^s) + Õ_r · τ_decode(L̄_s + Õ_r/2, n_s + 1)
    c       = argmin_s max( max_{j≠s} L_j , max(L_s + w_r^s, lat_r^s) )
              (ties: smallest max(L_s + w, lat), then fewest P_s, then seeded random); L_c += w_r^c

``P_s`` is the ledger's ``prefill_pending_tokens`` (Σ I of requests on s without a first token yet) and
``p1_s`` the per-token cost of a batched prefill, so ``p1_s · P_s`` is the time s needs to prefill
the prompts queued ahead of r; κ (``ttft_weight``, default 8) counts r's own prefill, its TTFT on
an idle backend, κ more times, so that between backends with similar predicted latency the one
that prefills r sooner wins. The queue term is counted once on purpose: Σ_r p1·I_r is part of the
drain time L_s (each in-flight w includes ≈ p1·I), so ``p1_s · P_s`` stays below about L_s and the
floor does not override the drain-time balance at saturation. Weighted more, it does: ×2 cost 12 %
of throughput at rate ∞ on paper-a with azure-conv prompts, ×4 (with κ = 3) 26-32 % on paper-a and
mixed.

Why. T_r^s, the amortised time of r at the backend's KV-saturating batch, is the time r adds to a
*saturated* backend, so ``L_s`` (Σ in-flight w) is the backend's predicted drain time, and for a
saturated FCFS backend ``L_s + w_r^s`` is r's predicted completion time (wait (N−B)·T̄ plus its own
batch time B·T̄). Keeping these equal across backends balances finish times in proportion to each
backend's real throughput (greedy min-makespan list scheduling on unrelated machines, which also sends
each backend the requests it is relatively best at: short ones to KV-poor backends). Under light load
``L_s + w`` underestimates latency, because a request on a lightly loaded backend runs at the speed of
a small batch, not at 1/B of a full one; ``lat_r^s`` (Hetis-style: the prefill alone, then Õ decode
steps next to the backend's n_s in-flight requests of mean context L̄_s) takes over there, so light
load stays on the fastest backends instead of spilling onto weak ones (shorter tails, lower TTFT).
The paper's ``exp(θ·kvusage)`` inflates a request's cost as soon as a backend holds *any* KV, which at
high load turns the split from throughput-proportional into memory-proportional and leaves instances
finishing at visibly different times; here the exponential, when θ > 0, only penalises work queued
beyond the KV capacity. The benchmark (docs/policies.md) found θ = 0 best.

Where the floors tie exactly (every candidate on the neutral default before its first fit: no batch,
context or queue term, so the same value on each), the backend with the fewest prompt tokens waiting
for a first token (``P_s``, counted by the ledger, no model needed) takes r before a coin is tossed:
a run of coins could stack several long prompts on one backend while another stood idle (docs/learning.md,
"The prior").

Params: ``theta`` (default 0), ``latency_floor`` (default true), ``prefill_queue`` (default true: the
``p1_s · P_s`` term), ``ttft_weight`` (κ ≥ 0, default 8; 0 gives the plain latency), ``kv_signal``
(``ledger``/``engine``/``max``), ``batch_kv`` (``full``/``average``), ``seed``. κ = 8 was chosen on
the simulator benchmark (docs/policies.md): 4 helps less, 16 raises p99 TTFT on paper-b at 24 req/s.

Prefix-cache locality (docs/prefix.md): with ``prefix`` (default true) T_r^s and r's own prefill (κ
included) count only the prompt tokens not estimated cached on s, ``U_r^s = I_r − cached_s``
(``ClusterSnapshot.prefix_cached_tokens``; ``U_r^s = I_r`` without the term), with no credit on a
backend far busier than every other in drain time or in prompts waiting for a first token (the balance
guards), and on a backend whose model has no queue term yet (p1 = 0, the neutral default before its
first fit) less the prompt tokens it has waiting beyond the least-waiting candidate; ``P_s`` keeps the
whole prompts.
``cache_weight`` (F, default 3) counts the prefill a hit saves F times where the min-max is
indifferent: with ``D_s = L_s + w_r^s − (F − 1)·(p1·b + p3)·cached_s/b`` (the share of w_r^s the cached
tokens save), the score takes ``max(D_s, L_s, lat)`` (never below the backend's own drain time) and ties
go to the smallest ``max(D_s, lat)``; the ledger is charged w_r^s itself.
``session_slack`` (default 0.1) keeps a session on its last backend while that is within 10 % of the
choice.

``peer_latency`` (default true since stop 40): where every candidate is a peer (the same engine on the
same hardware as far as the router knows, :mod:`.peers`), r's own predicted latency ``lat_r^s`` picks
the backend instead of the min-max, with r's own prefill counted ``peer_prefill_weight`` times (F_p,
default 6 since stop 41; 3 before) instead of κ and the wait behind the prompts already queued counted
1 + ``peer_queue_weight`` times (X, default 1.5 since stop 41; 0 before; once while every peer's batch
is full, :func:`~hetroute.policies.peers.slots_taken`, since stop 43)
(:func:`~hetroute.policies.peers.peer_latency_s`), ties keeping the min-max's choice (docs/prefix.md,
"``peer_latency``: equal backends decide by the request's own latency", and "Stop 41" for the two
weights). ``false`` gives the min-max on such fleets too.

``fresh_prompt_tokens`` (N, default 7,168 since stop 46; 0 turns it off) and ``fresh_near_ratio`` (ρ,
default 3): a request whose prompt head is cached somewhere but with at least N of its prompt tokens
cached on no candidate is *fresh*; outside a fleet of peers, its κ term is 0 on the backends that
prefill the whole prompt within ρ times the fastest one's time, and κ times what a slower backend
prefills beyond the fastest one elsewhere (:mod:`.fresh`; docs/prefix.md, "Fresh prompts").
``fresh_queue_weight`` (X_f, default 1.5 since stop 47; 0 before) counts the prompts queued ahead of a
fresh prompt 1 + X_f times in its floor, as among peers (docs/prefix.md, "Fresh prompts").
``duplicate_weight`` (κ_d, default 16 since stop 48; 0 turns it off): outside a fleet of peers, for a
request that is not fresh, the prefill of the prompt tokens that a backend near the fastest holds and
candidate s lacks counts κ_d more times in s's floor, κ_d · max(p1 + p3, 0) · max(0, m* − cached_s),
a price for the copy s would cache and the eviction it causes (:mod:`.duplicate`; docs/prefix.md,
"Duplicates").
"""

from __future__ import annotations

from collections.abc import Mapping

from hetroute.policies.base import PolicyContext
from hetroute.policies.duplicate import DUPLICATE_WEIGHT
from hetroute.policies.fresh import FRESH_NEAR_RATIO, FRESH_PROMPT_TOKENS, FRESH_QUEUE_WEIGHT
from hetroute.policies.workload_minmax import MinMaxParams, MinMaxPolicy, build_minmax

CACHE_WEIGHT = 3.0
"""The prefill a cache hit saves counts three times where the min-max is indifferent (docs/prefix.md)."""
PEER_PREFILL_WEIGHT = 6.0
"""Among peers r's own prefill (what a cached prefix saves) counts six times (docs/prefix.md, "Stop 41")."""
PEER_QUEUE_WEIGHT = 1.5
"""Among peers the wait behind the prompts already queued counts 1 + 1.5 times (docs/prefix.md, "Stop 41")."""
SESSION_SLACK = 0.1
"""A session stays on its last backend while that backend's min-max score is within 10 % of the best."""


def from_config(params: Mapping[str, object], ctx: PolicyContext) -> MinMaxPolicy:
    """``balanced_minmax``: min-max of predicted finish time (drain time with a latency floor)."""
    defaults = MinMaxParams(
        theta=0.0,
        latency_floor=True,
        prefill_queue=True,
        ttft_weight=8.0,
        prefix=True,
        cache_weight=CACHE_WEIGHT,
        session_slack=SESSION_SLACK,
        peer_latency=True,
        peer_prefill_weight=PEER_PREFILL_WEIGHT,
        peer_queue_weight=PEER_QUEUE_WEIGHT,
        fresh_prompt_tokens=FRESH_PROMPT_TOKENS,
        fresh_near_ratio=FRESH_NEAR_RATIO,
        fresh_queue_weight=FRESH_QUEUE_WEIGHT,
        duplicate_weight=DUPLICATE_WEIGHT,
    )
    return build_minmax("balanced_minmax", params, ctx, defaults, overflow_only=True)
