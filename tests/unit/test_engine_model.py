"""Engine model invariants: FCFS, limits, KV blocks, preemption by recompute, abort, chunked prefill, TGI."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog
from hetroute.errors import ConfigError
from hetroute.sim.engine_model import EngineConfig, EngineModel, PromptTooLong, StepOutcome

GPUS = load_gpu_catalog()
MODELS = load_model_catalog()


def config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"gpu": GPUS["A100-80GB"], "model": MODELS["Llama-3-8B"]}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@dataclass
class Trace:
    outcomes: list[StepOutcome] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    first_order: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    end_s: float = 0.0


def drive(engine: EngineModel, max_steps: int = 100_000) -> Trace:
    """Run to completion, checking the per-step invariants."""
    trace = Trace()
    now = 0.0
    cfg = engine.config
    for _ in range(max_steps):
        if not engine.has_work():
            break
        out = engine.step(now)
        stats = engine.stats()
        assert stats.used_blocks <= engine.num_gpu_blocks
        assert stats.running <= cfg.max_num_seqs
        if cfg.enable_chunked_prefill and cfg.engine == "vllm":
            assert out.scheduled_tokens <= cfg.max_num_batched_tokens
        assert out.duration_s > 0
        now += out.duration_s
        for ev in out.emitted:
            if ev.first:
                assert ev.request_id not in trace.tokens
                trace.first_order.append(ev.request_id)
            trace.tokens[ev.request_id] = trace.tokens.get(ev.request_id, 0) + ev.tokens
        trace.finished.extend(out.finished)
        trace.outcomes.append(out)
    assert not engine.has_work()
    trace.end_s = now
    return trace


def submit_random(
    engine: EngineModel, n: int, seed: int, max_prompt: int = 600, max_out: int = 300
) -> dict[str, int]:
    rng = random.Random(seed)
    want = {}
    for i in range(n):
        rid = f"r{i}"
        want[rid] = rng.randint(1, max_out)
        engine.submit(rid, rng.randint(1, max_prompt), want[rid], 0.0)
    return want


def test_capacity_comes_from_catalog_or_override() -> None:
    engine = EngineModel(config(gpu=GPUS["V100-SXM2-32GB"]))
    assert engine.num_gpu_blocks == 97017 // 16
    assert engine.kv_capacity_tokens == engine.num_gpu_blocks * 16
    assert engine.max_model_len == 8192
    small = EngineModel(config(num_gpu_blocks_override=64, block_size=32, max_model_len=1024))
    assert (small.num_gpu_blocks, small.kv_capacity_tokens, small.block_size) == (64, 2048, 32)


def test_every_request_completes_with_exact_output_and_fcfs_first_tokens() -> None:
    engine = EngineModel(config(max_num_seqs=4))
    want = submit_random(engine, 40, seed=1)
    trace = drive(engine)
    assert trace.tokens == want
    assert sorted(trace.finished) == sorted(want)
    assert trace.first_order == [f"r{i}" for i in range(40)]  # FCFS admission
    stats = engine.stats()
    assert stats.generation_tokens_total == sum(want.values())
    assert stats.requests_finished_total == 40 and stats.used_blocks == 0 and stats.running == 0


def test_max_num_seqs_is_reached_but_not_exceeded() -> None:
    engine = EngineModel(config(max_num_seqs=8))
    submit_random(engine, 30, seed=2)
    engine.step(0.0)
    assert engine.stats().running == 8 and engine.stats().waiting == 22


def test_preemption_by_recompute_keeps_exact_output_lengths() -> None:
    # 64 blocks × 16 = 1024 tokens; 16 requests of up to 900 tokens each cannot all stay resident.
    engine = EngineModel(config(num_gpu_blocks_override=64, max_model_len=1024, max_num_seqs=16))
    rng = random.Random(3)
    want = {}
    for i in range(16):
        want[f"r{i}"] = rng.randint(300, 600)
        engine.submit(f"r{i}", rng.randint(50, 300), want[f"r{i}"], 0.0)
    trace = drive(engine)
    preempted = [rid for out in trace.outcomes for rid in out.preempted]
    assert engine.stats().num_preemptions_total == len(preempted) > 0
    assert trace.tokens == want  # no token emitted twice or lost after recompute
    # the victim is the newest running request: never the oldest one, which was admitted first
    assert "r0" not in preempted


def test_recompute_costs_a_reprefill() -> None:
    engine = EngineModel(config(num_gpu_blocks_override=8, max_model_len=128, max_num_seqs=4))
    engine.submit("a", 40, 80, 0.0)
    engine.submit("b", 40, 80, 0.0)
    trace = drive(engine)
    assert engine.stats().num_preemptions_total >= 1
    assert trace.tokens == {"a": 80, "b": 80}
    # a step after a preemption that resumes b prefills more than one token for it
    resumed = [o.scheduled_tokens for o in trace.outcomes if o.scheduled_tokens > 2]
    assert len(resumed) >= 2


def test_a_step_that_preempts_admits_nothing() -> None:
    # 6 blocks of 16 tokens; a small budget makes the victim's next chunk small enough to fit at once
    engine = EngineModel(
        config(num_gpu_blocks_override=6, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=8)
    )
    engine.submit("a", 8, 60, 0.0)
    engine.submit("b", 8, 60, 0.0)
    trace = drive(engine)
    at = next(i for i, out in enumerate(trace.outcomes) if out.preempted)
    assert trace.outcomes[at].preempted == ("b",)
    assert trace.outcomes[at].scheduled_tokens == 1  # a's decode only, though b's 7-token chunk would fit
    assert trace.outcomes[at + 1].scheduled_tokens == 8  # the next step resumes b: 1 + 7 tokens
    assert trace.tokens == {"a": 60, "b": 60}


def test_abort_frees_blocks_and_reports_unknown() -> None:
    engine = EngineModel(config(max_num_seqs=1))
    engine.submit("a", 500, 100, 0.0)
    engine.submit("b", 10, 5, 0.0)
    engine.step(0.0)
    assert engine.stats().used_blocks == 32  # ceil(500 / 16)
    assert engine.abort("b") is True  # waiting
    assert engine.abort("a") is True  # running
    assert engine.stats().used_blocks == 0 and not engine.has_work()
    assert engine.abort("a") is False and engine.abort("nope") is False
    assert engine.stats().requests_aborted_total == 2
    engine.submit("c", 10, 2, 1.0)
    drive(engine)
    assert engine.abort("c") is False  # finished


def test_chunked_prefill_splits_long_prompts_and_mixes_decodes() -> None:
    engine = EngineModel(config(max_num_batched_tokens=1024))
    engine.submit("long", 3000, 2, 0.0)
    steps = [engine.step(0.0) for _ in range(3)]
    assert [s.scheduled_tokens for s in steps] == [1024, 1024, 952]
    assert [len(s.emitted) for s in steps] == [0, 0, 1]
    mixed = EngineModel(config(max_num_batched_tokens=512))
    mixed.submit("d", 10, 50, 0.0)
    mixed.step(0.0)
    mixed.submit("p", 2000, 5, 0.0)
    out = mixed.step(0.0)
    assert out.scheduled_tokens == 512 and [e.request_id for e in out.emitted] == ["d"]


def test_without_chunked_prefill_prompts_are_scheduled_whole() -> None:
    # the budget becomes max(max_num_batched_tokens, max_model_len) = 4096, as vLLM sets it
    engine = EngineModel(
        config(max_num_batched_tokens=1024, enable_chunked_prefill=False, max_model_len=4096)
    )
    engine.submit("long", 3000, 2, 0.0)
    engine.submit("next", 3000, 2, 0.0)
    first = engine.step(0.0)
    assert first.scheduled_tokens == 3000 and [e.request_id for e in first.emitted] == ["long"]
    trace = drive(engine)
    assert trace.tokens == {"long": 1, "next": 2}


def test_step_time_grows_with_work() -> None:
    small, big = EngineModel(config()), EngineModel(config())
    small.submit("a", 100, 10, 0.0)
    for i in range(64):
        big.submit(f"b{i}", 100, 10, 0.0)
    assert big.step(0.0).duration_s > small.step(0.0).duration_s
    assert big.step(1.0).duration_s > small.step(1.0).duration_s


def test_runs_are_deterministic() -> None:
    def run() -> list[tuple[float, tuple[str, ...], tuple[str, ...]]]:
        engine = EngineModel(config(num_gpu_blocks_override=200, max_model_len=2048, max_num_seqs=32))
        submit_random(engine, 60, seed=9)
        return [(o.duration_s, o.finished, o.preempted) for o in drive(engine).outcomes]

    assert run() == run()


def test_prompt_too_long_has_vllm_message() -> None:
    engine = EngineModel(config(max_model_len=1024, num_gpu_blocks_override=128))
    with pytest.raises(
        PromptTooLong, match=r"maximum context length is 1024 tokens\. However, you requested 1100"
    ):
        engine.submit("a", 1000, 100, 0.0)
    with pytest.raises(ValueError, match="your request has 2000 input tokens"):
        engine.submit("b", 2000, 1, 0.0)
    engine.submit("c", 10, 1, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit("c", 10, 1, 0.0)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs: expected a positive integer"):
        config(max_num_seqs=0)
    with pytest.raises(ConfigError, match="engine: expected one of vllm|tgi"):
        config(engine="sglang")
    with pytest.raises(ConfigError, match=r"max_model_len: The model's max seq len \(8192\) is larger"):
        EngineModel(config(num_gpu_blocks_override=10))
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens: 128 must be greater than or equal"):
        EngineModel(config(max_num_seqs=256, max_num_batched_tokens=128))  # vLLM refuses it too
    EngineModel(config(max_num_seqs=256, max_num_batched_tokens=128, enable_chunked_prefill=False))
    EngineModel(config(engine="tgi", max_num_seqs=256, max_num_batched_tokens=128))


def test_tgi_reserves_max_new_tokens_and_never_preempts() -> None:
    engine = EngineModel(
        config(engine="tgi", max_batch_total_tokens=4096, max_model_len=2048, max_num_seqs=64)
    )
    rng = random.Random(5)
    want = {}
    for i in range(30):
        want[f"t{i}"] = rng.randint(1, 200)
        engine.submit(f"t{i}", rng.randint(10, 800), want[f"t{i}"], 0.0, reserve_tokens=400)
    trace = drive(engine)
    assert trace.tokens == want and engine.stats().num_preemptions_total == 0
    assert trace.first_order == sorted(want, key=lambda r: int(r[1:]))


def test_tgi_prefill_steps_do_not_decode() -> None:
    engine = EngineModel(config(engine="tgi"))
    engine.submit("a", 100, 10, 0.0)
    engine.step(0.0)
    engine.submit("b", 100, 10, 0.0)
    prefill = engine.step(0.0)
    assert [(e.request_id, e.first) for e in prefill.emitted] == [("b", True)]
    assert engine.stats().batch_reserved_tokens == 220
    decode = engine.step(0.0)
    assert sorted(e.request_id for e in decode.emitted) == ["a", "b"]


def test_a_slowdown_multiplies_every_later_step_and_nothing_else() -> None:
    normal, slowed = EngineModel(config()), EngineModel(config())
    for engine in (normal, slowed):
        submit_random(engine, 20, seed=4)
    slowed.set_slowdown(2.5)
    a, b = drive(normal), drive(slowed)
    assert a.tokens == b.tokens and a.first_order == b.first_order  # the same schedule...
    assert b.end_s == pytest.approx(2.5 * a.end_s)  # ... at 2.5x the time
    with pytest.raises(ValueError):
        slowed.set_slowdown(0.0)
