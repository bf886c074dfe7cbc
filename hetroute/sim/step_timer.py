"""How long one engine step takes: the :class:`StepTimer` protocol and its two implementations.

Owns :class:`StepBatch` (what one step computes, as the scheduler reports it), :class:`StepTimer`,
:class:`RooflineTimer` (the catalog's roofline, :mod:`hetroute.catalog.roofline`: the engine model's
default) and :class:`FittedTimer` (a profile's fitted p1..p8, method.md §3: the tuner's). The scheduler
(:mod:`hetroute.sim.vllm_scheduler`) decides *what* a step computes and never reads a clock; a timer
turns that into seconds. Pure arithmetic, no state.

Besides one step, a timer prices a *pure-decode run*: ``k`` consecutive steps that each emit one token
for the same ``b`` sequences, whose KV grows by ``b`` tokens per step. :meth:`StepTimer.decode_run_s`
gives its time in closed form and :meth:`StepTimer.decode_steps_until` the first ``k`` whose run lasts at
least a given time, so a caller can jump over a decode stretch in O(1) (``hetroute.tuner.iteration``).
Both equal the step-by-step sums of :meth:`StepTimer.step_s` up to float rounding.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

from hetroute.catalog.roofline import StepCost
from hetroute.latency import LatencyParams


class StepBatch(NamedTuple):
    """What one step computes (a tuple: one is built per step, and a NamedTuple builds faster than a
    frozen dataclass).

    A *decode* item emits one token from a sequence's cached context (a decoding request, or a resumed
    request whose last chunk is its single missing token); a *prefill chunk* computes ``n_i ≥ 1`` new
    prompt tokens after ``c_i`` cached ones.
    """

    decode_seqs: int
    """Decode items."""
    decode_kv_tokens: int
    """Σ cached tokens (KV read) of the decode items."""
    prefill_tokens: int = 0
    """Σ n_i over the prefill chunks."""
    prefill_chunks: int = 0
    """Number of prefill chunks."""
    prefill_attn: float = 0.0
    """Σ n_i·(c_i + n_i/2) over the prefill chunks, in scheduling order."""
    prefill_kv_tokens: int = 0
    """Σ c_i (KV read) over the prefill chunks."""

    @property
    def empty(self) -> bool:
        """True when the step computes nothing."""
        return self.decode_seqs == 0 and self.prefill_chunks == 0


class StepTimer(Protocol):
    """Seconds of engine steps (see the module docstring)."""

    def step_s(self, batch: StepBatch) -> float:
        """Seconds of one step computing ``batch`` (0 for an empty batch)."""
        ...

    def decode_run_s(self, seqs: int, kv_tokens: int, steps: int) -> float:
        """Seconds of ``steps`` pure-decode steps of ``seqs`` sequences holding ``kv_tokens`` at the first."""
        ...

    def decode_steps_until(self, seqs: int, kv_tokens: int, delta_s: float) -> int:
        """The smallest ``k ≥ 1`` whose ``decode_run_s(seqs, kv_tokens, k)`` is at least ``delta_s``."""
        ...


class RooflineTimer:
    """The roofline of one (GPU, model, TP): :meth:`StepCost.step_s` with KV read = decode + prefill KV."""

    __slots__ = ("cost",)

    def __init__(self, cost: StepCost) -> None:
        self.cost = cost

    def step_s(self, batch: StepBatch) -> float:
        return self.cost.step_s(
            batch.prefill_tokens,
            batch.prefill_attn,
            batch.decode_seqs,
            batch.decode_kv_tokens + batch.prefill_kv_tokens,
        )

    def decode_run_s(self, seqs: int, kv_tokens: int, steps: int) -> float:
        """Closed form of Σ_j step(seqs, kv_tokens + j·seqs), j < steps: memory time grows linearly, compute
        time is constant, so ``min(t_mem, t_comp)`` switches branch at most once, at step ``j0``."""
        if seqs <= 0 or steps <= 0:
            return 0.0
        c = self.cost
        t_comp = c.decode_s_per_seq * seqs
        const = t_comp + c.fixed_s + c.comm_s_per_token * seqs
        mem0 = c.weight_s + c.kv_s_per_token * kv_tokens
        slope = c.kv_s_per_token * seqs
        if slope > 0:
            j0 = min(steps, max(0, math.ceil((t_comp - mem0) / slope)))
        else:
            j0 = steps if mem0 < t_comp else 0

        def mem_sum(first: int, stop: int) -> float:  # Σ t_mem over steps first … stop-1
            n = stop - first
            return n * mem0 + slope * (first + stop - 1) * n / 2.0

        ov = c.compute_overlap
        below = (1.0 - ov) * mem_sum(0, j0) + j0 * const  # t_mem < t_comp: the overlap hides memory time
        above = mem_sum(j0, steps) + (steps - j0) * (const - ov * t_comp)
        return below + above

    def decode_steps_until(self, seqs: int, kv_tokens: int, delta_s: float) -> int:
        return _first_run_reaching(self, seqs, kv_tokens, delta_s)


class FittedTimer:
    """A profile's fitted p1..p8 (method.md §3), per step as the tuner's iteration-level estimate uses it.

    A decode step of ``b`` sequences holding ``S`` KV tokens costs ``τ = p5·S + p6·b + p7·S/b + p8``
    (Eq. 4's per-step term with ``L = S/b``); prefill chunks of ``P`` tokens in total from ``n`` chunks add
    ``p1·P + p2·n + p3·P/n`` and, when the step has no decode item, ``p4`` (Eq. 3 with ``b·I = P``,
    ``I = P/n``). A pure-decode run of ``k`` steps costs ``k·τ(S) + (p5·b + p7)·k(k−1)/2``. A fitted curve
    can dip below zero at the edges of its range; a step or run never takes negative time.
    """

    __slots__ = ("p",)

    def __init__(self, params: LatencyParams) -> None:
        self.p = params

    def step_s(self, batch: StepBatch) -> float:
        p = self.p
        dt = 0.0
        b = batch.decode_seqs
        if b:
            s = batch.decode_kv_tokens
            dt += p.p5 * s + p.p6 * b + p.p7 * s / b + p.p8
        n = batch.prefill_chunks
        if n:
            tokens = batch.prefill_tokens
            dt += p.p1 * tokens + p.p2 * n + p.p3 * tokens / n
            if not b:
                dt += p.p4
        return max(dt, 0.0)

    def decode_run_s(self, seqs: int, kv_tokens: int, steps: int) -> float:
        if seqs <= 0 or steps <= 0:
            return 0.0
        p, b, s, k = self.p, seqs, kv_tokens, steps
        first = p.p5 * s + p.p6 * b + p.p7 * s / b + p.p8
        return max(k * first + (p.p5 * b + p.p7) * k * (k - 1) / 2.0, 0.0)

    def decode_steps_until(self, seqs: int, kv_tokens: int, delta_s: float) -> int:
        """Solves ``k·a + c·k(k−1)/2 ≥ delta`` (``a`` = the first step, ``c`` its growth per step)."""
        p, b, s = self.p, seqs, kv_tokens
        if delta_s <= 0 or b <= 0:
            return 1
        a = p.p5 * s + p.p6 * b + p.p7 * s / b + p.p8
        c = p.p5 * b + p.p7
        if c <= 1e-18:
            return max(1, math.ceil(delta_s / a)) if a > 0 else 1
        half = c / 2.0  # (c/2)k² + (a − c/2)k − delta ≥ 0
        k = (-(a - half) + math.sqrt((a - half) ** 2 + 4 * half * delta_s)) / (2 * half)
        return max(1, math.ceil(k - 1e-9))


def _first_run_reaching(timer: StepTimer, seqs: int, kv_tokens: int, delta_s: float) -> int:
    """The smallest ``k ≥ 1`` with ``timer.decode_run_s(seqs, kv_tokens, k) ≥ delta_s`` (doubling, then
    bisection; every step takes positive time, so the run time grows with ``k``)."""
    first = timer.decode_run_s(seqs, kv_tokens, 1)
    if delta_s <= 0 or seqs <= 0 or first >= delta_s or first <= 0:
        return 1  # (a step of no time would never reach delta_s: stop after one)
    lo, hi = 1, 2  # run(lo) < delta
    while timer.decode_run_s(seqs, kv_tokens, hi) < delta_s:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if timer.decode_run_s(seqs, kv_tokens, mid) < delta_s:
            lo = mid
        else:
            hi = mid
    return hi
