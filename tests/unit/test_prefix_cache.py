"""BlockPool: hits, reference counts, tail-first LRU eviction, memory pressure and the token counters."""

from __future__ import annotations

import random

import pytest

from hetroute.prefix.hashing import token_block_hashes
from hetroute.sim.prefix_cache import BlockPool

A = token_block_hashes(list(range(64)), 16)  # 4 blocks
B = token_block_hashes(list(range(1000, 1048)), 16)  # 3 blocks, another prompt


def hold(pool: BlockPool, hashes: tuple[int, ...], private: int = 0) -> list[int]:
    """A request that computed ``hashes`` itself (allocate, then cache) plus ``private`` more blocks."""
    pool.allocate(len(hashes) + private)
    held: list[int] = []
    pool.register(hashes, 0, len(hashes), held)
    return held


def test_lookup_returns_the_leading_cached_run_and_its_evictable_part() -> None:
    pool = BlockPool(16)
    assert pool.lookup(A, 10) == (0, 0)
    held = hold(pool, A[:3], private=1)
    assert held == list(A[:3]) and pool.cached_blocks == 3 and pool.used_blocks == 4
    assert pool.lookup(A, 10) == (3, 0)  # A[3] is not cached: the run stops there
    assert pool.lookup(A, 2) == (2, 0)  # capped by max_blocks
    assert pool.lookup(B, 10) == (0, 0)
    # the same tokens without A's first block name other blocks (the hashes are chained)
    assert pool.lookup(token_block_hashes(list(range(16, 64)), 16), 10) == (0, 0)
    pool.release(held, 1)
    assert pool.lookup(A, 10) == (3, 3)  # still cached, now evictable
    assert pool.used_blocks == 0 and pool.free_blocks == 16


def test_reference_counts_follow_acquire_and_release() -> None:
    pool = BlockPool(8)
    first = hold(pool, A[:2])
    assert [pool.ref_count(h) for h in A[:2]] == [1, 1]
    pool.acquire(A[:2])  # a second request hits both
    assert [pool.ref_count(h) for h in A[:2]] == [2, 2] and pool.used_blocks == 2  # shared: counted once
    pool.release(first, 0)
    assert [pool.ref_count(h) for h in A[:2]] == [1, 1] and pool.evictable_blocks == 0
    pool.release(list(A[:2]), 0)
    assert [pool.ref_count(h) for h in A[:2]] == [0, 0] and pool.evictable_blocks == 2
    pool.acquire(A[:1])  # a hit on an evictable block takes it out of the free queue
    assert pool.ref_count(A[0]) == 1 and pool.eviction_order() == [A[1]]
    assert pool.free_blocks == 7
    assert pool.ref_count(B[0]) is None
    with pytest.raises(KeyError):
        pool.acquire(B[:1])


def test_freed_chains_are_evicted_tail_first_in_lru_order() -> None:
    pool = BlockPool(7)
    first, second = hold(pool, A), hold(pool, B)
    pool.release(first, 0)
    pool.release(second, 0)
    assert pool.eviction_order() == [A[3], A[2], A[1], A[0], B[2], B[1], B[0]]
    pool.allocate(2)  # no fresh block left: evicts A's tail
    assert pool.evictions_total == 2
    assert pool.lookup(A, 4) == (2, 2) and pool.lookup(B, 3) == (3, 3)
    pool.acquire(A[:2])  # touched blocks are safe from the next evictions
    pool.allocate(3)
    assert pool.lookup(A, 4) == (2, 0) and pool.lookup(B, 3) == (0, 0)
    assert pool.free_blocks == 0 and pool.cached_blocks == 2


def test_fresh_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(10)
    held = hold(pool, A, private=2)  # 4 cached + 2 private (e.g. a partial block and a decode block)
    pool.release(held, 2)
    assert pool.free_blocks == 10 and pool.evictable_blocks == 4
    pool.allocate(6)  # the 6 fresh blocks: nothing evicted
    assert pool.evictions_total == 0 and pool.lookup(A, 4) == (4, 4)
    pool.allocate(1)
    assert pool.evictions_total == 1 and pool.lookup(A, 4) == (3, 3)


def test_allocation_beyond_the_free_blocks_is_refused() -> None:
    pool = BlockPool(4)
    held = hold(pool, A[:3])
    pool.allocate(1)
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, 0 free"):
        pool.allocate(1)
    pool.release(held, 0)
    pool.allocate(3)  # evictable blocks are free under memory pressure
    assert pool.cached_blocks == 0 and pool.used_blocks == 4
    with pytest.raises(ValueError):
        BlockPool(0)


def test_a_block_computed_twice_is_cached_once() -> None:
    pool = BlockPool(8)
    first = hold(pool, A[:2])
    second = hold(pool, A[:3])  # computed the same two blocks at the same time, plus one more
    assert second == [A[2]]  # its copies of A[0], A[1] stay private
    assert pool.used_blocks == 5 and pool.cached_blocks == 3
    pool.release(second, 2)
    assert pool.free_blocks == 6 and pool.eviction_order() == [A[2]]
    pool.release(first, 0)
    assert pool.eviction_order() == [A[2], A[1], A[0]]


def test_counters_are_in_tokens_and_keep_preempted_lookups_apart() -> None:
    pool = BlockPool(4)
    pool.record(100, 64)
    pool.record(50, 0)
    pool.record(80, 48, preempted=True)
    assert (pool.queries_tokens, pool.hits_tokens) == (150, 64)
    assert (pool.preempted_queries_tokens, pool.preempted_hits_tokens) == (80, 48)


def test_random_operations_keep_the_block_accounting_consistent() -> None:
    rng = random.Random(11)
    prompts = [token_block_hashes([p] * 16 + list(range(16 * rng.randint(1, 6))), 16) for p in range(5)]
    pool = BlockPool(24)
    live: list[tuple[list[int], int]] = []
    for _ in range(3000):
        if live and (rng.random() < 0.45 or pool.free_blocks < 8):
            held, private = live.pop(rng.randrange(len(live)))
            pool.release(held, private)
        else:
            hashes = prompts[rng.randrange(len(prompts))]
            hit, evictable = pool.lookup(hashes, len(hashes))
            new, private = len(hashes) - hit, rng.randint(0, 2)
            if new + private + evictable > pool.free_blocks:
                continue
            pool.acquire(hashes[:hit])
            held = list(hashes[:hit])
            pool.allocate(new + private)
            pool.register(hashes, hit, len(hashes), held)
            live.append((held, private + new - (len(held) - hit)))
        referenced = {h for held, _ in live for h in held}
        assert pool.used_blocks == len(referenced) + sum(private for _, private in live)
        assert pool.free_blocks == pool.num_blocks - pool.used_blocks >= 0
        assert pool.evictable_blocks == pool.cached_blocks - len(referenced)
    for held, private in live:
        pool.release(held, private)
    assert pool.free_blocks == 24 and pool.evictable_blocks == pool.cached_blocks
