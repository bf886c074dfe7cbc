"""The engine model's configuration and value types: :class:`EngineConfig`, :class:`PromptTooLong`,
:class:`TokenEvent`, :class:`StepOutcome` and :class:`EngineStats`.

Plain frozen data, validated at construction (errors name the field); :mod:`hetroute.sim.engine_model`
re-exports every name, so callers import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetroute.catalog.specs import GpuSpec, ModelSpec, check_tp, kv_capacity_tokens
from hetroute.errors import ConfigError

EngineFlavour = Literal["vllm", "tgi"]


class PromptTooLong(ValueError):
    """prompt + output exceeds max_model_len; the message follows vLLM's 400 BadRequestError."""

    def __init__(self, prompt_tokens: int, output_tokens: int, max_model_len: int) -> None:
        if prompt_tokens >= max_model_len:
            text = (
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
        else:
            text = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens + output_tokens} tokens ({prompt_tokens} in the messages, "
                f"{output_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        super().__init__(text)
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (vLLM flag names); validation errors name the field.

    ``enable_prefix_caching`` (vLLM V1's default, True) turns automatic prefix caching on for both
    flavours (TGI 3: ``PREFIX_CACHING``); it only acts on requests submitted with block hashes.
    """

    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    engine: EngineFlavour = "vllm"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    overhead_gib_per_gpu: float = 2.0
    max_model_len: int | None = None
    num_gpu_blocks_override: int | None = None
    max_batch_total_tokens: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "tgi"):
            raise ConfigError("engine", f"expected one of vllm|tgi, got {self.engine!r}")
        for name in ("tp", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"expected a positive integer, got {value!r}")
        for name in ("max_model_len", "num_gpu_blocks_override", "max_batch_total_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"expected a positive integer or None, got {value!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"expected true or false, got {getattr(self, name)!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "gpu_memory_utilization", f"expected a fraction in (0, 1], got {self.gpu_memory_utilization}"
            )
        try:
            check_tp(self.model, self.tp)
        except ValueError as exc:
            raise ConfigError("tp", str(exc)) from exc

    def num_gpu_blocks(self) -> int:
        """KV blocks of the engine: the override, else the catalog's KV capacity in whole blocks."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        cap = kv_capacity_tokens(
            self.gpu, self.model, self.tp, self.gpu_memory_utilization, self.overhead_gib_per_gpu
        )
        return cap // self.block_size


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """``tokens`` new output tokens of ``request_id`` produced at ``now_s + duration_s``."""

    request_id: str
    tokens: int
    first: bool


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one planned step does; the caller applies it at ``now_s + duration_s``.

    Events of a request aborted while the step runs should be dropped by the caller.
    """

    duration_s: float
    emitted: tuple[TokenEvent, ...]
    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    scheduled_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of engine state and counters (the numbers a real engine exports on /metrics)."""

    running: int
    waiting: int
    kv_usage_frac: float
    used_blocks: int
    num_gpu_blocks: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    requests_aborted_total: int
    batch_reserved_tokens: int
    steps_total: int
    prefix_cache_queries_total: int = 0
    """Prompt tokens of the requests looked up in the prefix cache (vLLM's ``prefix_cache_queries``)."""
    prefix_cache_hits_total: int = 0
    """Tokens of those lookups found cached (vLLM's ``prefix_cache_hits``)."""
