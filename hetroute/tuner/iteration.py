"""Iteration-level continuous-batching estimate of one instance, driven by fitted p1..p8 (method.md §4).

Owns: :func:`simulate_instance` and :class:`InstanceRun`. It mirrors the scheduling rules of
:mod:`hetroute.sim.engine_model` (vLLM V1 flavour) but times each step with the profile's curves instead of
the roofline, so it needs nothing but a :class:`LatencyProfile`'s parameters:

- FCFS. Every step first serves the running requests (one token per decoding sequence, the next chunk of a
  prompt still being prefilled), then admits waiting requests while ``running < max_num_seqs``, the step's
  token budget ``max_num_batched_tokens`` is not spent and their prompt fits in the free KV tokens.
- KV is allocated lazily (held tokens = computed tokens). When decoding needs more than the capacity, the
  newest running request is preempted by recompute: it returns to the front of the queue and later
  re-prefills prompt + generated tokens.
- Step time. A decode step over ``b`` sequences holding ``S`` KV tokens in total costs
  ``τ = p5·S + p6·b + p7·S/b + p8`` (Eq. 4's per-step term with L = S/b); prefill of ``P`` tokens from
  ``n`` prompts adds ``p1·P + p2·n + p3·P/n`` and, when the step has no decode, ``p4`` (Eq. 3).
- Pure-decode stretches are jumped analytically (k steps cost ``k·τ(S₀) + (p5·b + p7)·k(k−1)/2``) up to
  the next finish, KV exhaustion or arrival, so a run costs O(events · log n), not O(tokens).

Throughput is Σ(input + output tokens) / makespan. With ``arrivals_s`` the same loop yields TTFT and TPOT.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetroute.latency import LatencyParams


@dataclass(frozen=True, slots=True)
class InstanceRun:
    """What one simulated instance did. Latency figures are NaN when not measurable."""

    tokens_per_s: float
    makespan_s: float
    steps: int
    preemptions: int
    mean_batch: float
    ttft_p90_s: float
    tpot_p90_s: float
    ttft_mean_s: float
    tpot_mean_s: float


def _decode_time(p: LatencyParams, b: int, s: float, k: int) -> float:
    """Time of k consecutive decode steps of b sequences starting from S = s held KV tokens."""
    first = p.p5 * s + p.p6 * b + p.p7 * s / b + p.p8
    return k * first + (p.p5 * b + p.p7) * k * (k - 1) / 2.0


def _steps_until(p: LatencyParams, b: int, s: float, delta_s: float) -> int:
    """Smallest k >= 1 whose k decode steps last at least ``delta_s``."""
    a = p.p5 * s + p.p6 * b + p.p7 * s / b + p.p8
    c = p.p5 * b + p.p7
    if delta_s <= 0:
        return 1
    if c <= 1e-18:
        return max(1, math.ceil(delta_s / a)) if a > 0 else 1
    # k·a + c·k(k−1)/2 >= delta  ⇔  (c/2)k² + (a − c/2)k − delta >= 0
    half = c / 2.0
    k = (-(a - half) + math.sqrt((a - half) ** 2 + 4 * half * delta_s)) / (2 * half)
    return max(1, math.ceil(k - 1e-9))


def simulate_instance(
    params: LatencyParams,
    requests: Sequence[tuple[int, int]],
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    arrivals_s: Sequence[float] | None = None,
) -> InstanceRun:
    """Serve ``requests`` [(I, O), ...] on one instance; all arrive at 0 unless ``arrivals_s`` is given."""
    n = len(requests)
    if n == 0:
        raise ValueError("simulate_instance needs at least one request")
    for i, (inp, out) in enumerate(requests):
        if inp < 1 or out < 1 or inp + out > kv_capacity_tokens:
            raise ValueError(
                f"request {i} ({inp}+{out} tokens) cannot run with capacity {kv_capacity_tokens}"
            )
    p = params
    arrivals = list(arrivals_s) if arrivals_s is not None else [0.0] * n
    order = sorted(range(n), key=lambda r: arrivals[r])
    inp_of = [r[0] for r in requests]
    out_of = [r[1] for r in requests]
    generated = [0] * n
    todo = [0] * n  # prompt tokens still to (re)compute while prefilling
    computed = [0] * n
    first_s = [math.nan] * n
    finish_s = [math.nan] * n
    version = [0] * n
    base = [0] * n  # decoders: computed = base + counter
    waiting: deque[int] = deque()
    prefilling: list[int] = []  # admission order
    finish_heap: list[tuple[int, int, int]] = []  # (finish counter, version, r)
    newest_heap: list[tuple[int, int, int]] = []  # (−admission seq, version, r) over running requests
    n_dec = 0
    sum_base = 0
    counter = 0
    used_prefill = 0  # KV tokens held by prefilling requests
    now = 0.0
    next_arrival = 0
    done = 0
    steps = 0
    preemptions = 0
    batch_acc = 0.0
    admit_seq = 0

    def held() -> int:
        return sum_base + n_dec * counter + used_prefill

    def join_decode(r: int) -> None:
        nonlocal n_dec, sum_base
        n_dec += 1
        base[r] = computed[r] - counter
        sum_base += base[r]
        heapq.heappush(finish_heap, (counter + out_of[r] - generated[r], version[r], r))

    def preempt_newest() -> None:
        nonlocal n_dec, sum_base, used_prefill, preemptions
        while newest_heap:
            _, ver, r = heapq.heappop(newest_heap)
            if ver != version[r]:
                continue
            version[r] += 1
            if r in prefilling:
                prefilling.remove(r)
                used_prefill -= computed[r]
            else:
                n_dec -= 1
                sum_base -= base[r]
            computed[r] = 0
            todo[r] = inp_of[r] + generated[r]
            waiting.appendleft(r)
            preemptions += 1
            return
        raise AssertionError("preemption with nothing running")

    while done < n:
        while next_arrival < n and arrivals[order[next_arrival]] <= now:
            r = order[next_arrival]
            todo[r] = inp_of[r]
            waiting.append(r)
            next_arrival += 1
        running = n_dec + len(prefilling)
        if running == 0 and not waiting:
            now = arrivals[order[next_arrival]]
            continue
        budget = max_num_batched_tokens - n_dec
        # decoders need one more KV token each this step; preempt the newest until they fit
        while n_dec and held() + n_dec > kv_capacity_tokens:
            preempt_newest()
        running = n_dec + len(prefilling)
        can_admit = bool(waiting) and running < max_num_seqs and budget > 0
        can_admit = can_admit and held() + n_dec + min(todo[waiting[0]], budget) <= kv_capacity_tokens
        if prefilling or can_admit or n_dec == 0:
            # one explicit (mixed) step
            chunks: list[tuple[int, int]] = []
            for r in prefilling:
                if budget <= 0:
                    break
                c = min(todo[r], budget)
                chunks.append((r, c))
                budget -= c
            free = kv_capacity_tokens - held() - n_dec - sum(c for _, c in chunks)
            while waiting and budget > 0 and n_dec + len(prefilling) < max_num_seqs:
                r = waiting[0]
                c = min(todo[r], budget)
                if c > free:
                    break
                waiting.popleft()
                prefilling.append(r)
                admit_seq += 1
                heapq.heappush(newest_heap, (-admit_seq, version[r], r))
                chunks.append((r, c))
                budget -= c
                free -= c
            if not chunks and n_dec == 0:
                raise AssertionError("no progress possible")  # unreachable: a request always fits alone
            p_tokens = sum(c for _, c in chunks)
            dt = 0.0
            if n_dec:
                dt += _decode_time(p, n_dec, sum_base + n_dec * counter, 1)
            if chunks:
                dt += p.p1 * p_tokens + p.p2 * len(chunks) + p.p3 * p_tokens / len(chunks)
                if not n_dec:
                    dt += p.p4
            now += max(dt, 0.0)
            steps += 1
            batch_acc += n_dec + len(chunks)
            if n_dec:
                counter += 1
            for r, c in chunks:
                todo[r] -= c
                computed[r] += c
                used_prefill += c
                if todo[r] == 0:
                    prefilling.remove(r)
                    used_prefill -= computed[r]
                    generated[r] += 1
                    if math.isnan(first_s[r]):
                        first_s[r] = now
                    if generated[r] >= out_of[r]:
                        finish_s[r] = now
                        version[r] += 1
                        done += 1
                    else:
                        join_decode(r)
        else:
            # pure decode: jump to the next finish, KV exhaustion or arrival
            s0 = sum_base + n_dec * counter
            k = finish_heap[0][0] - counter if finish_heap else 1
            k = min(k, max(1, (kv_capacity_tokens - used_prefill - s0) // n_dec))
            if next_arrival < n and running < max_num_seqs:
                k = min(k, _steps_until(p, n_dec, s0, arrivals[order[next_arrival]] - now))
            k = max(k, 1)
            now += max(_decode_time(p, n_dec, s0, k), 0.0)
            steps += k
            batch_acc += n_dec * k
            counter += k
        while finish_heap and finish_heap[0][0] <= counter:
            _, ver, r = heapq.heappop(finish_heap)
            if ver != version[r]:
                continue
            version[r] += 1
            generated[r] = out_of[r]
            n_dec -= 1
            sum_base -= base[r]
            finish_s[r] = now
            done += 1
    tokens = sum(inp_of) + sum(out_of)
    start = min(arrivals)
    makespan = now - start
    ttft = np.array([first_s[r] - arrivals[r] for r in range(n)])
    tpot = np.array([(finish_s[r] - first_s[r]) / (out_of[r] - 1) for r in range(n) if out_of[r] > 1])
    return InstanceRun(
        tokens_per_s=tokens / makespan if makespan > 0 else math.inf,
        makespan_s=makespan,
        steps=steps,
        preemptions=preemptions,
        mean_batch=batch_acc / steps if steps else 0.0,
        ttft_p90_s=float(np.quantile(ttft, 0.9)),
        tpot_p90_s=float(np.quantile(tpot, 0.9)) if tpot.size else math.nan,
        ttft_mean_s=float(ttft.mean()),
        tpot_mean_s=float(tpot.mean()) if tpot.size else math.nan,
    )


@dataclass(frozen=True, slots=True)
class MachineRun:
    """The iteration-level estimate of one machine: each instance serves its round-robin share."""

    tokens_per_s: float
    instance_tokens_per_s: float
    makespan_s: float
    preemptions: int
    mean_batch: float


def simulate_machine(
    params: LatencyParams,
    requests: Sequence[tuple[int, int]],
    instances: int,
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> MachineRun:
    """All ``requests`` arrive at t = 0 and are dealt round-robin over ``instances`` identical instances.

    The machine's makespan is the slowest instance's (round-robin leaves shares of unequal work, which
    costs a machine of many small instances more than one of a few large ones).
    """
    if instances < 1 or len(requests) < instances:
        raise ValueError(
            f"need at least one request per instance ({len(requests)} requests, {instances} instances)"
        )
    runs = [
        simulate_instance(
            params, requests[k::instances], kv_capacity_tokens, max_num_seqs, max_num_batched_tokens
        )
        for k in range(instances)
    ]
    makespan = max(r.makespan_s for r in runs)
    tokens = sum(i + o for i, o in requests)
    return MachineRun(
        tokens_per_s=tokens / makespan,
        instance_tokens_per_s=sum(r.tokens_per_s for r in runs) / instances,
        makespan_s=makespan,
        preemptions=sum(r.preemptions for r in runs),
        mean_batch=sum(r.mean_batch for r in runs) / instances,
    )
