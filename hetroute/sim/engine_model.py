"""One engine instance's scheduler and KV cache, as a pure step function (shared by emulator and simulator).

Owns: :class:`EngineConfig`, :class:`EngineModel` and its outcome/stats value types. No asyncio, no
clock reads, no randomness: the caller passes ``now_s`` and applies each :class:`StepOutcome` at
``now_s + duration_s`` (the simulator schedules an event; the emulator sleeps). State is advanced
when ``step`` plans the iteration, so ``stats()`` during a step shows the state after it.

vLLM flavour (V1 scheduler, prefix caching off, no speculative decoding):
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

TGI flavour (router v2 style): admission reserves prompt + max_new_tokens (``reserve_tokens``) against
``max_batch_total_tokens`` (default: the KV capacity) and allocates all those blocks at once, so it never
preempts; a step with newly admitted requests prefills only them (whole prompts), otherwise it decodes
every running request.

Invariants: used blocks ≤ num_gpu_blocks; running ≤ max_num_seqs; tokens scheduled per step ≤ budget;
every submitted request that is not aborted emits exactly ``output_tokens`` tokens and then finishes.
Step time comes from :mod:`hetroute.sim.roofline`.
"""

from __future__ import annotations

from collections import deque

from hetroute.errors import ConfigError
from hetroute.sim.catalog import kv_capacity_tokens
from hetroute.sim.engine_types import (
    EngineConfig,
    EngineFlavour,
    EngineStats,
    PromptTooLong,
    StepOutcome,
    TokenEvent,
)
from hetroute.sim.roofline import StepCost, step_cost

__all__ = [
    "EngineConfig",
    "EngineFlavour",
    "EngineModel",
    "EngineStats",
    "PromptTooLong",
    "StepOutcome",
    "TokenEvent",
]


class _Request:
    __slots__ = (
        "request_id",
        "prompt",
        "output",
        "reserve",
        "computed",
        "generated",
        "blocks",
        "arrival_s",
        "started",
        "event",
    )

    def __init__(self, request_id: str, prompt: int, output: int, reserve: int, arrival_s: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.output = output
        self.reserve = reserve
        self.computed = 0
        self.generated = 0
        self.blocks = 0
        self.arrival_s = arrival_s
        self.started = False
        # TokenEvents are immutable, so one instance per request serves every decode step.
        self.event = TokenEvent(request_id, 1, False)


class EngineModel:
    """A vLLM- or TGI-like engine instance (see module docstring for the scheduling rules)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        if config.num_gpu_blocks_override is not None:
            self.num_gpu_blocks = config.num_gpu_blocks_override
        else:
            cap = kv_capacity_tokens(
                config.gpu,
                config.model,
                config.tp,
                config.gpu_memory_utilization,
                config.overhead_gib_per_gpu,
            )
            self.num_gpu_blocks = cap // config.block_size
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
        self._budget = (
            config.max_num_batched_tokens
            if chunked
            else max(config.max_num_batched_tokens, self.max_model_len)
        )
        self.cost: StepCost = step_cost(config.gpu, config.model, config.tp)
        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._free_blocks = self.num_gpu_blocks
        self._reserved = 0
        self._preemptions = 0
        self._prompt_total = 0
        self._generation_total = 0
        self._finished_total = 0
        self._aborted_total = 0
        self._steps = 0
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
    ) -> None:
        """Queue a request that will generate exactly ``output_tokens`` tokens.

        ``reserve_tokens`` (TGI's max_new_tokens, ≥ output_tokens) is what TGI admission reserves;
        it defaults to ``output_tokens``. Raises :class:`PromptTooLong` past ``max_model_len`` and
        ValueError for a duplicate id or non-positive lengths.
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
        req = _Request(request_id, prompt_tokens, output_tokens, reserve, now_s)
        self._requests[request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.started:
            self._running.remove(req)
            self._release(req)
        else:
            self._waiting.remove(req)
            self._free_blocks += req.blocks
            req.blocks = 0
        self._aborted_total += 1
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def stats(self) -> EngineStats:
        used = self.num_gpu_blocks - self._free_blocks
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
        )

    # ------------------------------------------------------------ the step

    def step(self, now_s: float) -> StepOutcome:
        """Plan one iteration starting at ``now_s`` and advance the state to its end."""
        if self.config.engine == "tgi":
            scheduled, preempted = self._schedule_tgi(), list[str]()
        else:
            scheduled, preempted = self._schedule_vllm()
        if not scheduled:
            return StepOutcome(0.0, (), (), tuple(preempted))
        self._steps += 1
        return self._execute(scheduled, preempted)

    def _release(self, req: _Request) -> None:
        self._free_blocks += req.blocks
        req.blocks = 0
        if req.started:
            self._reserved -= req.prompt + req.reserve
            req.started = False

    def _schedule_vllm(self) -> tuple[list[tuple[_Request, int]], list[str]]:
        bs = self.block_size
        budget = self._budget
        running = self._running
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
                self_preempted = False
                while need > self._free_blocks:
                    victim = running.pop()  # the newest running request
                    self._release(victim)
                    victim.computed = 0
                    self._waiting.appendleft(victim)
                    preempted.append(victim.request_id)
                    self._preemptions += 1
                    if victim is req:
                        self_preempted = True
                        break
                if self_preempted:
                    break
                self._free_blocks -= need
                req.blocks += need
            append((req, num_new))
            budget -= num_new
        if preempted:
            return scheduled, preempted
        waiting = self._waiting
        while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
            req = waiting[0]
            num_new = req.prompt + req.generated - req.computed
            if not self._chunked and num_new > budget:
                break
            num_new = min(num_new, budget)
            need = -(-(req.computed + num_new) // bs) - req.blocks
            if need > self._free_blocks:
                break
            waiting.popleft()
            running.append(req)
            req.started = True
            self._reserved += req.prompt + req.reserve
            self._free_blocks -= need
            req.blocks += need
            scheduled.append((req, num_new))
            budget -= num_new
        return scheduled, preempted

    def _schedule_tgi(self) -> list[tuple[_Request, int]]:
        bs = self.block_size
        budget = self._budget
        waiting = self._waiting
        admitted: list[tuple[_Request, int]] = []
        while waiting and len(self._running) < self.config.max_num_seqs:
            req = waiting[0]
            total = req.prompt + req.reserve
            num_new = req.prompt
            need = -(-total // bs)
            if (
                num_new > budget
                or self._reserved + total > self.max_batch_total_tokens
                or need > self._free_blocks
            ):
                break
            waiting.popleft()
            self._running.append(req)
            req.started = True
            self._reserved += total
            self._free_blocks -= need
            req.blocks = need
            admitted.append((req, num_new))
            budget -= num_new
        if admitted:
            return admitted
        return [(req, 1) for req in self._running]

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
