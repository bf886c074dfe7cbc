"""One engine instance's scheduler and KV cache, as a pure step function (shared by emulator and simulator).

Owns: :class:`EngineModel` (its config and value types, re-exported here, live in :mod:`engine_types`; its
KV blocks in a :class:`~hetroute.sim.prefix_cache.BlockPool`). No asyncio, no clock reads, no randomness:
the caller passes ``now_s`` and applies each :class:`StepOutcome` at ``now_s + duration_s`` (the simulator
schedules an event; the emulator sleeps). State is advanced when ``step`` plans the iteration, so
``stats()`` during a step shows the state after it.

vLLM flavour (V1 scheduler, no speculative decoding):
- FCFS. Each step first serves RUNNING requests in admission order, each asking for all its not yet
  computed tokens (1 when decoding), capped by the step's token budget ``max_num_batched_tokens``
  (with chunked prefill a long prompt is split over steps; without it a prompt is scheduled whole and
  the budget is at least ``max_model_len``, as vLLM sets it).
- KV is kept in blocks of ``block_size`` tokens; a request holds ``ceil(computed_tokens/block_size)``.
  When a running request needs a block and none is free, the newest running request is preempted by
  recompute: its blocks are freed, its computed count reset, and it goes to the front of WAITING; on
  resumption it re-prefills prompt + already generated tokens (no token is emitted twice).
- WAITING requests are admitted (FCFS, stopping at the first that does not fit) only in a step with no
  preemption, while ``running < max_num_seqs``, budget remains and their blocks fit. (Without chunked
  prefill, recent vLLM skips a prompt larger than the remaining budget and tries the next; we stop, which
  keeps admission O(1) per step with thousands waiting.)
- A token is sampled for a request when its computed count reaches prompt + generated.
- Automatic prefix caching (``enable_prefix_caching``, vLLM V1's default): a request submitted with
  ``block_hashes`` (chained hashes of its prompt's full blocks) is looked up on every admission try (and
  again after a preemption); its leading cached blocks are shared (reference-counted) and its computed
  count starts at the hit, so those tokens are not prefilled. At most ``tokens − 1`` tokens hit, in whole
  blocks: vLLM recomputes the last token for its logits, so a fully cached prompt recomputes its whole
  last block. Full prompt blocks are cached in the step that computes them. Shared blocks count once in
  KV usage; freed cached blocks stay hittable but count as free and are evicted on demand
  (:mod:`prefix_cache`). Output blocks are not hashed (output token ids are unknown here; vLLM caches
  them too, so a resumed request re-hits only its prompt). A request without hashes never hits.

TGI flavour (router v2 style): admission reserves prompt + max_new_tokens (``reserve_tokens``) against
``max_batch_total_tokens`` (default: the KV capacity) and allocates all those blocks at once, so it never
preempts; a step with newly admitted requests prefills only them (whole prompts), otherwise it decodes
every running request. Prefix caching (TGI 3's radix cache, on by default): admission shares the cached
leading blocks and prefills the rest (one token if the whole prompt is cached); a request's full prompt
blocks are cached when it leaves the batch (TGI inserts a prefill into its radix trie on free).

Invariants: used blocks (private + referenced cached blocks, each once) ≤ num_gpu_blocks; running ≤
max_num_seqs; tokens scheduled per step ≤ budget; every submitted request that is not aborted emits
exactly ``output_tokens`` tokens and then finishes.
Step time comes from :mod:`hetroute.catalog.roofline`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetroute.catalog.roofline import StepCost, step_cost
from hetroute.errors import ConfigError
from hetroute.sim.engine_types import (
    EngineConfig,
    EngineFlavour,
    EngineStats,
    PromptTooLong,
    StepOutcome,
    TokenEvent,
)
from hetroute.sim.prefix_cache import BlockPool

__all__ = [
    "EngineConfig",
    "EngineFlavour",
    "EngineModel",
    "EngineStats",
    "PromptTooLong",
    "StepOutcome",
    "TokenEvent",
]


@dataclass(slots=True, eq=False)  # eq=False: requests compare by identity
class _Request:
    request_id: str
    prompt: int
    output: int
    reserve: int
    arrival_s: float
    hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks (empty: none or caching off)
    event: TokenEvent = field(init=False)  # immutable, so one instance serves every decode step
    computed: int = 0
    generated: int = 0
    blocks: int = 0  # private blocks + len(held)
    started: bool = False
    held: list[int] = field(default_factory=list)  # cached blocks it references, in block-table order
    cached: int = 0  # leading prompt blocks already hit or registered
    preempted: bool = False

    def __post_init__(self) -> None:
        self.event = TokenEvent(self.request_id, 1, False)


class EngineModel:
    """A vLLM- or TGI-like engine (scheduling rules: module docstring); ``pool``: its KV blocks, read-only."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.num_gpu_blocks = config.num_gpu_blocks()
        self.kv_capacity_tokens = self.num_gpu_blocks * config.block_size
        self.max_model_len = config.max_model_len or config.model.max_model_len
        if self.max_model_len > self.kv_capacity_tokens:
            raise ConfigError(
                "max_model_len",
                f"The model's max seq len ({self.max_model_len}) is larger than the maximum number of tokens "
                f"that can be stored in KV cache ({self.kv_capacity_tokens}). Try increasing "
                "gpu_memory_utilization or decreasing max_model_len when initializing the engine.",
            )
        self.max_batch_total_tokens = config.max_batch_total_tokens or self.kv_capacity_tokens
        if config.engine == "tgi" and self.max_batch_total_tokens < self.max_model_len:
            raise ConfigError(
                "max_batch_total_tokens",
                f"{self.max_batch_total_tokens} is smaller than max_model_len {self.max_model_len}",
            )
        chunked = config.enable_chunked_prefill and config.engine == "vllm"
        self._chunked = chunked
        budget = config.max_num_batched_tokens
        self._budget = budget if chunked else max(budget, self.max_model_len)
        self.cost: StepCost = step_cost(config.gpu, config.model, config.tp)
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self.pool = BlockPool(self.num_gpu_blocks)
        self._caching = config.enable_prefix_caching
        self._tgi = config.engine == "tgi"
        self._reserved = self._preemptions = self._steps = 0
        self._prompt_total = self._generation_total = self._finished_total = self._aborted_total = 0
        self.slowdown_factor = 1.0

    def set_slowdown(self, factor: float) -> None:
        """A fault: every later step takes ``factor`` times its modelled time (1 restores it)."""
        if not factor > 0:
            raise ValueError(f"slow-down factor must be > 0, got {factor}")
        self.slowdown_factor = float(factor)

    # ------------------------------------------------------------ requests

    def submit(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        now_s: float,
        *,
        reserve_tokens: int | None = None,
        block_hashes: Sequence[int] = (),
    ) -> None:
        """Queue a request that will generate exactly ``output_tokens`` tokens.

        ``reserve_tokens`` (TGI's max_new_tokens, ≥ output_tokens) is what TGI admission reserves;
        it defaults to ``output_tokens``. ``block_hashes`` are the chained hashes of the prompt's full
        blocks of ``block_size`` tokens (:func:`hetroute.prefix.hashing.token_block_hashes`), at most
        ``prompt_tokens // block_size`` of them; they are ignored when prefix caching is off. Raises
        :class:`PromptTooLong` past ``max_model_len`` and ValueError for a duplicate id, non-positive
        lengths or more hashes than full prompt blocks.
        """
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(
                f"prompt_tokens and output_tokens must be >= 1, got {prompt_tokens}, {output_tokens}"
            )
        reserve = output_tokens if reserve_tokens is None else max(reserve_tokens, output_tokens)
        if prompt_tokens + reserve > self.max_model_len:
            raise PromptTooLong(prompt_tokens, reserve, self.max_model_len)
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if len(block_hashes) > prompt_tokens // self.block_size:
            raise ValueError(
                f"{len(block_hashes)} block hashes for a prompt of {prompt_tokens} tokens "
                f"({prompt_tokens // self.block_size} full blocks of {self.block_size})"
            )
        hashes = tuple(block_hashes) if self._caching else ()
        req = _Request(request_id, prompt_tokens, output_tokens, reserve, now_s, hashes)
        self._requests[request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.started:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._release(req)
        self._aborted_total += 1
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def stats(self) -> EngineStats:
        used = self.pool.used_blocks
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage_frac=used / self.num_gpu_blocks,
            used_blocks=used,
            num_gpu_blocks=self.num_gpu_blocks,
            num_preemptions_total=self._preemptions,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generation_total,
            requests_finished_total=self._finished_total,
            requests_aborted_total=self._aborted_total,
            batch_reserved_tokens=self._reserved,
            steps_total=self._steps,
            prefix_cache_queries_total=self.pool.queries_tokens,
            prefix_cache_hits_total=self.pool.hits_tokens,
        )

    # ------------------------------------------------------------ the step

    def step(self, now_s: float) -> StepOutcome:
        """Plan one iteration starting at ``now_s`` and advance the state to its end."""
        if self._tgi:
            scheduled, preempted = self._schedule_tgi(), list[str]()
        else:
            scheduled, preempted = self._schedule_vllm()
        if not scheduled:
            return StepOutcome(0.0, (), (), tuple(preempted))
        self._steps += 1
        return self._execute(scheduled, preempted)

    def _release(self, req: _Request) -> None:
        if self._tgi and req.hashes:  # TGI caches a prefill when the request leaves the batch
            self._register(req, req.computed)
        self.pool.release(req.held, req.blocks - len(req.held))
        req.held = []
        req.cached = 0
        req.blocks = 0
        if req.started:
            self._reserved -= req.prompt + req.reserve
            req.started = False

    def _schedule_vllm(self) -> tuple[list[tuple[_Request, int]], list[str]]:
        bs = self.block_size
        budget = self._budget
        running = self._running
        pool = self.pool
        scheduled: list[tuple[_Request, int]] = []
        preempted: list[str] = []
        append = scheduled.append
        # Popping victims off the end while iterating is safe: the iterator then stops before them.
        for req in running:
            if budget <= 0:
                break
            computed = req.computed
            num_new = req.prompt + req.generated - computed
            if num_new > budget:
                num_new = budget
            end = computed + num_new
            if end > req.blocks * bs:  # needs new blocks (the common decode step does not)
                need = -(-end // bs) - req.blocks
                if need > pool.free_blocks and not self._preempt_for(need, req, preempted):
                    break  # req itself was preempted
                pool.allocate(need)
                req.blocks += need
            if req.cached < len(req.hashes):
                self._register(req, end)
            append((req, num_new))
            budget -= num_new
        if preempted:
            return scheduled, preempted
        waiting = self._waiting
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            req = waiting[0]
            hit = evictable = 0
            if self._caching:  # vLLM recomputes the last token, so at most tokens - 1 can hit
                hit, evictable = self._lookup(req, (req.prompt + req.generated - 1) // bs)
            computed = hit * bs
            num_new = req.prompt + req.generated - computed
            if not self._chunked and num_new > budget:
                break
            num_new = min(num_new, budget)
            need = -(-(computed + num_new) // bs) - hit
            if need + evictable > pool.free_blocks:
                break
            waiting.popleft()
            running.append(req)
            self._admit(req, hit, need, computed)
            if req.cached < len(req.hashes):
                self._register(req, computed + num_new)
            scheduled.append((req, num_new))
            budget -= num_new
        return scheduled, preempted

    def _preempt_for(self, need: int, req: _Request, preempted: list[str]) -> bool:
        """Preempt the newest running requests until ``need`` blocks are free; False if ``req`` was one."""
        running = self._running
        while need > self.pool.free_blocks:
            victim = running.pop()
            self._release(victim)
            victim.computed = 0
            victim.preempted = True
            self._waiting.appendleft(victim)
            preempted.append(victim.request_id)
            self._preemptions += 1
            if victim is req:
                return False
        return True

    def _schedule_tgi(self) -> list[tuple[_Request, int]]:
        bs = self.block_size
        budget = self._budget
        waiting = self._waiting
        admitted: list[tuple[_Request, int]] = []
        while waiting and len(self._running) < self.config.max_num_seqs:
            req = waiting[0]
            total = req.prompt + req.reserve
            hit, evictable = self._lookup(req, len(req.hashes)) if self._caching else (0, 0)
            computed = min(hit * bs, req.prompt - 1)  # TGI recomputes one token of a fully cached prompt
            num_new = req.prompt - computed
            need = -(-total // bs) - hit
            if (
                num_new > budget
                or self._reserved + total > self.max_batch_total_tokens
                or need + evictable > self.pool.free_blocks
            ):
                break
            waiting.popleft()
            self._running.append(req)
            self._admit(req, hit, need, computed)
            admitted.append((req, num_new))
            budget -= num_new
        if admitted:
            return admitted
        return [(req, 1) for req in self._running]

    def _lookup(self, req: _Request, max_blocks: int) -> tuple[int, int]:
        """``(hit blocks, evictable among them)`` of a waiting request; counts the query in tokens, as
        vLLM does on every admission try (apart for a request preempted before)."""
        hit, evictable = self.pool.lookup(req.hashes, max_blocks)
        self.pool.record(req.prompt + req.generated, hit * self.block_size, preempted=req.preempted)
        return hit, evictable

    def _admit(self, req: _Request, hit: int, need: int, computed: int) -> None:
        """Start ``req`` with its ``hit`` leading cached blocks shared and ``need`` new blocks."""
        if hit:
            shared = req.hashes[:hit]
            self.pool.acquire(shared)
            req.held = list(shared)
        self.pool.allocate(need)
        req.blocks = hit + need
        req.cached = hit
        req.computed = computed
        req.started = True
        self._reserved += req.prompt + req.reserve

    def _register(self, req: _Request, tokens: int) -> None:
        """Cache the prompt blocks of ``req`` that its first ``tokens`` tokens fill."""
        stop = min(len(req.hashes), tokens // self.block_size)
        if stop > req.cached:
            self.pool.register(req.hashes, req.cached, stop, req.held)
            req.cached = stop

    def _execute(self, scheduled: list[tuple[_Request, int]], preempted: list[str]) -> StepOutcome:
        prefill_tokens = 0
        prefill_attn = 0.0
        decode_seqs = 0
        kv_read = 0
        emitted: list[TokenEvent] = []
        finished: list[str] = []
        generated_now = 0
        for req, num_new in scheduled:
            computed = req.computed
            kv_read += computed
            generated = req.generated
            if num_new == 1 and generated:
                decode_seqs += 1
            else:
                prefill_tokens += num_new
                prefill_attn += num_new * (computed + num_new / 2.0)
            computed += num_new
            req.computed = computed
            if computed >= req.prompt + generated:
                if generated:
                    emitted.append(req.event)
                else:
                    self._prompt_total += req.prompt
                    emitted.append(TokenEvent(req.request_id, 1, True))
                generated += 1
                req.generated = generated
                generated_now += 1
                if generated >= req.output:
                    finished.append(req.request_id)
        self._generation_total += generated_now
        if finished:
            for rid in finished:
                req = self._requests.pop(rid)
                self._release(req)
            self._finished_total += len(finished)
            self._running = [r for r in self._running if r.started]
        duration = self.cost.step_s(prefill_tokens, prefill_attn, decode_seqs, kv_read) * self.slowdown_factor
        return StepOutcome(
            duration, tuple(emitted), tuple(finished), tuple(preempted), prefill_tokens + decode_seqs
        )
