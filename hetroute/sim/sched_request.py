"""A request as the engine schedulers see it, and the KV bookkeeping both flavours share.

Owns :class:`SchedRequest` (the scheduling state of one request), :class:`EngineRequest` (the engine
model's, which also carries its reusable :class:`TokenEvent`) and :class:`KvBook` (a request's KV blocks
in a :class:`~hetroute.sim.prefix_cache.BlockPool`: prefix lookup, admission, caching of full prompt
blocks, release). Used by :mod:`hetroute.sim.vllm_scheduler` and :mod:`hetroute.sim.tgi_scheduler`.

KV accounting: a started request holds ``blocks`` blocks, ``held`` of them cached blocks it references
(shared, counted once in the pool) and the rest private. The vLLM scheduler allocates lazily, so a running
request holds exactly ``ceil(computed / block_size)`` blocks; TGI reserves prompt + max_new_tokens at
admission. While a request is in the vLLM scheduler's decoding set, ``computed``, ``generated`` and
``blocks`` are stale: they are ``base + counter``, ``computed − prompt + 1`` (a decoder holds the KV of
every token but its last) and ``ceil(computed / block_size)`` of the scheduler's step counter, and are
written back when it leaves the set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetroute.sim.engine_types import TokenEvent
from hetroute.sim.prefix_cache import BlockPool


@dataclass(slots=True, eq=False)  # eq=False: requests compare (and hash) by identity
class SchedRequest:
    """One request's scheduling state (see the module docstring for which fields are lazy)."""

    request_id: str
    prompt: int
    output: int
    reserve: int  # what TGI admission reserves besides the prompt (max_new_tokens ≥ output)
    hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks (empty: none or caching off)
    computed: int = 0
    generated: int = 0
    blocks: int = 0  # private blocks + len(held)
    started: bool = False
    held: list[int] = field(default_factory=list)  # cached blocks it references, in block-table order
    cached: int = 0  # leading prompt blocks already hit or registered
    preempted: bool = False
    decoding: bool = False  # in the vLLM scheduler's decoding set (computed, generated, blocks are lazy)
    base: int = 0  # decoding: computed = base + counter
    seq: int = 0  # admission number (the newest running request has the largest)


@dataclass(slots=True, eq=False)
class EngineRequest(SchedRequest):
    """A request of :class:`~hetroute.sim.engine_model.EngineModel`."""

    event: TokenEvent = field(init=False)  # immutable, so one instance serves every decode step

    def __post_init__(self) -> None:
        self.event = TokenEvent(self.request_id, 1, False)


class KvBook:
    """The KV blocks of one engine's requests in ``pool`` (blocks of ``block_size`` tokens).

    ``caching``: automatic prefix caching is on. ``cache_on_release``: a request's full prompt blocks are
    cached when it leaves the batch (TGI) rather than in the step that computes them (vLLM).
    ``reserved_tokens``: prompt + reserve of every started request (TGI's batch budget).
    """

    __slots__ = ("pool", "block_size", "caching", "cache_on_release", "reserved_tokens")

    def __init__(self, pool: BlockPool, block_size: int, *, caching: bool, cache_on_release: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.caching = caching
        self.cache_on_release = cache_on_release
        self.reserved_tokens = 0

    def lookup(self, req: SchedRequest, max_blocks: int) -> tuple[int, int]:
        """``(hit blocks, evictable among them)`` of a waiting request; counts the query in tokens, as
        vLLM does on every admission try (apart for a request preempted before)."""
        hit, evictable = self.pool.lookup(req.hashes, max_blocks)
        self.pool.record(req.prompt + req.generated, hit * self.block_size, preempted=req.preempted)
        return hit, evictable

    def admit(self, req: SchedRequest, hit: int, need: int, computed: int) -> None:
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
        self.reserved_tokens += req.prompt + req.reserve

    def register(self, req: SchedRequest, tokens: int) -> None:
        """Cache the prompt blocks of ``req`` that its first ``tokens`` tokens fill."""
        stop = min(len(req.hashes), tokens // self.block_size)
        if stop > req.cached:
            self.pool.register(req.hashes, req.cached, stop, req.held)
            req.cached = stop

    def release(self, req: SchedRequest) -> None:
        """Free every block of ``req`` (its ``computed`` and ``blocks`` must be current)."""
        if self.cache_on_release and req.hashes:
            self.register(req, req.computed)
        held = req.held
        if held:
            self.pool.release(held, req.blocks - len(held))
            req.held = []
        else:
            self.pool.release((), req.blocks)
        req.cached = 0
        req.blocks = 0
        if req.started:
            self.reserved_tokens -= req.prompt + req.reserve
            req.started = False
