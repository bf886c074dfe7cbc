"""Engine model with automatic prefix caching: hits skip prefill, shared blocks count once, preemption and
eviction keep the accounting exact, and requests without block hashes are scheduled exactly as before."""

from __future__ import annotations

import random

import pytest

from hetroute.prefix.hashing import token_block_hashes
from hetroute.sim.engine_model import EngineModel, StepOutcome
from tests.unit.test_engine_model import config, drive


def prompt(seed: int, tokens: int, shared: int = 0) -> tuple[int, list[int]]:
    """``tokens`` prompt ids whose first ``shared`` ids are common to every seed."""
    ids = list(range(shared)) + [seed * 100_000 + i for i in range(tokens - shared)]
    return tokens, ids


def submit(engine: EngineModel, rid: str, ids: list[int], output: int, now_s: float = 0.0) -> None:
    engine.submit(rid, len(ids), output, now_s, block_hashes=token_block_hashes(ids, engine.block_size))


def first_token(engine: EngineModel, now_s: float) -> tuple[float, list[StepOutcome]]:
    """Step until some request emits its first token; (its time, the steps taken)."""
    outcomes = []
    while True:
        out = engine.step(now_s)
        now_s += out.duration_s
        outcomes.append(out)
        if any(ev.first for ev in out.emitted):
            return now_s, outcomes


@pytest.mark.parametrize("engine_kind", ["vllm", "tgi"])
def test_a_repeated_prompt_skips_its_cached_prefill(engine_kind: str) -> None:
    engine = EngineModel(config(engine=engine_kind))
    _, ids = prompt(1, 2000)
    submit(engine, "a", ids, 4)
    ttft_a, steps_a = first_token(engine, 0.0)
    end = drive(engine).end_s + ttft_a
    submit(engine, "b", ids, 4, end)
    ttft_b, steps_b = first_token(engine, end)
    ttft_b -= end
    assert steps_a[0].scheduled_tokens == 2000
    # vLLM hits at most tokens - 1 in whole blocks: 124 of 125 blocks, the last block is recomputed;
    # TGI hits all 125 blocks and recomputes one token
    hit = 1984 if engine_kind == "vllm" else 2000
    assert steps_b[0].scheduled_tokens == 2000 - min(hit, 1999)
    assert ttft_b < ttft_a / 5
    stats = engine.stats()
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (4000, hit)
    assert stats.prompt_tokens_total == 4000  # a hit prompt still counts whole, as in vLLM


def test_a_shared_prefix_is_hit_by_a_request_with_another_suffix() -> None:
    engine = EngineModel(config())
    submit(engine, "a", prompt(1, 1000, shared=600)[1], 3)
    drive(engine)
    submit(engine, "b", prompt(2, 900, shared=600)[1], 3)
    assert engine.step(0.0).scheduled_tokens == 900 - 592  # 37 shared full blocks of 16
    assert engine.stats().prefix_cache_hits_total == 592


def test_shared_blocks_count_once_in_kv_usage() -> None:
    engine = EngineModel(config(max_num_seqs=8))
    _, ids = prompt(1, 320)  # 20 full blocks
    submit(engine, "a", ids, 50)
    engine.step(0.0)  # a's prefill: 20 blocks, all cached
    assert engine.stats().used_blocks == 20
    submit(engine, "b", ids, 50)
    engine.step(0.0)  # a decodes (+1 block); b hits 19 blocks and computes its last block itself
    assert engine.stats().used_blocks == 21 + 1
    off = EngineModel(config(max_num_seqs=8, enable_prefix_caching=False))
    submit(off, "a", ids, 50)
    off.step(0.0)
    submit(off, "b", ids, 50)
    off.step(0.0)
    assert off.stats().used_blocks == 21 + 20
    drive(engine)
    assert engine.stats().used_blocks == 0 and engine.pool.evictable_blocks == 20


def test_evictable_blocks_count_as_free_and_are_evicted_for_new_requests() -> None:
    engine = EngineModel(config(num_gpu_blocks_override=64, max_model_len=1024))
    for i in range(3):  # 3 x 20 cached blocks, all evictable once finished
        submit(engine, f"warm{i}", prompt(i, 320)[1], 1)
    drive(engine)
    assert engine.stats().used_blocks == 0 and engine.pool.evictable_blocks == 60
    submit(engine, "big", prompt(9, 900)[1], 2)  # needs 57 blocks: 4 fresh + 53 evicted
    engine.step(0.0)
    assert engine.stats().used_blocks == 57 and engine.pool.evictions_total == 53
    # the oldest chains go first, each from its tail: warm2 keeps its head blocks
    assert engine.pool.lookup(token_block_hashes(prompt(2, 320)[1], 16), 20) == (7, 7)
    assert engine.pool.lookup(token_block_hashes(prompt(0, 320)[1], 16), 20) == (0, 0)


def test_tgi_caches_a_prompt_only_when_its_request_leaves_the_batch() -> None:
    engine = EngineModel(config(engine="tgi"))
    _, ids = prompt(1, 640)
    submit(engine, "a", ids, 20)
    engine.step(0.0)
    submit(engine, "b", ids, 20)  # a is still decoding: nothing is cached yet
    assert engine.step(0.0).scheduled_tokens == 640 and engine.stats().prefix_cache_hits_total == 0
    drive(engine)
    assert engine.stats().used_blocks == 0 and engine.pool.evictable_blocks == 40  # b's copies: not cached
    submit(engine, "c", ids, 20)
    assert engine.step(0.0).scheduled_tokens == 1


def test_preempted_requests_release_their_references_and_look_up_again() -> None:
    engine = EngineModel(config(num_gpu_blocks_override=48, max_model_len=512, max_num_seqs=8))
    want = {}
    for i in range(6):
        rid = f"r{i}"
        want[rid] = 200
        submit(engine, rid, prompt(i, 160, shared=128)[1], 200)
    trace = drive(engine)
    preempted = {rid for out in trace.outcomes for rid in out.preempted}
    assert preempted and trace.tokens == want
    pool = engine.pool
    assert pool.preempted_queries_tokens > 0 and pool.preempted_hits_tokens > 0  # resumptions hit again
    assert engine.stats().used_blocks == 0 and pool.evictable_blocks == pool.cached_blocks


@pytest.mark.parametrize("engine_kind", ["vllm", "tgi"])
def test_random_workload_with_shared_prefixes_keeps_blocks_within_capacity(engine_kind: str) -> None:
    rng = random.Random(21)
    engine = EngineModel(
        config(
            engine=engine_kind,
            num_gpu_blocks_override=120,
            max_model_len=1024,
            max_num_seqs=12,
            max_num_batched_tokens=256,
        )
    )
    want: dict[str, int] = {}
    now = 0.0
    for i in range(160):
        tokens = rng.randint(20, 700)
        _, ids = prompt(i, tokens, shared=min(tokens, rng.choice((0, 64, 300, 500))))
        want[f"r{i}"] = rng.randint(1, 1024 - tokens)
        submit(engine, f"r{i}", ids, want[f"r{i}"], now)
        for _ in range(rng.randint(0, 6)):
            if engine.has_work():
                out = engine.step(now)
                now += out.duration_s
                assert engine.stats().used_blocks <= engine.num_gpu_blocks
    trace = drive(engine)  # checks used blocks ≤ num_gpu_blocks after every step
    stats = engine.stats()
    assert stats.requests_finished_total == 160 and stats.generation_tokens_total == sum(want.values())
    assert (stats.num_preemptions_total > 0) == (engine_kind == "vllm") and stats.prefix_cache_hits_total > 0
    assert stats.used_blocks == 0 and engine.pool.evictable_blocks == engine.pool.cached_blocks
    assert set(trace.tokens) <= set(want)


def _schedule(engine: EngineModel, with_hashes: bool) -> list[tuple[object, ...]]:
    rng = random.Random(4)
    for i in range(40):
        _, ids = prompt(i, rng.randint(1, 600), shared=0)
        hashes = token_block_hashes(ids, 16) if with_hashes else ()
        engine.submit(f"r{i}", len(ids), rng.randint(1, 300), 0.0, block_hashes=hashes)
    return [(o.duration_s, o.emitted, o.finished, o.preempted) for o in drive(engine).outcomes]


def test_requests_without_hashes_and_caching_off_schedule_as_before() -> None:
    small = {"num_gpu_blocks_override": 200, "max_model_len": 2048, "max_num_seqs": 32}
    base = _schedule(EngineModel(config(**small)), with_hashes=False)
    assert _schedule(EngineModel(config(**small, enable_prefix_caching=False)), with_hashes=False) == base
    assert _schedule(EngineModel(config(**small, enable_prefix_caching=False)), with_hashes=True) == base
    # unique prompts never hit unless preempted (a resumed request hits its own prompt), so without
    # preemption their hashes change nothing but the counters
    on = EngineModel(config())
    assert _schedule(on, with_hashes=True) == _schedule(EngineModel(config()), with_hashes=False)
    assert on.stats().prefix_cache_hits_total == 0 and on.stats().prefix_cache_queries_total > 0
    assert on.stats().num_preemptions_total == 0
    off = EngineModel(config(**small, enable_prefix_caching=False))
    _schedule(off, with_hashes=True)
    assert off.stats().prefix_cache_queries_total == 0  # vLLM records nothing with caching off


def test_block_hashes_beyond_the_prompt_are_refused() -> None:
    engine = EngineModel(config())
    with pytest.raises(ValueError, match="3 block hashes for a prompt of 40 tokens"):
        engine.submit("a", 40, 1, 0.0, block_hashes=(1, 2, 3))
    with pytest.raises(Exception, match="enable_prefix_caching: expected true or false"):
        config(enable_prefix_caching="yes")


def test_abort_releases_shared_blocks() -> None:
    engine = EngineModel(config())
    _, ids = prompt(1, 480)
    submit(engine, "a", ids, 100)
    engine.step(0.0)
    submit(engine, "b", ids, 100)
    engine.step(0.0)
    assert engine.pool.ref_count(token_block_hashes(ids, 16)[0]) == 2
    assert engine.abort("a") and engine.abort("b")
    assert engine.stats().used_blocks == 0 and engine.pool.evictable_blocks == 30
