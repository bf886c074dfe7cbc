"""Iteration-level continuous-batching estimate of one instance, driven by fitted p1..p8 (method.md §4).

Owns: :func:`simulate_instance`, :func:`simulate_machine`, :func:`trace_instance` and their results. The
scheduling is not re-implemented here: each instance is a :class:`hetroute.sim.vllm_scheduler.VllmScheduler`
— the same code that schedules the simulator's and the emulator's engine model (FCFS, ``max_num_seqs``,
token budget ``max_num_batched_tokens`` with chunked prefill, lazy KV allocation, preemption by recompute
of the newest running request, no admission in a step that preempted) — with its steps priced by a
:class:`hetroute.sim.step_timer.FittedTimer` over the profile's p1..p8 instead of the roofline. So it needs
nothing but a :class:`LatencyProfile`'s parameters and a KV capacity in tokens (blocks of one token unless
``block_size`` is given: the estimate does not model block fragmentation).

Step time (:class:`FittedTimer`): a decode step over ``b`` sequences holding ``S`` KV tokens costs
``τ = p5·S + p6·b + p7·S/b + p8``; prefill of ``P`` tokens from ``n`` chunks adds ``p1·P + p2·n + p3·P/n``
and, when the step has no decode, ``p4``. Pure-decode stretches are jumped in one update
(:meth:`VllmScheduler.advance_decode`; k steps cost ``k·τ(S₀) + (p5·b + p7)·k(k−1)/2``) up to the next
finish, KV exhaustion or arrival, so a run costs O(events · log n), not O(tokens).
``tests/unit/test_scheduler_equivalence.py`` runs the same requests through this path and through
:class:`~hetroute.sim.engine_model.EngineModel` step by step with the same timer and asserts the same
schedule.

Throughput is Σ(input + output tokens) / makespan. With ``arrivals_s`` the same loop yields TTFT and TPOT.

History: this module used to carry its own copy of the scheduling rules, and the copies had drifted. The copy
(1) forgot the tokens a preempted request had decoded (it re-prefilled the prompt and the tokens the request
had when it started decoding, then decoded the rest again), (2) admitted waiting requests in a step that
preempted, (3) did not check a continuing prompt chunk against the free KV, (4) charged the step's budget for
decoders it then preempted and (5) timed a resumed request's 1-token last chunk as prefill rather than decode.
Only (1) moved the figures of ``benchmarks/tune_deploy_ranking.py`` (the old code with (1) fixed reproduces
every new figure): options with preemptions, e.g. paper C TP1 30,235 → 30,307 tokens/s, L4 TP1 3,975 → 4,078.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetroute.latency import LatencyParams
from hetroute.sim.prefix_cache import BlockPool
from hetroute.sim.sched_request import KvBook, SchedRequest
from hetroute.sim.step_timer import FittedTimer, StepTimer
from hetroute.sim.vllm_scheduler import VllmScheduler


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


@dataclass(frozen=True, slots=True)
class InstanceTrace:
    """The schedule of one instance: per request (in input order) its first-token and finish times."""

    first_token_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    end_s: float
    steps: int
    preemptions: int
    batch_items: int
    """Σ over steps of the sequences each step served (decode items + prefill chunks)."""


def simulate_instance(
    params: LatencyParams,
    requests: Sequence[tuple[int, int]],
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    arrivals_s: Sequence[float] | None = None,
) -> InstanceRun:
    """Serve ``requests`` [(I, O), ...] on one instance; all arrive at 0 unless ``arrivals_s`` is given."""
    arrivals = list(arrivals_s) if arrivals_s is not None else [0.0] * len(requests)
    trace = trace_instance(
        FittedTimer(params), requests, kv_capacity_tokens, max_num_seqs, max_num_batched_tokens, arrivals
    )
    n, out_of = len(requests), [o for _, o in requests]
    first_s, finish_s = trace.first_token_s, trace.finish_s
    tokens = sum(i for i, _ in requests) + sum(out_of)
    makespan = trace.end_s - min(arrivals)
    ttft = np.array([first_s[r] - arrivals[r] for r in range(n)])
    tpot = np.array([(finish_s[r] - first_s[r]) / (out_of[r] - 1) for r in range(n) if out_of[r] > 1])
    steps = trace.steps
    return InstanceRun(
        tokens_per_s=tokens / makespan if makespan > 0 else math.inf,
        makespan_s=makespan,
        steps=steps,
        preemptions=trace.preemptions,
        mean_batch=trace.batch_items / steps if steps else 0.0,
        ttft_p90_s=float(np.quantile(ttft, 0.9)),
        tpot_p90_s=float(np.quantile(tpot, 0.9)) if tpot.size else math.nan,
        ttft_mean_s=float(ttft.mean()),
        tpot_mean_s=float(tpot.mean()) if tpot.size else math.nan,
    )


def trace_instance(
    timer: StepTimer,
    requests: Sequence[tuple[int, int]],
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    arrivals_s: Sequence[float] | None = None,
    *,
    block_size: int = 1,
) -> InstanceTrace:
    """Serve ``requests`` [(I, O), ...] on one instance timed by ``timer`` (arrivals at 0 unless given).

    KV is ``kv_capacity_tokens // block_size`` blocks. Raises ValueError for no requests, a request that
    cannot fit alone, or ``max_num_batched_tokens < max_num_seqs``.
    """
    n = len(requests)
    if n == 0:
        raise ValueError("simulate_instance needs at least one request")
    for i, (inp, out) in enumerate(requests):
        if inp < 1 or out < 1 or -(-(inp + out) // block_size) * block_size > kv_capacity_tokens:
            raise ValueError(
                f"request {i} ({inp}+{out} tokens) cannot run with capacity {kv_capacity_tokens}"
            )
    arrivals = list(arrivals_s) if arrivals_s is not None else [0.0] * n
    kv = KvBook(
        BlockPool(kv_capacity_tokens // block_size), block_size, caching=False, cache_on_release=False
    )
    sched: VllmScheduler[SchedRequest] = VllmScheduler(kv, max_num_seqs, max_num_batched_tokens, chunked=True)
    reqs = [SchedRequest(str(r), inp, out, out) for r, (inp, out) in enumerate(requests)]
    return _run(timer, sched, reqs, arrivals)


def _run(
    timer: StepTimer, sched: VllmScheduler[SchedRequest], reqs: list[SchedRequest], arrivals: list[float]
) -> InstanceTrace:
    """Advance ``sched`` until every request has finished: explicit steps, or one update per pure-decode
    stretch bounded by the next arrival that could be admitted."""
    n = len(reqs)
    order = sorted(range(n), key=lambda r: arrivals[r])
    index = {req: r for r, req in enumerate(reqs)}
    first_s, finish_s = [math.nan] * n, [math.nan] * n
    now = 0.0
    next_arrival = done = steps = items = 0
    seqs = sched.max_num_seqs
    while done < n:
        while next_arrival < n and arrivals[order[next_arrival]] <= now:
            sched.submit(reqs[order[next_arrival]])
            next_arrival += 1
        if not (sched.decoding or sched.prefilling or sched.waiting):
            now = arrivals[order[next_arrival]]
            continue
        k = sched.decode_steps_ahead()
        if k:
            b, s = len(sched.decoding), sched.decode_kv_tokens
            if next_arrival < n and b < seqs:
                k = min(k, timer.decode_steps_until(b, s, arrivals[order[next_arrival]] - now))
            now += timer.decode_run_s(b, s, k)
            finished = sched.advance_decode(k)
            steps += k
            items += b * k
        else:
            result = sched.step()
            batch = result.batch
            if not (batch.decode_seqs or batch.prefill_chunks):
                if not result.preempted:
                    raise AssertionError("no progress possible")  # unreachable: a request always fits alone
                continue
            now += timer.step_s(batch)
            steps += 1
            items += batch.decode_seqs + batch.prefill_chunks
            for req, first in result.completed:
                if first:
                    first_s[index[req]] = now
            finished = result.finished
        for req in finished:
            finish_s[index[req]] = now
        done += len(finished)
    return InstanceTrace(tuple(first_s), tuple(finish_s), now, steps, sched.preemptions, items)


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
