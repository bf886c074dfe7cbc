"""The TGI-flavoured continuous-batching scheduler (router v2 style) of the engine model.

Owns :class:`TgiScheduler`. Same interface as :class:`~hetroute.sim.vllm_scheduler.VllmScheduler` (it
returns a :class:`~hetroute.sim.vllm_scheduler.StepResult`), different rules:

- Admission (FCFS, stopping at the first that does not fit) reserves prompt + max_new_tokens
  (``reserve``) against ``max_batch_total_tokens`` and allocates all those blocks at once, so it never
  preempts. A step with newly admitted requests prefills only them (whole prompts, within the token
  budget); otherwise it decodes every running request.
- Prefix caching (TGI 3's radix cache): admission shares the cached leading blocks and prefills the rest
  (one token if the whole prompt is cached); a request's full prompt blocks are cached when it leaves the
  batch (``KvBook.cache_on_release``).

Every request is advanced explicitly: a step costs O(running).
"""

from __future__ import annotations

from collections import deque
from typing import Generic

from hetroute.sim.sched_request import KvBook
from hetroute.sim.step_timer import StepBatch
from hetroute.sim.vllm_scheduler import R, StepResult


class TgiScheduler(Generic[R]):
    """The waiting queue and running batch of a TGI-like engine (rules: module docstring)."""

    __slots__ = ("kv", "max_num_seqs", "budget", "max_batch_total_tokens", "waiting", "batch", "preemptions")

    def __init__(
        self, kv: KvBook, max_num_seqs: int, budget_tokens: int, max_batch_total_tokens: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.budget = budget_tokens
        self.max_batch_total_tokens = max_batch_total_tokens
        self.waiting: deque[R] = deque()
        self.batch: list[R] = []  # running requests, admission order
        self.preemptions = 0  # TGI never preempts

    def submit(self, req: R) -> None:
        self.waiting.append(req)

    def abort(self, req: R) -> None:
        if req.started:
            self.batch.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.release(req)

    def has_work(self) -> bool:
        return bool(self.batch or self.waiting)

    @property
    def running(self) -> int:
        return len(self.batch)

    def step(self) -> StepResult[R]:
        """Plan one step (admitted prefills, else a decode of the batch) and advance the state to its end."""
        return self._execute(self._schedule())

    def _schedule(self) -> list[tuple[R, int]]:
        kv, bs, budget, waiting = self.kv, self.kv.block_size, self.budget, self.waiting
        admitted: list[tuple[R, int]] = []
        while waiting and len(self.batch) < self.max_num_seqs:
            req = waiting[0]
            total = req.prompt + req.reserve
            hit, evictable = kv.lookup(req, len(req.hashes)) if kv.caching else (0, 0)
            computed = min(hit * bs, req.prompt - 1)  # TGI recomputes one token of a fully cached prompt
            num_new = req.prompt - computed
            need = -(-total // bs) - hit
            if (
                num_new > budget
                or kv.reserved_tokens + total > self.max_batch_total_tokens
                or need + evictable > kv.pool.free_blocks
            ):
                break
            waiting.popleft()
            self.batch.append(req)
            kv.admit(req, hit, need, computed)
            admitted.append((req, num_new))
            budget -= num_new
        if admitted:
            return admitted
        return [(req, 1) for req in self.batch]

    def _execute(self, scheduled: list[tuple[R, int]]) -> StepResult[R]:
        decoders: list[R] = []
        completed: list[tuple[R, bool]] = []
        finished: list[R] = []
        decode_seqs = decode_kv = prefill_tokens = prefill_chunks = prefill_kv = 0
        prefill_attn = 0.0
        for req, num_new in scheduled:
            computed = req.computed
            generated = req.generated
            if num_new == 1 and generated:
                decode_seqs += 1
                decode_kv += computed
            else:
                prefill_tokens += num_new
                prefill_chunks += 1
                prefill_kv += computed
                prefill_attn += num_new * (computed + num_new / 2.0)
            computed += num_new
            req.computed = computed
            if computed >= req.prompt + generated:
                if generated:
                    decoders.append(req)
                else:
                    completed.append((req, True))
                generated += 1
                req.generated = generated
                if generated >= req.output:
                    finished.append(req)
        if finished:
            for req in finished:
                self.kv.release(req)
            self.batch = [r for r in self.batch if r.started]
        batch = StepBatch(decode_seqs, decode_kv, prefill_tokens, prefill_chunks, prefill_attn, prefill_kv)
        return StepResult(batch, decoders, completed, finished, [])
