"""The prefix package: chained hashes, the router's index, its trust correction, session affinity."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from hetroute.prefix.hashing import (
    ROUTER_CHUNK_CHARS,
    segment_block_hashes,
    text_chunk_hashes,
    token_block_hashes,
)
from hetroute.prefix.index import FEW_BITS, MASK_ROWS_KEPT, PrefixIndex
from hetroute.prefix.sessions import SessionTable
from hetroute.prefix.trust import MIN_PREDICTED_TOKENS, TRUST_FLOOR, CacheTrust
from hetroute.types import EngineMetrics


def test_hashes_chain_over_full_blocks_only() -> None:
    ids = list(range(40))
    full = token_block_hashes(ids, 16)
    assert len(full) == 2  # 40 tokens: two full blocks, the partial third is never cached
    # Same first block, different second: the first hash agrees, the second does not.
    other = token_block_hashes(ids[:16] + [999] * 16, 16)
    assert other[0] == full[0] and other[1] != full[1]
    # A block's hash depends on everything before it (chained): same second block, other first.
    shifted = token_block_hashes([7] * 16 + ids[16:32], 16)
    assert shifted[1] != full[1]


def test_segment_hashes_see_only_the_token_sequence() -> None:
    a = segment_block_hashes([(1, 100), (2, 60)], 16)
    b = segment_block_hashes([(1, 100), (3, 60)], 16)
    assert len(a) == 10
    shared = 100 // 16  # blocks wholly inside segment 1
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    assert segment_block_hashes([(5, 15)], 16) == ()


def test_text_chunks_share_exactly_the_common_prefix() -> None:
    head = "s" * (3 * ROUTER_CHUNK_CHARS)
    x = text_chunk_hashes(head + "x" * 600)
    y = text_chunk_hashes(head + "y" * 600)
    assert x[:3] == y[:3] and x[3] != y[3]
    assert text_chunk_hashes("short") == ()


def test_text_chunk_hashes_are_the_same_in_every_process() -> None:
    """Workers, replicas and restarts must name a prompt head alike (``session_hash``'s ring needs it),
    although Python salts ``str`` hashes per process; JSON's lone surrogates hash too."""
    text = "sys: be brief. \ud800 é " * 60
    code = f"from hetroute.prefix.hashing import text_chunk_hashes as h; print(list(h({text!r})))"
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout.strip())
    assert seen == {str(list(text_chunk_hashes(text)))}
    assert len(text_chunk_hashes(text)) == len(text) // ROUTER_CHUNK_CHARS


def test_index_matches_the_longest_held_prefix_per_backend() -> None:
    idx = PrefixIndex([math.nan] * 3)
    chain = text_chunk_hashes("a" * ROUTER_CHUNK_CHARS * 8)
    fork = chain[:3] + text_chunk_hashes("b" * ROUTER_CHUNK_CHARS * 8)[3:]
    idx.insert(0, chain, now_s=0.0)
    idx.insert(2, chain[:5], now_s=0.0)
    assert idx.matched_chunks(chain, 1.0).tolist() == [8, 0, 5]
    assert idx.matched_chunks(fork, 1.0).tolist() == [3, 0, 3]
    assert idx.total_chunks() == 8
    # In tokens, clipped to the prompt's own cap as the walk writes them; None when no backend holds
    # the first chunk (or there is no chunk), which the router reads as "no prefix term".
    held = idx.matched_tokens(chain, 1.0, 64.0, 400.0)
    assert held is not None and held.tolist() == [400.0, 0.0, 320.0]
    held = idx.matched_tokens(fork, 1.0, 64.0, 400.0)
    assert held is not None and held.tolist() == [192.0, 0.0, 192.0]
    other = text_chunk_hashes("z" * ROUTER_CHUNK_CHARS * 4)
    assert idx.matched_tokens(other, 1.0, 64.0, 400.0) is None
    assert idx.matched_tokens(chain[:0], 1.0, 64.0, 400.0) is None
    assert idx.matched_chunks(other, 1.0).tolist() == [0, 0, 0]


def test_index_matches_on_many_holders_as_on_few() -> None:
    """A prefix held by more backends than ``FEW_BITS`` is filled in through the holders' kept row array:
    the same answer as one backend at a time, at every depth, on 70 backends (a mask wider than 64 bits),
    when the rows are first built and when they are reused."""
    n = 70
    idx = PrefixIndex([math.nan] * n)
    chain = text_chunk_hashes("c" * ROUTER_CHUNK_CHARS * 8)
    rng = random.Random(5)
    depths = [rng.choice([0, 1, 3, 3, 8, 8]) for _ in range(n)]
    for b, depth in enumerate(depths):
        if depth:
            idx.insert(b, chain[:depth], now_s=0.0)
    assert sum(d == 8 for d in depths) > FEW_BITS and sum(d == 3 for d in depths) > FEW_BITS
    for _ in range(2):  # rows built, then rows kept
        assert idx.matched_chunks(chain, 1.0).tolist() == depths
        assert idx.matched_chunks(chain[:2], 1.0).tolist() == [min(d, 2) for d in depths]


def _leading_runs(idx: PrefixIndex, chain: tuple[int, ...], now_s: float) -> list[float]:
    """The definition the lookup bisects for: per backend, how many leading chunks of ``chain`` it
    holds, one chunk at a time (after the same TTL sweep the lookup makes)."""
    idx.matched_chunks(chain[:0], now_s)  # no chunk: only the sweep runs
    out = []
    for b in range(idx.backends):
        run = 0
        while run < len(chain) and idx._holders.get(chain[run], 0) >> b & 1:
            run += 1
        out.append(float(run))
    return out


def test_index_bisection_equals_the_leading_run_of_every_backend() -> None:
    """Random dispatches of forks of a few chains over 9 backends with small capacities, TTL expiry and
    forgotten backends: the bisecting lookup names each backend's leading run of held chunks, as a
    chunk-by-chunk walk does (insertion tail first and eviction oldest first keep every backend's
    chunks of a chain a leading run of it)."""
    rng = random.Random(21)
    idx = PrefixIndex([float(rng.choice([6, 12, 40])) for _ in range(9)], ttl_s=30.0)
    roots = [text_chunk_hashes(str(k) * ROUTER_CHUNK_CHARS * 24) for k in range(4)]
    now = 0.0
    for step in range(600):
        now += rng.random()
        root = rng.choice(roots)
        cut = rng.randrange(1, len(root) + 1)
        chain = root[:cut] + text_chunk_hashes(f"{step:05d}" * ROUTER_CHUNK_CHARS)[: rng.randrange(0, 6)]
        if rng.random() < 0.02:
            idx.forget_backend(rng.randrange(9))
        looked_up = rng.choice(roots)[: rng.randrange(1, 25)]
        held = idx.matched_tokens(looked_up, now, 1.0, math.inf)
        expected = _leading_runs(idx, looked_up, now)
        assert (held.tolist() if held is not None else [0.0] * 9) == expected
        idx.insert(rng.randrange(9), chain, now)
    assert idx.chunks(0) > 0


def test_index_lookup_of_a_chain_cached_whole_costs_two_dictionary_reads() -> None:
    """The bisection reads the holders of the first and the last chunk when every holder has the whole
    chain, and O(log chunks) reads per place where holders drop out, where a chunk-by-chunk walk reads
    every matched chunk (a 512-chunk, 128 K-character prompt: 2 reads against 513)."""

    class Counting(dict[int, int]):
        reads = 0

        def get(self, key: int, default: int = 0) -> int:  # type: ignore[override]
            Counting.reads += 1
            return super().get(key, default)

    idx = PrefixIndex([math.nan] * 4)
    chain = text_chunk_hashes("w" * ROUTER_CHUNK_CHARS * 512)
    idx.insert(1, chain, now_s=0.0)
    idx.insert(3, chain[:300], now_s=0.0)
    idx._holders = Counting(idx._holders)
    assert idx.matched_chunks(chain[:300], 1.0).tolist() == [0, 300, 0, 300]
    assert Counting.reads == 2
    Counting.reads = 0
    assert idx.matched_chunks(chain, 1.0).tolist() == [0, 512, 0, 300]
    assert Counting.reads <= 2 + 2 * (math.ceil(math.log2(512)) + 1)


def test_index_rows_stay_right_past_the_kept_masks_bound() -> None:
    """More distinct large holder masks than ``MASK_ROWS_KEPT``: the kept rows are dropped and rebuilt,
    and every lookup still names exactly its holders."""
    n = 40
    idx = PrefixIndex([math.nan] * n)
    rng = random.Random(11)
    chains = []
    for k in range(MASK_ROWS_KEPT + 200):
        chain = text_chunk_hashes(f"{k:08d}" * (ROUTER_CHUNK_CHARS // 8 + 1))[:1]
        holders = sorted(rng.sample(range(n), FEW_BITS + 1 + k % 20))
        for b in holders:
            idx.insert(b, chain, now_s=0.0)
        chains.append((chain, holders))
    for chain, holders in chains + chains[:50]:
        assert idx.matched_chunks(chain, 1.0).tolist() == [1.0 if b in holders else 0.0 for b in range(n)]


def test_index_evicts_least_recent_and_a_prompts_tail_before_its_head() -> None:
    idx = PrefixIndex([6.0])
    old = text_chunk_hashes("o" * ROUTER_CHUNK_CHARS * 4)
    new = text_chunk_hashes("n" * ROUTER_CHUNK_CHARS * 4)
    idx.insert(0, old, now_s=0.0)
    idx.insert(0, new, now_s=1.0)  # 8 chunks > capacity 6: two of the old prompt go, its tail first
    assert idx.chunks(0) == 6
    assert idx.matched_chunks(old, 2.0).tolist() == [2]
    assert idx.matched_chunks(new, 2.0).tolist() == [4]


def test_index_ttl_forgets_chunks_nobody_reused() -> None:
    idx = PrefixIndex([math.nan, math.nan], ttl_s=10.0)
    chain = text_chunk_hashes("t" * ROUTER_CHUNK_CHARS * 4)
    idx.insert(0, chain, now_s=0.0)
    idx.insert(1, chain[:2], now_s=0.0)
    idx.insert(1, chain[:2], now_s=8.0)  # the shared head is reused on backend 1
    assert idx.matched_chunks(chain, 5.0).tolist() == [4, 2]
    assert idx.matched_chunks(chain, 15.0).tolist() == [0, 2]


def test_index_global_bound_and_forgetting_a_backend() -> None:
    idx = PrefixIndex([math.nan, math.nan], max_chunks=10)
    for k in range(6):
        idx.insert(k % 2, text_chunk_hashes(str(k) * ROUTER_CHUNK_CHARS * 3), now_s=float(k))
    assert idx.total_chunks() <= 10
    latest = text_chunk_hashes("5" * ROUTER_CHUNK_CHARS * 3)
    assert idx.matched_chunks(latest, 6.0).tolist() == [0, 3]
    idx.forget_backend(1)
    assert idx.chunks(1) == 0 and idx.matched_chunks(latest, 6.0).tolist() == [0, 0]


def test_index_memory_at_100k_distinct_prefixes_is_bounded() -> None:
    """100,000 distinct 4-chunk prompts over 8 backends: the figure docs/prefix.md quotes."""
    rng = np.random.default_rng(0)
    tracemalloc.start()
    idx = PrefixIndex([math.nan] * 8)
    for k in range(100_000):
        chain = tuple(int(h) for h in rng.integers(1, 2**62, size=4))
        idx.insert(k % 8, chain, now_s=k * 1e-3)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert idx.total_chunks() == 400_000
    assert used < 160 * 2**20, f"{used / 2**20:.0f} MiB for 400k chunks"
    assert idx.memory_bytes() < 160 * 2**20


def _metrics(hits: float) -> EngineMetrics:
    return EngineMetrics(scraped_at_s=0.0, prefix_cache_hits_total=hits, prefix_cache_queries_total=hits * 2)


def test_trust_falls_when_the_engine_hits_less_than_predicted_and_resets_on_restart() -> None:
    trust = CacheTrust(2)
    assert trust.scraped(0, _metrics(0.0)) is False  # baseline
    for k in range(1, 20):
        trust.predicted(0, 4 * MIN_PREDICTED_TOKENS)
        trust.scraped(0, _metrics(k * MIN_PREDICTED_TOKENS))  # the engine hits a quarter
    assert trust.trust[0] == pytest.approx(0.25, abs=0.01)
    assert trust.trust[1] == 1.0  # never scraped: full trust
    trust.predicted(0, MIN_PREDICTED_TOKENS / 4)
    assert trust.scraped(0, _metrics(1.0)) is True  # the counter went down: a restart
    trust.predicted(0, 10 * MIN_PREDICTED_TOKENS)
    for _ in range(30):
        trust.scraped(0, _metrics(1.0))  # same value, new object: no hits for a big prediction
        trust.predicted(0, 10 * MIN_PREDICTED_TOKENS)
    assert trust.trust[0] == pytest.approx(TRUST_FLOOR)
    with pytest.raises(ValueError):
        trust.trust[0] = 1.0  # read-only view


def test_trust_stays_full_when_an_exact_index_sees_its_hits_late_or_in_small_windows() -> None:
    # The engine counts a hit when it schedules the request, the router predicts it at dispatch: on a
    # busy backend hits lag their predictions, on a lightly used one a window's prediction is small.
    # Neither is an index that over-estimates, so an exact index keeps full trust.
    trust = CacheTrust(2)
    for b in (0, 1):
        trust.scraped(b, _metrics(0.0))  # baselines
    small = MIN_PREDICTED_TOKENS * 0.6
    hits = [0.0, 0.0]
    for k in range(40):
        trust.predicted(0, small)  # one short cached prefix per window, hit in the next window
        if k > 0:
            hits[0] += small
        trust.scraped(0, _metrics(hits[0]))
        trust.predicted(1, 1000.0)  # busy: the hits of a window arrive half in it, half in the next
        hits[1] += 500.0 if k % 2 == 0 else 1500.0
        trust.scraped(1, _metrics(hits[1]))
    # (the first window reads its lag as a miss; 20 windows later that has faded)
    assert trust.trust[0] == pytest.approx(1.0, abs=1e-3)
    assert trust.trust[1] == pytest.approx(1.0, abs=1e-3)


def test_late_hits_carry_over_at_most_one_window() -> None:
    trust = CacheTrust(1)
    trust.scraped(0, _metrics(0.0))
    trust.predicted(0, 1000.0)
    trust.scraped(0, _metrics(50_000.0))  # hits from traffic the router did not send (another replica)
    assert trust.trust[0] == 1.0
    for k in range(1, 6):  # then nothing the router predicts is hit: one window's carry, then decline
        trust.predicted(0, 1000.0)
        trust.scraped(0, _metrics(50_000.0 + 0.0 * k))
    assert trust.trust[0] == pytest.approx(0.7**4, abs=1e-6)


def test_sessions_are_bounded_and_expire() -> None:
    table = SessionTable(max_sessions=2, ttl_s=60.0)
    table.record("a", 1, 0.0)
    table.record("b", 0, 0.0)
    table.record("a", 2, 1.0)
    table.record("c", 1, 2.0)  # evicts b, the least recently used
    assert (table.backend_of("a", 3.0), table.backend_of("b", 3.0), table.backend_of("c", 3.0)) == (2, -1, 1)
    assert table.backend_of("a", 100.0) == -1 and table.backend_of("", 0.0) == -1
    assert len(table) == 2
