"""The paper's throughput estimate (Xiong et al., Algorithm 1 "System Throughput Estimation"), bugs fixed.

Owns: :func:`algorithm1_estimate` and :class:`Algorithm1Estimate`. Method (method.md §4):

- Requests are taken in arrival order and grouped greedily into the largest static batch whose KV fits,
  ``Σ_{r∈batch} I_r + |batch| · max_{r∈batch} O_r ≤ cap`` (tokens), and that has at most ``max_num_seqs``
  requests (fix: the paper has no cap).
- Each batch costs Eq. 3 + Eq. 4 at its longest input and output (padding, as in the paper):
  ``T = T_prefill(b, I_max) + T_decode(b, I_max, O_max)``.
- One instance's throughput is ``Σ (I_r + O_r) / Σ T``; the machine's is ``(u/t) ·`` that (fix: the paper
  returns ``t ·`` that).
- The loop ends when every request is batched (fix: the paper's ``> q`` never fires); a request that alone
  exceeds the capacity makes the configuration infeasible (fix: the paper loops forever).

Pure function of its inputs; no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetroute.latency import LatencyParams


@dataclass(frozen=True, slots=True)
class Algorithm1Estimate:
    """Result of Algorithm 1 for one configuration. ``infeasible_reason`` is None when it ran."""

    instance_tokens_per_s: float
    machine_tokens_per_s: float
    total_time_s: float
    batches: int
    largest_batch: int
    infeasible_reason: str | None = None


def algorithm1_estimate(
    params: LatencyParams,
    requests: Sequence[tuple[int, int]],
    kv_capacity_tokens: int,
    max_num_seqs: int,
    instances: int,
) -> Algorithm1Estimate:
    """Estimate throughput (tokens/s) of ``instances`` identical instances on ``requests`` = [(I, O), ...]."""
    if not requests:
        raise ValueError("algorithm1_estimate needs at least one request")
    if max_num_seqs < 1 or instances < 1:
        raise ValueError("max_num_seqs and instances must be >= 1")
    for i, (inp, out) in enumerate(requests):
        if inp + out > kv_capacity_tokens:
            return Algorithm1Estimate(
                0.0,
                0.0,
                0.0,
                0,
                0,
                f"request {i} needs {inp + out} KV tokens > capacity {kv_capacity_tokens}",
            )
    total_s = 0.0
    batches = 0
    largest = 0
    n = len(requests)
    begin = 0
    while begin < n:  # every request is batched exactly once; each pass batches >= 1
        sum_in = 0
        max_in = 0
        max_out = 0
        end = begin
        while end < n and end - begin < max_num_seqs:
            inp, out = requests[end]
            cand_out = max(max_out, out)
            if sum_in + inp + (end - begin + 1) * cand_out > kv_capacity_tokens:
                break
            sum_in += inp
            max_in = max(max_in, inp)
            max_out = cand_out
            end += 1
        b = end - begin
        total_s += params.prefill_s(b, max_in) + params.decode_s(b, max_in, max_out)
        batches += 1
        largest = max(largest, b)
        begin = end
    tokens = sum(i + o for i, o in requests)
    if total_s <= 0.0:
        return Algorithm1Estimate(0.0, 0.0, 0.0, batches, largest, "the profile predicts non-positive time")
    per_instance = tokens / total_s
    return Algorithm1Estimate(per_instance, per_instance * instances, total_s, batches, largest)
