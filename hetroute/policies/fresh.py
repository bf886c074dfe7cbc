"""Fresh prompts: how the latency floor's κ treats a long prompt no backend holds (docs/prefix.md,
"Fresh prompts").

A request r is *fresh* when the router's prefix index holds the head of its prompt on some candidate
(the prefix term is on for it: ``cached`` is not None) but at least N = ``fresh_prompt_tokens`` of its
prompt are cached on none:

    I_r − max_s cached_s ≥ N

For a fresh request the floor's κ term, κ · T_prefill(1, U_r^s) (``balanced_minmax``), becomes

    0                                         where T_prefill,s(1, I_r) ≤ ρ · T*   (near the fastest)
    κ · max(0, T_prefill(1, U_r^s) − T*)      elsewhere

with T* = min_j T_prefill,j(1, I_r), the fastest candidate's prefill of the whole prompt, and
ρ = ``fresh_near_ratio``. Among backends within ρ of the fastest, the drain time (and the cache weight)
places r instead of its own prefill; a slower backend keeps a penalty of κ times what it prefills
beyond the fastest one, so a fresh prompt does not spill onto it any more than before. The floor's
queue term, p1_s · P_s, counts 1 + X_f times for a fresh prompt (``fresh_queue_weight``; X_f = 1.5 in
``balanced_minmax`` since stop 47, as among peers): placed by drain time, long new prompts otherwise
stacked behind each other on one backend of a fleet of near-equal ones (paper-b: p99 TTFT ×1.6 of the
default without the prefix term on the Mooncake trace, docs/prefix.md).

Why: κ (8) is there to break near-ties between backends in favour of the one that prefills r sooner,
but on a long prompt κ · T_prefill is seconds, so every long new prompt went to the fastest backend.
Its KV cache then turned over faster than the conversations came back (on the mixed fleet with the
Mooncake trace the H100 evicted chunks a median 23 s after their last use, while 69 % of reused chunks
came back later than 22 s), and the hit rate stayed at 66 % of ``prefix_scorer``'s. Spread by drain
time over the backends of near-equal speed, the same prompts stay cached until their next turn. A
prompt with its head cached nowhere decides exactly as without the prefix term (unchanged here), and
among peers (``peer_latency``) κ plays no part, so neither is affected.
"""

from __future__ import annotations

import numpy as np

from hetroute.types import FloatArray

FRESH_PROMPT_TOKENS = 7168
"""``balanced_minmax``'s N: prompts with at least this many tokens cached on no candidate are fresh.
Chosen on the simulator benchmark (docs/prefix.md, "Fresh prompts"): 4,096 and 5,120 also caught RAG
prompts whose documents were new and cost them hits; 6,144 to 7,168 did not."""
FRESH_QUEUE_WEIGHT = 1.5
"""``balanced_minmax``'s X_f: the prompts queued ahead of a fresh prompt count 1 + 1.5 times in its floor,
as the wait behind queued prompts does among peers (``PEER_QUEUE_WEIGHT``, docs/prefix.md "Stop 41").
Adopted at stop 47 on paper-b, a fleet the rule was not tuned on (docs/prefix.md, "Fresh prompts")."""
FRESH_NEAR_RATIO = 3.0
"""``balanced_minmax``'s ρ: backends prefilling the whole prompt within 3 × the fastest one's time are
near it (the benchmark's H100 and A100s, 2.3 ×, are; its V100 TP1 beside a V100 TP4, 3.5 ×, is not)."""


def may_be_fresh(input_tokens: float, threshold: float) -> bool:
    """Whether r can be fresh at all (``threshold`` > 0 and a prompt at least that long: cached_s ≥ 0),
    asked before the maximum over the candidates that :func:`is_fresh` needs."""
    return threshold > 0.0 and input_tokens >= threshold


def is_fresh(input_tokens: float, most_cached: float, threshold: float) -> bool:
    """Whether r is fresh: ``threshold`` > 0 and at least that many of its ``input_tokens`` are cached
    on no candidate (``most_cached`` = max_s cached_s)."""
    return threshold > 0.0 and input_tokens - most_cached >= threshold


def fresh_kappa_terms(
    kappa: float, own_prefill_s: FloatArray, full_prefill_s: FloatArray, near_ratio: float
) -> FloatArray:
    """The κ term of a fresh request per candidate (module docstring): ``own_prefill_s`` =
    T_prefill(1, U_r^s) ≥ 0, ``full_prefill_s`` = T_prefill(1, I_r) ≥ 0."""
    fastest = float(full_prefill_s.min())
    out: FloatArray = np.where(
        full_prefill_s <= near_ratio * fastest, 0.0, kappa * np.maximum(own_prefill_s - fastest, 0.0)
    )
    return out


def fresh_kappa_term(
    kappa: float, own_prefill_s: float, full_prefill_s: float, fastest: float, near_ratio: float
) -> float:
    """:func:`fresh_kappa_terms` for one candidate, in the same float operations (``fastest`` = T*)."""
    if full_prefill_s <= near_ratio * fastest:
        return 0.0
    excess = own_prefill_s - fastest
    return kappa * (0.0 if excess < 0.0 else excess)
