"""The router's approximate prefix index: which backend probably holds which prompt chunks in its KV cache.

The engines' caches cannot be read, so the router keeps its own guess from what it sent where (the
approach of SGLang's approximate radix tree and llm-d's approximate prefix scorer), without a
tokenizer: a prompt is a chain of chunk hashes (``hetroute.prefix.hashing``), and after a dispatch the
chosen backend is assumed to hold every full chunk of that prompt.

Structure (memory and time bounded):

- ``_holders``: chunk hash → bit mask of the backends assumed to hold it (one dict entry per distinct
  chunk, whatever the number of backends).
- ``_lru[b]``: per-backend recency order of its chunks (an ``OrderedDict``: O(1) touch and eviction;
  a plain dict degrades when its front is popped repeatedly).
  Each backend holds at most ``capacity_chunks[b]`` chunks: its KV capacity in chunks, since an engine
  cannot cache more than its KV cache holds. Beyond it the least recently used chunk is dropped, tail
  of a prompt before its head (a chain is touched tail first), as vLLM evicts.
- Entries older than ``ttl_s`` are dropped by a sweep at most every ``ttl_s / 10`` (an engine evicts
  what nobody reused).
- ``max_chunks`` bounds the whole index: past it, the globally oldest backend's LRU chunk goes.

Lookup (:meth:`matched_tokens`, :meth:`matched_chunks`) bisects the request's chain for where the
backends' runs of held chunks end (each backend holds a leading run of a chain: insertion is tail
first and eviction oldest first), intersecting masks, so it costs O(log chunks) dictionary lookups per
distinct run end, not O(backends × chunks) nor one per matched chunk.

The index is a guess; :class:`~hetroute.prefix.trust.CacheTrust` corrects it with the engines' own hit
counters.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hetroute.types import FloatArray, IntArray

DEFAULT_MAX_CHUNKS = 2_000_000
"""Whole-index bound: about 2 M chunks × 64 tokens = 128 M tokens of KV, far beyond any fleet's cache
(a 80 GB GPU holds about 0.5 M tokens of an 8 B model); memory stays under ~400 MB at the bound."""
DEFAULT_TTL_S = 600.0
FEW_BITS = 12
"""Up to this many backends in a bit mask, :meth:`PrefixIndex._fill` sets them one by one; beyond, it
indexes with the mask's row array (measured on 64 backends: 0.25 µs for 2 one by one; for 16, 5.5 µs
unpacking the mask each time against 0.45 µs with the row array kept)."""
MASK_ROWS_KEPT = 1024
"""Row arrays of large masks kept by :meth:`PrefixIndex._fill` (the same few sets of backends hold the
hot prefixes, so a mask recurs; past this many, the kept rows are dropped and built again as needed:
at most 1,024 × 8 B × backends, 4 MiB at 512 backends)."""
SWEEP_FRACTION = 0.1
"""Expired entries are swept when a lookup comes ``SWEEP_FRACTION · ttl_s`` after the last sweep, so an
entry is matched at most ``1.1 · ttl_s`` after its last use."""


class PrefixIndex:
    """Per-backend approximate prefix cache contents; see the module docstring.

    Not thread-safe (one event loop). ``now_s`` comes from the caller's clock (house style §7).
    """

    __slots__ = (
        "_holders", "_lru", "_capacity", "_ttl_s", "_max_chunks", "_n", "_all", "_count", "_last_sweep_s",
        "_rows",
    )  # fmt: skip

    def __init__(
        self,
        capacity_chunks: Sequence[float],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be ≥ 1, got {max_chunks}")
        self._n = len(capacity_chunks)
        self._holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(self._n)]
        self._capacity = [max(1, int(c)) if c == c else max_chunks for c in capacity_chunks]
        self._ttl_s = ttl_s
        self._max_chunks = max_chunks
        self._all = (1 << self._n) - 1
        self._count = 0
        self._last_sweep_s = -float("inf")
        self._rows: dict[int, IntArray] = {}  # large mask → the backends it holds (_fill)

    @property
    def backends(self) -> int:
        return self._n

    def set_capacity(self, backend: int, chunks: float) -> None:
        """Bound backend ``backend`` to ``chunks`` chunks (its KV capacity became known); trims now."""
        self._capacity[backend] = max(1, int(chunks)) if chunks == chunks else self._max_chunks
        self._trim(backend)

    def chunks(self, backend: int) -> int:
        """Chunks currently assumed cached on ``backend``."""
        return len(self._lru[backend])

    def total_chunks(self) -> int:
        """Distinct chunk hashes in the index."""
        return len(self._holders)

    def matched_chunks(self, hashes: Sequence[int], now_s: float) -> FloatArray:
        """Leading chunks of ``hashes`` each backend is assumed to hold (n floats; expired ones miss)."""
        out = self.matched_tokens(hashes, now_s, 1.0, math.inf)
        return np.zeros(self._n, dtype=np.float64) if out is None else out

    def matched_tokens(
        self, hashes: Sequence[int], now_s: float, tokens_per_chunk: float, max_tokens: float
    ) -> FloatArray | None:
        """Per backend, ``min(leading chunks of hashes it holds · tokens_per_chunk, max_tokens)``, or
        None when no backend holds the first chunk.

        Each backend's chunks of one chain form a leading run of it: a dispatch inserts a chain tail
        first, so its head is always the more recent, and every eviction (LRU, TTL, capacity, the global
        bound) takes a backend's oldest chunk first. So whether all of a set of backends hold chunk k is
        true up to some k and false after, and the end of each run is found by bisection: O(log
        chunks) lookups per distinct run end instead of one per chunk (a chain cached whole is one
        lookup past the first). The values are written as each run end is found, with no array
        arithmetic after it."""
        if now_s - self._last_sweep_s > self._ttl_s * SWEEP_FRACTION:
            self._sweep(now_s)
        holders = self._holders
        if not hashes:
            return None
        mask = holders.get(hashes[0], 0)
        if not mask:
            return None
        out: FloatArray = np.zeros(self._n, dtype=np.float64)
        n = len(hashes)
        depth = 1  # every backend in mask holds the first `depth` chunks
        while True:
            # the largest e in [depth, n] such that every backend in mask holds chunk e − 1
            if holders.get(hashes[n - 1], 0) & mask == mask:
                depth = n
            else:
                low, high = depth, n - 1
                while low < high:
                    mid = (low + high + 1) // 2
                    if holders.get(hashes[mid - 1], 0) & mask == mask:
                        low = mid
                    else:
                        high = mid - 1
                depth = low
            if depth == n:
                self._fill(out, mask, min(n * tokens_per_chunk, max_tokens))
                return out
            held = holders.get(hashes[depth], 0) & mask  # some of mask lack chunk `depth`
            self._fill(out, mask & ~held, min(depth * tokens_per_chunk, max_tokens))
            if not held:
                return out
            mask = held
            depth += 1

    def _fill(self, out: FloatArray, bits: int, value: float) -> None:
        """``out[i] = value`` for every bit i set in ``bits`` (bit i is backend i; ``out`` has a slot per
        bit): one by one for a few bits, else through the mask's kept row array (``MASK_ROWS_KEPT``)."""
        if bits.bit_count() <= FEW_BITS:
            while bits:
                low = bits & -bits
                out[low.bit_length() - 1] = value
                bits ^= low
            return
        rows = self._rows.get(bits)
        if rows is None:
            if len(self._rows) >= MASK_ROWS_KEPT:
                self._rows.clear()
            raw = np.frombuffer(bits.to_bytes((bits.bit_length() + 7) // 8, "little"), dtype=np.uint8)
            rows = np.flatnonzero(np.unpackbits(raw, bitorder="little"))
            rows.flags.writeable = False
            self._rows[bits] = rows
        out[rows] = value

    def _sweep(self, now_s: float) -> None:
        """Drop every entry older than the TTL (each backend's oldest first: O(backends + expired))."""
        self._last_sweep_s = now_s
        cutoff = now_s - self._ttl_s
        for b, lru in enumerate(self._lru):
            while lru and next(iter(lru.values())) < cutoff:
                self._drop_oldest(b)

    def insert(self, backend: int, hashes: Sequence[int], now_s: float) -> None:
        """Record that ``backend`` now holds every chunk of ``hashes`` (after a dispatch to it)."""
        if not hashes:
            return
        lru = self._lru[backend]
        bit = 1 << backend
        holders = self._holders
        added = 0
        move = lru.move_to_end
        for h in reversed(hashes):  # tail first: the head ends most recent, so it is evicted last
            if h in lru:
                lru[h] = now_s
                move(h)
            else:
                lru[h] = now_s
                holders[h] = holders.get(h, 0) | bit
                added += 1
        self._count += added
        self._trim(backend)
        if len(holders) > self._max_chunks:
            self._trim_global()

    def set_slot(self, backend: int) -> None:
        """Slot ``backend`` holds a new backend with an empty cache (one past the last: grow)."""
        if backend == self._n:
            self._n += 1
            self._lru.append(OrderedDict())
            self._capacity.append(self._max_chunks)
            self._all = (1 << self._n) - 1
        else:
            self.forget_backend(backend)
            self._capacity[backend] = self._max_chunks

    def forget_backend(self, backend: int) -> None:
        """Drop everything ``backend`` was assumed to hold (it restarted, or its cache was reset)."""
        bit = 1 << backend
        holders = self._holders
        for h in self._lru[backend]:
            left = holders.get(h, 0) & ~bit
            if left:
                holders[h] = left
            else:
                holders.pop(h, None)
        self._count -= len(self._lru[backend])
        self._lru[backend] = OrderedDict()

    def _drop_oldest(self, backend: int) -> None:
        h, _ = self._lru[backend].popitem(last=False)
        self._count -= 1
        left = self._holders.get(h, 0) & ~(1 << backend)
        if left:
            self._holders[h] = left
        else:
            self._holders.pop(h, None)

    def _trim(self, backend: int) -> None:
        lru = self._lru[backend]
        cap = self._capacity[backend]
        while len(lru) > cap:
            self._drop_oldest(backend)

    def _trim_global(self) -> None:
        while len(self._holders) > self._max_chunks:
            oldest = min(
                (b for b in range(self._n) if self._lru[b]),
                key=lambda b: next(iter(self._lru[b].values())),
            )
            self._drop_oldest(oldest)

    def memory_bytes(self) -> int:
        """Approximate bytes held by the index's containers (dicts and their int keys and values)."""
        total = sys.getsizeof(self._holders) + sum(sys.getsizeof(d) for d in self._lru)
        # Keys are shared ints (~32 B each), masks and timestamps ~28-32 B each.
        # kept rows (_fill): their data plus ~112 B of ndarray header each
        rows = sys.getsizeof(self._rows) + sum(r.nbytes + 112 for r in self._rows.values())
        return total + 32 * len(self._holders) * 2 + 24 * self._count + rows
