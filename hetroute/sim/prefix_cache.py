"""A paged KV block pool with automatic prefix caching, as vLLM V1's ``BlockPool`` behaves.

Owns :class:`BlockPool`: the engine model's ``num_gpu_blocks`` KV blocks, counted rather than named. A block
is in exactly one of four states:

- **private**: held by one request and not cached (a partial block, a decode block, or a full prompt
  block not registered yet). The pool only counts them; each request knows how many it holds.
- **cached, in use**: a full block named by its chained block hash (:mod:`hetroute.prefix.hashing`)
  with a reference count ≥ 1, one reference per request whose block table holds it.
- **cached, evictable**: a cached block whose reference count fell to 0. It keeps its content and can
  still be hit, but it counts as free: a new allocation may evict it.
- **fresh**: free and holding no cached content.

Semantics follow vLLM V1 (``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``, read at upstream
commit ``c59cb794``; ideas only, no code):

- :meth:`lookup` returns the longest run of leading hashes that are cached (in use or evictable).
- :meth:`acquire` ("touch") adds a reference to each hit block, taking an evictable one out of the free
  queue, so allocating never evicts the blocks a request just hit.
- :meth:`allocate` takes fresh blocks first and then evicts evictable blocks in queue order (least
  recently freed first). vLLM keeps one free queue and puts freed blocks without a hash at its front and
  freed cached blocks at its back, which is exactly this order.
- :meth:`release` frees a request's blocks tail first (vLLM frees ``reversed(block_table)``): the private
  blocks return as fresh blocks, and the cached blocks whose count reaches 0 join the back of the eviction
  queue in the order last block … first block, so the tail of a prompt is evicted before its head.
- :meth:`register` turns a request's private block into a cached one once it is full. If the hash is
  already cached (two requests computed the same block at once), vLLM caches the second copy too; here
  it stays private and is freed as a fresh block, so a lookup finds the first copy only.
- :meth:`record` keeps vLLM's prefix-cache counters, in tokens: ``queries`` (tokens of the requests
  looked up) and ``hits`` (tokens found). Lookups of a request that was preempted before are counted
  apart, as vLLM's ``preempted_queries``/``preempted_hits``, which it does not export.

Invariants: ``0 ≤ free_blocks ≤ num_blocks``; ``free_blocks`` = fresh + evictable blocks; every cached
block has a reference count ≥ 0 and is in the eviction queue exactly when its count is 0. The pool does
no I/O and reads no clock: order is the order of calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    """``num_blocks`` KV blocks with prefix caching (see the module docstring for the semantics)."""

    __slots__ = (
        "num_blocks",
        "free_blocks",
        "_fresh",
        "_refs",
        "_evictable",
        "queries_tokens",
        "hits_tokens",
        "preempted_queries_tokens",
        "preempted_hits_tokens",
        "evictions_total",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        """Blocks an allocation may take now: fresh plus evictable."""
        self._fresh = num_blocks
        self._refs: dict[int, int] = {}
        # Evictable cached blocks in eviction order (first key = evicted first); values unused.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.preempted_queries_tokens = 0
        self.preempted_hits_tokens = 0
        self.evictions_total = 0

    # ------------------------------------------------------------ views

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests: private ones plus cached ones with a reference, each counted once."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks with cached content, in use or evictable."""
        return len(self._refs)

    @property
    def evictable_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_hash: int) -> int | None:
        """The reference count of a cached block, or None if ``block_hash`` is not cached."""
        return self._refs.get(block_hash)

    def eviction_order(self) -> list[int]:
        """The evictable blocks' hashes, the next one to be evicted first (for tests and tools)."""
        return list(self._evictable)

    # ------------------------------------------------------------ operations

    def lookup(self, block_hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """``(hit, evictable)``: the first ``hit`` ≤ ``max_blocks`` hashes are all cached, and
        ``evictable`` of those have reference count 0 (acquiring them takes that many free blocks)."""
        refs = self._refs
        hit = evictable = 0
        for index in range(min(max_blocks, len(block_hashes))):
            count = refs.get(block_hashes[index])
            if count is None:
                break
            hit += 1
            if count == 0:
                evictable += 1
        return hit, evictable

    def record(self, queried_tokens: int, hit_tokens: int, *, preempted: bool = False) -> None:
        """Count one lookup: ``queried_tokens`` looked up, ``hit_tokens`` of them found in the cache."""
        if preempted:
            self.preempted_queries_tokens += queried_tokens
            self.preempted_hits_tokens += hit_tokens
        else:
            self.queries_tokens += queried_tokens
            self.hits_tokens += hit_tokens

    def acquire(self, block_hashes: Sequence[int]) -> None:
        """Add a reference to each cached block in ``block_hashes`` (KeyError if one is not cached)."""
        refs = self._refs
        for block_hash in block_hashes:
            count = refs[block_hash]
            if count == 0:
                del self._evictable[block_hash]
                self.free_blocks -= 1
            refs[block_hash] = count + 1

    def allocate(self, blocks: int) -> None:
        """Take ``blocks`` private blocks: fresh ones first, then evict the least recently freed cached ones.

        Raises ValueError if fewer than ``blocks`` are free (the scheduler checks ``free_blocks`` first).
        """
        if blocks > self.free_blocks:
            raise ValueError(f"cannot allocate {blocks} blocks, {self.free_blocks} free")
        self.free_blocks -= blocks
        fresh = self._fresh
        if blocks <= fresh:
            self._fresh = fresh - blocks
            return
        self._fresh = 0
        evictable, refs = self._evictable, self._refs
        for _ in range(blocks - fresh):
            block_hash, _ = evictable.popitem(last=False)
            del refs[block_hash]
        self.evictions_total += blocks - fresh

    def register(self, block_hashes: Sequence[int], start: int, stop: int, held: list[int]) -> None:
        """Cache blocks ``start`` … ``stop - 1`` of a request, private until now and full.

        Each hash not cached yet becomes a cached block with one reference (the request's) and is appended
        to ``held``, the request's list of cached blocks it references; an already cached hash stays a
        private block of the request (see the module docstring).
        """
        refs = self._refs
        for index in range(start, stop):
            block_hash = block_hashes[index]
            if block_hash not in refs:
                refs[block_hash] = 1
                held.append(block_hash)

    def release(self, held: Sequence[int], private_blocks: int) -> None:
        """Free a request's blocks: ``private_blocks`` private ones and a reference on each of ``held``
        (its cached blocks, in block-table order), tail first."""
        self._fresh += private_blocks
        freed = private_blocks
        refs, evictable = self._refs, self._evictable
        for block_hash in reversed(held):
            count = refs[block_hash] - 1
            refs[block_hash] = count
            if count == 0:
                evictable[block_hash] = None
                freed += 1
        self.free_blocks += freed
