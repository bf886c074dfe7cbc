"""Shared value types and protocols for every layer of hetroute.

Everything here is immutable (frozen, slotted dataclasses) except the arrays inside a
:class:`ClusterSnapshot`, which are read-only numpy views. Policies receive only these
types, so they can never mutate router state.

Dependency rule: this module imports nothing from the rest of hetroute except
``hetroute.latency`` (the profile schema), so every layer may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from hetroute.latency import LatencyProfile

Api = Literal["openai", "tgi"]
"""The client-facing API family of a request."""

EngineKind = Literal["vllm", "tgi", "openai"]
"""The engine behind a backend. vLLM and TGI both speak OpenAI; only TGI speaks /generate."""

ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "tgi", "openai")

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def engine_speaks(engine: EngineKind, api: Api) -> bool:
    """True when a backend of kind ``engine`` serves requests of API family ``api``."""
    return api == "openai" or engine == "tgi"


@dataclass(frozen=True, slots=True)
class BackendFields:
    """The fields a configured backend (``hetroute.config.BackendConfig``) and its routing view
    (:class:`BackendSpec`) share, defined once. ``engine`` and ``models`` are not here: the routing view
    requires them, the config may leave them to discovery. Every field after ``url`` is keyword-only.

    ``kv_capacity_tokens`` is the configured or discovered KV capacity in tokens (None when
    unknown; engines' ``vllm:cache_config_info`` or the profile may supply it later).
    ``max_model_len`` is the engine's context window in tokens, prompt and output together (configured,
    or discovered: vLLM's ``/v1/models`` ``max_model_len``, TGI's ``/info`` ``max_total_tokens``; None
    when unknown). The output-length prediction never exceeds what the window leaves after the prompt.
    """

    name: str
    url: str
    _: KW_ONLY
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu: str | None = None
    tp: int | None = None
    profile: LatencyProfile | None = None
    profile_path: str | None = None
    kv_capacity_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class BackendSpec(BackendFields):
    """One backend as the router sees it (engine instance). Immutable; swapped whole on reconfiguration."""

    engine: EngineKind
    models: tuple[str, ...]

    def serves(self, model: str, api: Api) -> bool:
        """True when this backend serves ``model`` through API family ``api``."""
        return model in self.models and engine_speaks(self.engine, api)


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The latest scrape of one backend's own ``/metrics`` (or the simulator's engine state).

    A metric the engine does not expose is ``None``, never 0 (house style §6).
    """

    scraped_at_s: float
    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    kv_usage_frac: float | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_preemptions_total: float | None = None
    batch_current_max_tokens: float | None = None
    prefix_cache_queries_total: float | None = None
    """Prompt tokens looked up in the engine's prefix cache (vLLM ``vllm:prefix_cache_queries``)."""
    prefix_cache_hits_total: float | None = None
    """Tokens of those lookups found cached (vLLM ``vllm:prefix_cache_hits``); TGI exports neither."""


class RequestFeatures(NamedTuple):
    """What a policy may know about a request before it is dispatched.

    ``input_tokens`` is an estimate (chars-per-token, learned online) unless a tokenizer
    was used; ``predicted_output_tokens`` comes from the configured predictor and is
    already clamped to ``max_tokens``.

    ``prefix_hashes`` are the chained hashes of the prompt's full chunks (``hetroute.prefix.hashing``),
    each about ``prefix_chunk_tokens`` tokens; empty when prefix routing is off or the prompt is
    shorter than one chunk. ``session`` is the request's session key ("" = none).
    """

    request_id: str
    model: str
    api: Api
    input_tokens: int
    max_tokens: int | None
    predicted_output_tokens: int
    stream: bool = False
    prefix_hashes: tuple[int, ...] = ()
    prefix_chunk_tokens: float = 0.0
    session: str = ""


class ClusterSnapshot(NamedTuple):
    """An immutable view of the cluster for one routing decision.

    Index ``i`` in every array refers to ``backends[i]``. Arrays are read-only copies of
    the ledger's per-backend accounting at ``now_s``:

    - ``requests_in_flight[i]``: dispatched and not yet released requests.
    - ``input_tokens_in_flight[i]``: Σ I_r of those requests.
    - ``remaining_predicted_tokens[i]``: Σ max(Õ_r − generated_r, 0).
    - ``generated_tokens_in_flight[i]``: Σ tokens generated so far (observed while streaming).
    - ``predicted_output_tokens_in_flight[i]``: Σ Õ_r as predicted at dispatch.
    - ``workload[i]``: L_i, the sum of the policy costs (``RoutingDecision.workload_cost``)
      of in-flight requests (method.md §5).
    - ``prefill_pending_tokens[i]``: Σ I_r of in-flight requests whose first token has not been
      seen yet (prompts queued for or in prefill).
    - ``available[i]``: healthy and not ejected.
    - ``kv_capacity_tokens[i]``: best known KV capacity in tokens, NaN when unknown
      (profile, then engine metrics, then config).

    ``metrics[i]`` is the latest engine scrape or None.

    ``latency_params`` (n×8, p1..p8 per backend) is the live-learned latency model when the router
    learns (``hetroute.learning``), else None and policies use their static models (profile, roofline
    prior, neutral default). ``model_samples[i]`` counts the observations behind backend i's model
    since its last detected drift (None when not learning); policies use it to bound exploration.

    The last three fields concern the request being decided (``hetroute.prefix``):
    ``prefix_matched_tokens[i]`` is how many of its prompt tokens the router's prefix index says
    backend i holds (None when prefix routing is off or the prompt has no full chunk),
    ``prefix_trust[i]`` the engines' hit counters' correction of that guess (in [0.05, 1]), and
    ``session_backend`` the backend its session last went to (-1: none).
    """

    now_s: float
    backends: tuple[BackendSpec, ...]
    metrics: tuple[EngineMetrics | None, ...]
    requests_in_flight: IntArray
    input_tokens_in_flight: FloatArray
    remaining_predicted_tokens: FloatArray
    generated_tokens_in_flight: FloatArray
    predicted_output_tokens_in_flight: FloatArray
    workload: FloatArray
    prefill_pending_tokens: FloatArray
    available: BoolArray
    kv_capacity_tokens: FloatArray
    latency_params: FloatArray | None = None
    model_samples: FloatArray | None = None
    prefix_matched_tokens: FloatArray | None = None
    prefix_trust: FloatArray | None = None
    session_backend: int = -1

    def prefix_cached_tokens(self, idx: IntArray) -> FloatArray | None:
        """Estimated cached prompt tokens of this decision's request on backends ``idx``
        (``trust · matched``, docs/prefix.md), or None when nothing is known. ``idx`` ascending and
        distinct, as a policy's candidates are (:class:`Policy`)."""
        matched = self.prefix_matched_tokens
        if matched is None:
            return None
        trust = self.prefix_trust
        if idx.size == matched.size:  # every backend, in order (candidates are sorted and distinct)
            out: FloatArray = matched if trust is None else matched * trust
            return out
        out = matched[idx] if trust is None else matched[idx] * trust[idx]
        return out

    @property
    def kv_tokens_in_flight(self) -> FloatArray:
        """Σ (I + generated + remaining prediction) per backend: the ledger's KV estimate."""
        out: FloatArray = (
            self.input_tokens_in_flight + self.generated_tokens_in_flight + self.remaining_predicted_tokens
        )
        return out

    def index_of(self, name: str) -> int:
        """Position of backend ``name`` (ValueError when absent)."""
        for i, spec in enumerate(self.backends):
            if spec.name == name:
                return i
        raise ValueError(f"unknown backend {name!r}")


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """A policy's answer: the chosen backend index, why, and the cost it adds to L_index.

    ``workload_cost`` is added to the chosen backend's load in the ledger on dispatch and
    removed exactly once when the request ends (method.md §5). Policies that do not use a
    load notion return 0.
    """

    index: int
    reason: str
    workload_cost: float = 0.0
    scores: Mapping[str, float] = field(default_factory=dict)


class Policy(Protocol):
    """A routing policy: a pure decision over an immutable snapshot.

    ``candidates`` holds the indices (into ``snapshot.backends``) that serve the request's
    model and API and are available, in ascending order, each once; it is never empty. ``choose``
    does no I/O, never reads the clock or the global RNG, and must return one of the candidates.
    """

    name: str

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision: ...


class OutputLengthPredictor(Protocol):
    """Predicts a request's output length in tokens; learns from completed requests.

    ``predict`` never exceeds ``max_tokens`` when it is given and is at least 1 (callers pass the
    request's own limit: its ``max_tokens`` and what the context window leaves,
    :func:`hetroute.output_limits.output_limit`).
    ``observe`` with ``cut``: the output stopped because the context window was full, so the model
    would have written at least that many tokens (a censored observation,
    :func:`hetroute.output_limits.output_cut`); a predictor that learns does not take it as the
    output's length (see each predictor).
    """

    name: str

    def predict(self, model: str, input_tokens: int, max_tokens: int | None) -> int: ...

    def observe(self, model: str, input_tokens: int, output_tokens: int, cut: bool = False) -> None: ...


class Clock(Protocol):
    """Monotonic seconds. The only way code reads time (house style §7)."""

    def now(self) -> float: ...
