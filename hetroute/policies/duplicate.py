"""Duplicated prefixes: the latency floor's price for prefilling again what a fast backend holds
(docs/prefix.md, "Duplicates").

For a request r with cache credit (the prefix term on: ``cached`` is not None, some candidate > 0),
outside a fleet of peers and unless r is fresh (:mod:`.fresh`), let m* be the most of r's prompt held
by a candidate *near the fastest*: one whose T_prefill(1, I_r) is within ρ (``fresh_near_ratio``, 3)
of the smallest. Candidate s's floor gains

    κ_d · max(0, T_prefill,s(1, I_r − cached_s) − T_prefill,s(1, I_r − m*))
      = κ_d · max(p1_s + p3_s, 0) · max(0, m* − cached_s)

(T_prefill(1, I) = p1·I + p2 + p3·I + p4 is linear in the prompt): the prefill of the m* − cached_s
tokens that s would compute although a near backend holds them, counted κ_d = ``duplicate_weight``
more times, on top of the 1 + κ times r's own prefill already counts. The holder pays nothing.

Why: sending r where less of it is cached costs more than r's own longer prefill. The copy s computes
takes blocks of s's KV cache, so s evicts as many tokens of other prefixes, while the holder's copy goes
unused and ages towards its own eviction. r's own latency, which the floor prices, sees none of this,
and on a mixed fleet it preferred the fastest backend's full prefill to a slower backend's partial one:
on the mixed fleet with RAG documents and nothing known (load 0.7, seed 1), 227 of 2,000 decisions sent
a prompt to the H100 although an A100 held its first document, and the H100's cache turned over at a
0.29 hit rate against the A100s' 0.61 and 0.52. The drain-time guards, which take the cache credit
from a backend far busier than the others, take this price with it (it reads the guarded ``cached``).

Holders far from the fastest do not count: a prefix on a slow backend is not worth keeping r off a fast
one (the floor's κ term already keeps r off the slow one). Counting them cost paper-a's Mooncake
trace its hit-rate bar at 1.2 load (docs/prefix.md). A fresh prompt is placed by drain time
among the near backends, and the duplicate of its short cached head would undo that. Among peers κ
plays no part (``peer_latency`` decides by r's own latency, :mod:`.peers`), and neither does this term.
"""

from __future__ import annotations

import numpy as np

from hetroute.types import FloatArray

DUPLICATE_WEIGHT = 16.0
"""``balanced_minmax``'s κ_d: the prefill of tokens a near backend holds counts 16 more times in the
floor. Chosen on the simulator benchmark (docs/prefix.md, "Duplicates"): on the mixed fleet's RAG cell
at 0.7 load with nothing known the engines' hit rate was 0.366 without the term and 0.369 / 0.373 /
0.382 / 0.387 with κ_d = 3 / 8 / 16 / 32 (medians of seeds 1-3, in the term's first form, which
counted every holder), with median p99 TTFT 0.641-0.647 s for each."""


class DuplicateSlopes:
    """Per backend, from a p1..p8 table: the slope p1 + p3 and intercept p2 + p4 of T_prefill(1, I), and
    κ_d · max(p1 + p3, 0), the term's price per lacking token. Kept while the table is the same
    read-only object (replaced whole, never changed in place, as :class:`~.peers.PeerMemo` relies on
    too); a writable table is computed every time."""

    __slots__ = ("_held", "_weight")

    def __init__(self, weight: float) -> None:
        self._weight = weight
        self._held: tuple[FloatArray, FloatArray, FloatArray, FloatArray] | None = None

    def __call__(self, params: FloatArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(slope, intercept, price per lacking token) for every row of ``params``."""
        held = self._held
        if held is not None and held[0] is params:
            return held[1], held[2], held[3]
        slope = params[:, 0] + params[:, 2]
        intercept = params[:, 1] + params[:, 3]
        price: FloatArray = self._weight * np.maximum(slope, 0.0)
        if not params.flags.writeable:
            self._held = (params, slope, intercept, price)
        return slope, intercept, price


def most_held_near(
    cached: FloatArray, slope: FloatArray, intercept: FloatArray, input_tokens: float, near_ratio: float
) -> float:
    """m*: the most of r's prompt (``cached`` ≥ 0 per candidate) held by a candidate near the fastest,
    whose T_prefill(1, I_r) = max(slope · I + intercept, 0) (slope = p1 + p3, intercept = p2 + p4) is
    at most ``near_ratio`` times the smallest (:mod:`.fresh`'s ρ); 0 when none holds any.

    Exactly that value, found cheaply in the common case: when the candidate holding the most is near
    the fastest, m* is its credit, and only the smallest T_prefill is needed for the test (the
    smallest of the clamped values is the clamp of the smallest line value); the mask over every
    candidate is built only when the largest holder is far."""
    top = int(cached.argmax())
    most = float(cached[top])
    if not most > 0.0:
        return 0.0  # no candidate holds any of r's prompt
    line = slope * input_tokens + intercept
    fastest = float(np.minimum.reduce(line))
    bound = near_ratio * (fastest if fastest > 0.0 else 0.0)
    held = float(line[top])
    if (held if held > 0.0 else 0.0) <= bound:
        return most
    return float(cached[np.maximum(line, 0.0) <= bound].max())


def duplicate_terms(price: FloatArray, lacking_tokens: FloatArray) -> FloatArray:
    """κ_d · max(p1 + p3, 0) · max(m* − cached_s, 0) per candidate (``price`` = κ_d · max(p1 + p3, 0),
    :class:`DuplicateSlopes`; ``lacking_tokens`` = m* − cached_s): the module docstring's term,
    T_prefill being linear in the prompt."""
    out: FloatArray = np.maximum(lacking_tokens, 0.0)
    out *= price
    return out


def duplicate_term(weight: float, slope: float, lacking_tokens: float) -> float:
    """:func:`duplicate_terms` for one candidate (``slope`` = p1 + p3), in the same float operations."""
    return weight * (0.0 if slope < 0.0 else slope) * (0.0 if lacking_tokens < 0.0 else lacking_tokens)
