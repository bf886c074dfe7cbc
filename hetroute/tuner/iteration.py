"""Iteration-level continuous-batching estimate of one instance, driven by fitted p1..p8 (method.md §4).

Owns: :func:`simulate_instance` (a thin wrapper over the private ``_InstanceSim`` state machine) and
:class:`InstanceRun`. It mirrors the scheduling rules of
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
    arrivals = list(arrivals_s) if arrivals_s is not None else [0.0] * n
    sim = _InstanceSim(params, requests, arrivals, kv_capacity_tokens, max_num_seqs, max_num_batched_tokens)
    sim.run()
    return sim.result()


class _InstanceSim:
    """The mutable state of one :func:`simulate_instance` run and the steps that advance it.

    Invariants between steps: a request is in exactly one of not-yet-arrived, ``waiting``, ``prefilling``,
    decoding (counted by ``n_dec``) or done. A decoder ``r`` holds ``base[r] + counter`` computed tokens,
    so a decode step advances every decoder by bumping ``counter`` alone. ``version[r]`` is bumped whenever
    ``r`` leaves the running set, which invalidates its stale entries in ``finish_heap``/``newest_heap``.
    """

    __slots__ = (
        "p", "arrivals", "order", "inp_of", "out_of", "kv_capacity_tokens", "max_num_seqs",
        "max_num_batched_tokens", "n", "generated", "todo", "computed", "first_s", "finish_s", "version",
        "base", "waiting", "prefilling", "finish_heap", "newest_heap", "n_dec", "sum_base", "counter",
        "used_prefill", "now_s", "next_arrival", "done", "steps", "preemptions", "batch_acc", "admit_seq",
    )  # fmt: skip

    def __init__(
        self,
        params: LatencyParams,
        requests: Sequence[tuple[int, int]],
        arrivals_s: list[float],
        kv_capacity_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        n = len(requests)
        self.p = params
        self.arrivals = arrivals_s
        self.order = sorted(range(n), key=lambda r: arrivals_s[r])
        self.inp_of = [r[0] for r in requests]
        self.out_of = [r[1] for r in requests]
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.n = n
        self.generated = [0] * n
        self.todo = [0] * n  # prompt tokens still to (re)compute while prefilling
        self.computed = [0] * n
        self.first_s = [math.nan] * n
        self.finish_s = [math.nan] * n
        self.version = [0] * n
        self.base = [0] * n  # decoders: computed = base + counter
        self.waiting: deque[int] = deque()
        self.prefilling: list[int] = []  # admission order
        self.finish_heap: list[tuple[int, int, int]] = []  # (finish counter, version, r)
        self.newest_heap: list[tuple[int, int, int]] = []  # (−admission seq, version, r) over running
        self.n_dec = 0
        self.sum_base = 0
        self.counter = 0
        self.used_prefill = 0  # KV tokens held by prefilling requests
        self.now_s = 0.0
        self.next_arrival = 0
        self.done = 0
        self.steps = 0
        self.preemptions = 0
        self.batch_acc = 0.0
        self.admit_seq = 0

    def run(self) -> None:
        """Advance until every request has finished."""
        n = self.n
        while self.done < n:
            self._admit_arrivals()
            if self.n_dec + len(self.prefilling) == 0 and not self.waiting:
                self.now_s = self.arrivals[self.order[self.next_arrival]]
                continue
            budget = self.max_num_batched_tokens - self.n_dec
            # decoders need one more KV token each this step; preempt the newest until they fit
            while self.n_dec and self._held() + self.n_dec > self.kv_capacity_tokens:
                self._preempt_newest()
            running = self.n_dec + len(self.prefilling)
            waiting = self.waiting
            can_admit = bool(waiting) and running < self.max_num_seqs and budget > 0
            can_admit = (
                can_admit
                and self._held() + self.n_dec + min(self.todo[waiting[0]], budget) <= self.kv_capacity_tokens
            )
            if self.prefilling or can_admit or self.n_dec == 0:
                self._mixed_step(budget)
            else:
                self._decode_jump(running)
            self._retire_finished()

    def result(self) -> InstanceRun:
        """Summarise a finished run."""
        n, arrivals, out_of, first_s, finish_s = (
            self.n,
            self.arrivals,
            self.out_of,
            self.first_s,
            self.finish_s,
        )
        tokens = sum(self.inp_of) + sum(out_of)
        start = min(arrivals)
        makespan = self.now_s - start
        ttft = np.array([first_s[r] - arrivals[r] for r in range(n)])
        tpot = np.array([(finish_s[r] - first_s[r]) / (out_of[r] - 1) for r in range(n) if out_of[r] > 1])
        steps = self.steps
        return InstanceRun(
            tokens_per_s=tokens / makespan if makespan > 0 else math.inf,
            makespan_s=makespan,
            steps=steps,
            preemptions=self.preemptions,
            mean_batch=self.batch_acc / steps if steps else 0.0,
            ttft_p90_s=float(np.quantile(ttft, 0.9)),
            tpot_p90_s=float(np.quantile(tpot, 0.9)) if tpot.size else math.nan,
            ttft_mean_s=float(ttft.mean()),
            tpot_mean_s=float(tpot.mean()) if tpot.size else math.nan,
        )

    def _held(self) -> int:
        """KV tokens held by every running request."""
        return self.sum_base + self.n_dec * self.counter + self.used_prefill

    def _admit_arrivals(self) -> None:
        """Queue every request that has arrived by ``now_s``."""
        order, arrivals = self.order, self.arrivals
        while self.next_arrival < self.n and arrivals[order[self.next_arrival]] <= self.now_s:
            r = order[self.next_arrival]
            self.todo[r] = self.inp_of[r]
            self.waiting.append(r)
            self.next_arrival += 1

    def _join_decode(self, r: int) -> None:
        """Move ``r``, whose prompt is fully computed, into the decoding set."""
        self.n_dec += 1
        self.base[r] = self.computed[r] - self.counter
        self.sum_base += self.base[r]
        heapq.heappush(
            self.finish_heap, (self.counter + self.out_of[r] - self.generated[r], self.version[r], r)
        )

    def _preempt_newest(self) -> None:
        """Preempt (by recompute) the most recently admitted running request to the front of the queue."""
        version = self.version
        while self.newest_heap:
            _, ver, r = heapq.heappop(self.newest_heap)
            if ver != version[r]:
                continue
            version[r] += 1
            if r in self.prefilling:
                self.prefilling.remove(r)
                self.used_prefill -= self.computed[r]
            else:
                self.n_dec -= 1
                self.sum_base -= self.base[r]
            self.computed[r] = 0
            self.todo[r] = self.inp_of[r] + self.generated[r]
            self.waiting.appendleft(r)
            self.preemptions += 1
            return
        raise AssertionError("preemption with nothing running")

    def _plan_chunks(self, budget: int) -> list[tuple[int, int]]:
        """Choose this step's prefill chunks [(r, tokens)]: continue prefills, then admit waiting requests."""
        todo, prefilling, waiting = self.todo, self.prefilling, self.waiting
        chunks: list[tuple[int, int]] = []
        for r in prefilling:
            if budget <= 0:
                break
            c = min(todo[r], budget)
            chunks.append((r, c))
            budget -= c
        free = self.kv_capacity_tokens - self._held() - self.n_dec - sum(c for _, c in chunks)
        while waiting and budget > 0 and self.n_dec + len(prefilling) < self.max_num_seqs:
            r = waiting[0]
            c = min(todo[r], budget)
            if c > free:
                break
            waiting.popleft()
            prefilling.append(r)
            self.admit_seq += 1
            heapq.heappush(self.newest_heap, (-self.admit_seq, self.version[r], r))
            chunks.append((r, c))
            budget -= c
            free -= c
        return chunks

    def _mixed_step(self, budget: int) -> None:
        """One explicit step: every decoder emits a token and the planned prefill chunks are computed."""
        p, n_dec = self.p, self.n_dec
        chunks = self._plan_chunks(budget)
        if not chunks and n_dec == 0:
            raise AssertionError("no progress possible")  # unreachable: a request always fits alone
        p_tokens = sum(c for _, c in chunks)
        dt = 0.0
        if n_dec:
            dt += _decode_time(p, n_dec, self.sum_base + n_dec * self.counter, 1)
        if chunks:
            dt += p.p1 * p_tokens + p.p2 * len(chunks) + p.p3 * p_tokens / len(chunks)
            if not n_dec:
                dt += p.p4
        self.now_s += max(dt, 0.0)
        self.steps += 1
        self.batch_acc += n_dec + len(chunks)
        if n_dec:
            self.counter += 1
        for r, c in chunks:
            self._apply_chunk(r, c)

    def _apply_chunk(self, r: int, c: int) -> None:
        """Account ``c`` computed prompt tokens of ``r``; a completed prompt yields its next token."""
        self.todo[r] -= c
        self.computed[r] += c
        self.used_prefill += c
        if self.todo[r] != 0:
            return
        self.prefilling.remove(r)
        self.used_prefill -= self.computed[r]
        self.generated[r] += 1
        if math.isnan(self.first_s[r]):
            self.first_s[r] = self.now_s
        if self.generated[r] >= self.out_of[r]:
            self.finish_s[r] = self.now_s
            self.version[r] += 1
            self.done += 1
        else:
            self._join_decode(r)

    def _decode_jump(self, running: int) -> None:
        """Pure decode: jump to the next finish, KV exhaustion or arrival in one analytic stretch."""
        p, n_dec = self.p, self.n_dec
        s0 = self.sum_base + n_dec * self.counter
        k = self.finish_heap[0][0] - self.counter if self.finish_heap else 1
        k = min(k, max(1, (self.kv_capacity_tokens - self.used_prefill - s0) // n_dec))
        if self.next_arrival < self.n and running < self.max_num_seqs:
            next_arrival_s = self.arrivals[self.order[self.next_arrival]]
            k = min(k, _steps_until(p, n_dec, s0, next_arrival_s - self.now_s))
        k = max(k, 1)
        self.now_s += max(_decode_time(p, n_dec, s0, k), 0.0)
        self.steps += k
        self.batch_acc += n_dec * k
        self.counter += k

    def _retire_finished(self) -> None:
        """Finish every decoder whose last token was produced by ``counter``."""
        finish_heap, version = self.finish_heap, self.version
        while finish_heap and finish_heap[0][0] <= self.counter:
            _, ver, r = heapq.heappop(finish_heap)
            if ver != version[r]:
                continue
            version[r] += 1
            self.generated[r] = self.out_of[r]
            self.n_dec -= 1
            self.sum_base -= self.base[r]
            self.finish_s[r] = self.now_s
            self.done += 1


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
