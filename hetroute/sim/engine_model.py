"""One engine instance's scheduler and KV cache, as a pure step function (shared by emulator and simulator).

Owns: :class:`EngineModel`, a facade over one flavour's scheduler (the vLLM one,
:mod:`hetroute.sim.vllm_scheduler`, is the same code the tuner's estimate runs; the TGI one is
:mod:`hetroute.sim.tgi_scheduler`) and a :class:`~hetroute.sim.step_timer.StepTimer` (the catalog's
roofline unless one is given). Its config and value types live in :mod:`engine_types` and are re-exported
here; its KV blocks are a :class:`~hetroute.sim.prefix_cache.BlockPool` (``pool``). No asyncio, no clock
reads, no randomness: the caller passes ``now_s`` and applies each :class:`StepOutcome` at
``now_s + duration_s`` (the simulator schedules an event; the emulator sleeps). State is advanced when
``step`` plans the iteration, so ``stats()`` during a step shows the state after it.

vLLM flavour: the rules are :mod:`hetroute.sim.vllm_scheduler`'s (FCFS, token budget
``max_num_batched_tokens`` with chunked prefill, lazy KV in blocks, preemption of the newest running
request by recompute, admission only in a step without preemption, automatic prefix caching). Without
chunked prefill a prompt is scheduled whole and the budget is at least ``max_model_len``, as vLLM sets
it; recent vLLM then skips a prompt larger than the remaining budget and tries the next, we stop, which
keeps admission O(1) per step with thousands waiting. As vLLM does, the budget must be at least
``max_num_seqs``. Prefix-caching details (as vLLM V1): a request submitted with ``block_hashes`` is looked
up on every admission try (and again after a preemption); at most ``tokens − 1`` tokens hit, in whole
blocks (vLLM recomputes the last token for its logits, so a fully cached prompt recomputes its whole last
block); shared blocks count once in KV usage; freed cached blocks stay hittable but count as free and are
evicted on demand (:mod:`prefix_cache`). Output blocks are not hashed (output token ids are unknown here;
vLLM caches them too, so a resumed request re-hits only its prompt). A request without hashes never hits.

TGI flavour (router v2 style): :mod:`hetroute.sim.tgi_scheduler` — admission reserves prompt +
max_new_tokens (``reserve_tokens``) against ``max_batch_total_tokens`` (default: the KV capacity) and
never preempts; a step with newly admitted requests prefills only them, otherwise it decodes the batch.

Invariants: used blocks (private + referenced cached blocks, each once) ≤ num_gpu_blocks; running ≤
max_num_seqs; tokens scheduled per step ≤ budget; every submitted request that is not aborted emits
exactly ``output_tokens`` tokens and then finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

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
from hetroute.sim.sched_request import EngineRequest, KvBook
from hetroute.sim.step_timer import RooflineTimer, StepTimer
from hetroute.sim.tgi_scheduler import TgiScheduler
from hetroute.sim.vllm_scheduler import StepResult, VllmScheduler

__all__ = [
    "EngineConfig",
    "EngineFlavour",
    "EngineModel",
    "EngineStats",
    "PromptTooLong",
    "StepOutcome",
    "TokenEvent",
]


class EngineModel:
    """A vLLM- or TGI-like engine (rules: module docstring); ``pool``: its KV blocks, read-only.

    ``timer`` prices each step (default: the roofline of ``config``'s GPU, model and TP, ``cost``).
    """

    def __init__(self, config: EngineConfig, timer: StepTimer | None = None) -> None:
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
        tgi = config.engine == "tgi"
        if tgi and self.max_batch_total_tokens < self.max_model_len:
            raise ConfigError(
                "max_batch_total_tokens",
                f"{self.max_batch_total_tokens} is smaller than max_model_len {self.max_model_len}",
            )
        chunked = config.enable_chunked_prefill and not tgi
        budget = (
            config.max_num_batched_tokens
            if chunked
            else max(config.max_num_batched_tokens, self.max_model_len)
        )
        self.cost: StepCost = step_cost(config.gpu, config.model, config.tp)
        self.timer: StepTimer = timer if timer is not None else RooflineTimer(self.cost)
        self.pool = BlockPool(self.num_gpu_blocks)
        self._kv = KvBook(
            self.pool, config.block_size, caching=config.enable_prefix_caching, cache_on_release=tgi
        )
        self._caching = config.enable_prefix_caching
        self._scheduler: VllmScheduler[EngineRequest] | TgiScheduler[EngineRequest]
        if tgi:
            self._scheduler = TgiScheduler(self._kv, config.max_num_seqs, budget, self.max_batch_total_tokens)
        else:
            if budget < config.max_num_seqs:
                raise ConfigError(
                    "max_num_batched_tokens",
                    f"{config.max_num_batched_tokens} must be greater than or equal to max_num_seqs "
                    f"({config.max_num_seqs}), as vLLM requires",
                )
            self._scheduler = VllmScheduler(
                self._kv, config.max_num_seqs, budget, chunked=chunked, track_decoders=True
            )
        self._requests: dict[str, EngineRequest] = {}
        self._steps = 0
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
        req = EngineRequest(request_id, prompt_tokens, output_tokens, reserve, hashes)
        self._requests[request_id] = req
        self._scheduler.submit(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._scheduler.abort(req)
        self._aborted_total += 1
        return True

    def has_work(self) -> bool:
        return self._scheduler.has_work()

    def stats(self) -> EngineStats:
        used = self.pool.used_blocks
        return EngineStats(
            running=self._scheduler.running,
            waiting=len(self._scheduler.waiting),
            kv_usage_frac=used / self.num_gpu_blocks,
            used_blocks=used,
            num_gpu_blocks=self.num_gpu_blocks,
            num_preemptions_total=self._scheduler.preemptions,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generation_total,
            requests_finished_total=self._finished_total,
            requests_aborted_total=self._aborted_total,
            batch_reserved_tokens=self._kv.reserved_tokens,
            steps_total=self._steps,
            prefix_cache_queries_total=self.pool.queries_tokens,
            prefix_cache_hits_total=self.pool.hits_tokens,
        )

    # ------------------------------------------------------------ the step

    def step(self, now_s: float) -> StepOutcome:
        """Plan one iteration starting at ``now_s`` and advance the state to its end."""
        result = self._scheduler.step()
        preempted = tuple(r.request_id for r in result.preempted)
        batch = result.batch
        if batch.empty:
            return StepOutcome(0.0, (), (), preempted)
        self._steps += 1
        return StepOutcome(
            self.timer.step_s(batch) * self.slowdown_factor,
            self._emitted(result),
            self._finish(result),
            preempted,
            batch.prefill_tokens + batch.decode_seqs,
        )

    def _emitted(self, result: StepResult[EngineRequest]) -> tuple[TokenEvent, ...]:
        """The step's token events in scheduling order: the decoders', then the completed prompts'."""
        emitted = [req.event for req in result.decoders or ()]
        for req, first in result.completed:
            if first:
                self._prompt_total += req.prompt
                emitted.append(TokenEvent(req.request_id, 1, True))
            else:
                emitted.append(req.event)
        self._generation_total += len(emitted)
        return tuple(emitted)

    def _finish(self, result: StepResult[EngineRequest]) -> tuple[str, ...]:
        finished = tuple(req.request_id for req in result.finished)
        for rid in finished:
            del self._requests[rid]
        self._finished_total += len(finished)
        return finished
