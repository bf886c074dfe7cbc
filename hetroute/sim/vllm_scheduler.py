"""The vLLM-flavoured continuous-batching scheduler: the one implementation of its rules.

Owns :class:`VllmScheduler` and :class:`StepResult`. Used by the engine model
(:class:`hetroute.sim.engine_model.EngineModel`, for the simulator and the emulator) and by the tuner's
iteration-level estimate (:mod:`hetroute.tuner.iteration`). It decides what each step computes and keeps
the KV accounting; it reads no clock: the caller prices a step with a
:class:`~hetroute.sim.step_timer.StepTimer`.

Rules (vLLM V1 scheduler, no speculative decoding):

- FCFS. Each step first serves the running requests in admission order, each asking for all its not yet
  computed tokens (1 when decoding), capped by the step's token budget; then, only if the step preempted
  nothing, admits waiting requests in order while ``running < max_num_seqs``, budget remains and their
  blocks fit, stopping at the first that does not. With chunked prefill a prompt is split over steps;
  without it a prompt is scheduled whole (the caller sets the budget to at least ``max_model_len``).
- KV is kept in blocks of ``block_size`` tokens, allocated lazily: a running request holds
  ``ceil(computed / block_size)`` blocks. When a running request needs a block and none is free, the newest
  running request is preempted by recompute: its blocks are freed, its computed count reset, and it goes
  to the front of the queue; resumed, it re-prefills prompt + generated tokens (no token is emitted twice).
- A token is sampled for a request when its computed count reaches prompt + generated.
- Prefix caching (``KvBook.caching``): each admission try looks the request's block hashes up; its leading
  cached blocks are shared and not prefilled (at most ``tokens − 1`` hit, in whole blocks); full prompt
  blocks are cached in the step that computes them.

Consequences the implementation relies on (``budget ≥ max_num_seqs``, as vLLM requires): every decoding
request is served every step, and at most one request is mid-prefill — the newest running one, because
a prompt left incomplete has spent the whole budget. So a step's order is: decoders, then that prompt's
next chunk, then admissions.

Cost. Decoders advance lazily: request ``r`` holds ``computed = base_r + counter`` and a step bumps
``counter`` once; counts of ``base_r mod block_size`` give the blocks they need. A step costs
O(chunks + finishes·log n + preemptions), not O(running). :meth:`decode_steps_ahead` and
:meth:`advance_decode` go further: ``k`` pure-decode steps in which nothing else changes are one update.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from hetroute.sim.sched_request import KvBook, SchedRequest
from hetroute.sim.step_timer import StepBatch

R = TypeVar("R", bound=SchedRequest)


@dataclass(slots=True)
class StepResult(Generic[R]):
    """What one step computed.

    ``decoders``: the decoding requests that emitted a token, in admission order (only when the scheduler
    tracks them). ``completed``: ``(request, first)`` for each prefill chunk that completed its prompt and
    emitted a token (``first``: its first one), in scheduling order. ``finished``: requests that emitted
    their last token, decoders first (admission order), then completed chunks. ``preempted``: requests
    preempted while planning the step.
    """

    batch: StepBatch
    decoders: list[R] | None
    completed: list[tuple[R, bool]]
    finished: list[R]
    preempted: list[R]


class VllmScheduler(Generic[R]):
    """The waiting queue, the running requests and their KV (rules and cost: module docstring).

    ``budget_tokens``: tokens per step (``max_num_batched_tokens``). ``track_decoders``: fill
    :attr:`StepResult.decoders` (O(running) per step; the engine model needs it for its token events).
    """

    __slots__ = (
        "kv", "block_size", "max_num_seqs", "budget", "chunked", "track_decoders", "waiting", "prefilling",
        "decoding", "counter", "sum_base", "residues", "finish_heap", "admitted", "preemptions",
    )  # fmt: skip

    def __init__(
        self,
        kv: KvBook,
        max_num_seqs: int,
        budget_tokens: int,
        *,
        chunked: bool,
        track_decoders: bool = False,
    ) -> None:
        if budget_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget_tokens}) must be greater than or equal to max_num_seqs "
                f"({max_num_seqs})"
            )
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.budget = budget_tokens
        self.chunked = chunked
        self.track_decoders = track_decoders
        self.waiting: deque[R] = deque()
        self.prefilling: list[R] = []  # running requests not decoding, admission order (at most one)
        self.decoding: dict[R, None] = {}  # admission order
        self.counter = 0  # steps that advanced the decoding set
        self.sum_base = 0  # Σ base over decoding requests
        self.residues = [0] * self.block_size  # decoding requests by base mod block_size
        # (counter at r's last token, r's seq, r): valid while r is decoding with that seq
        self.finish_heap: list[tuple[int, int, R]] = []
        self.admitted = 0
        self.preemptions = 0

    # ------------------------------------------------------------ queue

    def submit(self, req: R) -> None:
        """Queue ``req`` behind every waiting request."""
        self.waiting.append(req)

    def abort(self, req: R) -> None:
        """Drop a queued or running request and free its blocks."""
        if req.decoding:
            self._leave_decoding(req)
        elif req.started:
            self.prefilling.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.release(req)

    def has_work(self) -> bool:
        return bool(self.decoding or self.prefilling or self.waiting)

    @property
    def running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    @property
    def decode_kv_tokens(self) -> int:
        """Σ computed tokens of the decoding requests."""
        return self.sum_base + len(self.decoding) * self.counter

    # ------------------------------------------------------------ one step

    def step(self) -> StepResult[R]:
        """Plan one step and advance the state to its end (nothing scheduled: ``batch.empty``)."""
        preempted: list[R] = []
        n_dec = len(self.decoding)
        if n_dec:
            pool = self.kv.pool
            need = self.residues[-self.counter % self.block_size]
            if need <= pool.free_blocks:
                pool.allocate(need)
            else:
                self._grow_decoders_preempting(need, preempted)
                n_dec = len(self.decoding)
        budget = self.budget - n_dec
        chunks: list[tuple[R, int]] = []
        if self.prefilling:
            budget = self._continue_prefill(budget, chunks, preempted)
        if self.waiting and not preempted:
            self._admit(budget, chunks)
        return self._execute(chunks, preempted)

    def _grow_decoders_preempting(self, remaining: int, preempted: list[R]) -> None:
        """Give the ``remaining`` decoders that need a block one each, oldest first, preempting the newest
        running request whenever none is free: vLLM's per-request loop in O(victims). The oldest needing
        decoders take every free block, then the newest running request is preempted (one fewer needs a
        block if it was such a decoder; the loop ends when a decoder preempts itself). Allocations and
        releases keep the per-request loop's order, which prefix-cache eviction depends on."""
        bs, pool, target = self.block_size, self.kv.pool, -self.counter % self.block_size
        while True:
            take = min(remaining, pool.free_blocks)
            pool.allocate(take)
            remaining -= take
            if not remaining:
                return
            if self.prefilling:
                victim = self.prefilling[-1]
            else:
                victim = next(reversed(self.decoding))
                if victim.base % bs == target:
                    remaining -= 1
            self._preempt(victim, preempted)

    def _continue_prefill(self, budget: int, chunks: list[tuple[R, int]], preempted: list[R]) -> int:
        """Append the next chunk of each mid-prefill request (allocating its blocks), in admission order;
        returns the budget left."""
        bs, pool = self.block_size, self.kv.pool
        for req in list(self.prefilling):
            if budget <= 0 or not req.started:
                break
            computed = req.computed
            num_new = min(req.prompt + req.generated - computed, budget)
            end = computed + num_new
            if end > req.blocks * bs:
                need = -(-end // bs) - req.blocks
                if need > pool.free_blocks and not self._preempt_for(need, req, preempted):
                    break
                pool.allocate(need)
                req.blocks += need
            if req.cached < len(req.hashes):
                self.kv.register(req, end)
            chunks.append((req, num_new))
            budget -= num_new
        return budget

    def _admit(self, budget: int, chunks: list[tuple[R, int]]) -> None:
        """Admit waiting requests FCFS while a slot, budget and blocks remain; append their chunks."""
        bs, kv, waiting, prefilling = self.block_size, self.kv, self.waiting, self.prefilling
        pool, caching, chunked = kv.pool, kv.caching, self.chunked
        slots = self.max_num_seqs - len(self.decoding) - len(prefilling)
        while waiting and budget > 0 and slots > 0:
            req = waiting[0]
            if caching:  # vLLM recomputes the last token, so at most tokens - 1 can hit
                hit, evictable = kv.lookup(req, (req.prompt + req.generated - 1) // bs)
                computed = hit * bs
            else:
                hit = evictable = computed = 0
            num_new = req.prompt + req.generated - computed
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            need = -(-(computed + num_new) // bs) - hit
            if need + evictable > pool.free_blocks:
                break
            waiting.popleft()
            prefilling.append(req)
            kv.admit(req, hit, need, computed)
            self.admitted += 1
            req.seq = self.admitted
            if req.cached < len(req.hashes):
                kv.register(req, computed + num_new)
            chunks.append((req, num_new))
            budget -= num_new
            slots -= 1

    def _execute(self, chunks: list[tuple[R, int]], preempted: list[R]) -> StepResult[R]:
        """Advance the decoders by one token and apply the chunks; release what finished."""
        decoding = self.decoding
        n_dec = len(decoding)
        decode_kv = self.sum_base + n_dec * self.counter
        decoders = list(decoding) if self.track_decoders else None
        finished: list[R] = []
        if n_dec:
            self.counter += 1
            if self.finish_heap[0][0] <= self.counter:
                self._retire(finished)
        extra_dec = extra_kv = prefill_tokens = prefill_chunks = prefill_kv = 0
        prefill_attn = 0.0
        completed: list[tuple[R, bool]] = []
        counter, bs, residues, heap = self.counter, self.block_size, self.residues, self.finish_heap
        for req, num_new in chunks:
            computed = req.computed
            generated = req.generated
            if num_new == 1 and generated:  # a resumed request's single missing token: a decode item
                extra_dec += 1
                extra_kv += computed
            else:
                prefill_tokens += num_new
                prefill_chunks += 1
                prefill_kv += computed
                prefill_attn += num_new * (computed + num_new / 2.0)
            computed += num_new
            req.computed = computed
            if computed < req.prompt + generated:
                continue
            completed.append((req, generated == 0))
            generated += 1
            req.generated = generated
            self.prefilling.remove(req)
            if generated >= req.output:
                self.kv.release(req)
                finished.append(req)
                continue
            # join the decoding set: from the next step on, computed = base + counter
            base = computed - counter
            req.base = base
            req.decoding = True
            residues[base % bs] += 1
            self.sum_base += base
            decoding[req] = None
            heapq.heappush(heap, (counter + req.output - generated, req.seq, req))
        batch = StepBatch(
            n_dec + extra_dec, decode_kv + extra_kv, prefill_tokens, prefill_chunks, prefill_attn, prefill_kv
        )
        return StepResult(batch, decoders, completed, finished, preempted)

    # ------------------------------------------------------------ pure-decode runs

    def decode_steps_ahead(self) -> int:
        """How many steps from now are pure decode with nothing else changing: no prefill chunk, no
        admission (or admission try, with prefix caching on), no preemption, and no decoder finishing
        before the last of them. 0 when the next step is not such a step."""
        n_dec = len(self.decoding)
        if self.prefilling or not n_dec:
            return 0
        bs, pool = self.block_size, self.kv.pool
        waiting = self.waiting
        budget = self.budget - n_dec
        if waiting and budget > 0 and n_dec < self.max_num_seqs:
            if self.kv.caching:
                return 0
            req = waiting[0]
            num_new = req.prompt + req.generated
            if self.chunked or num_new <= budget:  # else it waits for a budget it never gets here
                need = -(-min(num_new, budget) // bs)
                if need <= pool.free_blocks - self.residues[-self.counter % bs]:
                    return 0
        heap = self.finish_heap
        while not (heap[0][2].decoding and heap[0][2].seq == heap[0][1]):
            heapq.heappop(heap)
        k = heap[0][0] - self.counter
        if bs == 1:
            return min(k, pool.free_blocks // n_dec)
        if self._blocks_for(k) <= pool.free_blocks:
            return k
        if self._blocks_for(1) > pool.free_blocks:
            return 0
        lo, hi = 1, k  # the longest run whose blocks fit, by bisection (blocks needed grow with the run)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._blocks_for(mid) <= pool.free_blocks:
                lo = mid
            else:
                hi = mid
        return lo

    def _blocks_for(self, steps: int) -> int:
        """New blocks the decoders need over the next ``steps`` steps."""
        bs, counter, total = self.block_size, self.counter, 0
        for residue, count in enumerate(self.residues):
            if count:
                first = -(residue + counter) % bs  # steps until its computed count is a whole block
                if first < steps:
                    total += count * ((steps - 1 - first) // bs + 1)
        return total

    def advance_decode(self, steps: int) -> list[R]:
        """Run ``steps`` pure-decode steps at once (``1 ≤ steps ≤ decode_steps_ahead()``); returns the
        requests that finished at the last of them, in admission order."""
        self.kv.pool.allocate(len(self.decoding) * steps if self.block_size == 1 else self._blocks_for(steps))
        self.counter += steps
        finished: list[R] = []
        self._retire(finished)
        return finished

    # ------------------------------------------------------------ the decoding set

    def _retire(self, finished: list[R]) -> None:
        """Finish and release every decoder whose last token is produced by ``counter``."""
        heap, counter, release = self.finish_heap, self.counter, self.kv.release
        bs, residues, decoding = self.block_size, self.residues, self.decoding
        while heap and heap[0][0] <= counter:
            _, seq, req = heapq.heappop(heap)
            if not (req.decoding and req.seq == seq):
                continue
            base = req.base  # _leave_decoding, inlined on this hot path
            computed = req.computed = base + counter
            req.generated = req.output
            req.blocks = -(-computed // bs)
            req.decoding = False
            residues[base % bs] -= 1
            self.sum_base -= base
            del decoding[req]
            release(req)
            finished.append(req)

    def _leave_decoding(self, req: R) -> None:
        """Take ``req`` out of the decoding set, writing its lazy fields back."""
        counter, base = self.counter, req.base
        req.computed = base + counter
        req.generated = req.computed - req.prompt + 1
        req.blocks = -(-req.computed // self.block_size)
        req.decoding = False
        self.residues[base % self.block_size] -= 1
        self.sum_base -= base
        del self.decoding[req]

    def _preempt_for(self, need: int, req: R, preempted: list[R]) -> bool:
        """Preempt the newest running requests until ``need`` blocks are free; False if ``req`` was one."""
        pool = self.kv.pool
        while need > pool.free_blocks:
            victim = self.prefilling[-1] if self.prefilling else next(reversed(self.decoding))
            self._preempt(victim, preempted)
            if victim is req:
                return False
        return True

    def _preempt(self, victim: R, preempted: list[R]) -> None:
        """Preempt the newest running request ``victim`` by recompute to the front of the queue."""
        if victim.decoding:
            self._leave_decoding(victim)
        else:
            self.prefilling.pop()
        self.kv.release(victim)
        victim.computed = 0
        victim.preempted = True
        self.waiting.appendleft(victim)
        preempted.append(victim)
        self.preemptions += 1
