"""What a finished request leaves behind (its metrics, its access-log line, its learning observation,
what it teaches the token estimator and the output-length predictor) is held and applied in batches,
off the request's own path: nothing is lost or reordered, a ``/metrics`` scrape or any collection of
the registry is exact, and the held lines reach the sink within ``FLUSH_INTERVAL_S`` and at
shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from hetroute.access_log import ACCESS_BATCH, ACCESS_LOGGER, AccessLog, AccessRecord, LineSink
from hetroute.app import build_app, start_app
from hetroute.app_keys import FORWARDER
from hetroute.config import config_from_dict
from hetroute.lifecycle import FLUSH_INTERVAL_S
from hetroute.proxy.held_answers import ANSWER_BATCH, Answer, HeldAnswers
from hetroute.proxy.protocols import TokenEstimator
from hetroute.telemetry import TELEMETRY_BATCH, RequestOutcome, Telemetry
from predictors.online import OnlineQuantilePredictor
from tests.conftest import MODEL, Emu, EmulateFn, backend_entry, eventually


def _record(k: int) -> AccessRecord:
    return AccessRecord(f"r{k}", "openai", "/v1/completions", model=MODEL, backend="b", status=200)


def test_a_sink_gets_the_held_lines_in_order_at_a_full_batch_or_a_flush() -> None:
    lines: list[str] = []
    log = AccessLog(lines.append)
    for k in range(ACCESS_BATCH - 1):
        log.write(_record(k))
    assert lines == []  # held
    log.write(_record(ACCESS_BATCH - 1))
    assert [json.loads(x)["request_id"] for x in lines] == [f"r{k}" for k in range(ACCESS_BATCH)]
    assert all(x.endswith("}\n") and x.count("\n") == 1 for x in lines)
    log.write(_record(999))
    log.flush()
    log.flush()  # nothing held: nothing written twice
    assert len(lines) == ACCESS_BATCH + 1 and json.loads(lines[-1])["request_id"] == "r999"


async def test_in_a_running_loop_a_full_batch_is_written_after_the_current_step() -> None:
    """The request that fills a batch does not wait for it: the batch goes out once the event loop
    has finished the current step (its response is written by then)."""
    lines: list[str] = []
    log = AccessLog(lines.append)
    for k in range(ACCESS_BATCH + 3):
        log.write(_record(k))
    assert lines == []  # scheduled, not written inline
    await asyncio.sleep(0)
    assert [json.loads(x)["request_id"] for x in lines] == [f"r{k}" for k in range(ACCESS_BATCH + 3)]
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    for _ in range(TELEMETRY_BATCH):
        telemetry.on_decision("p", "b", 1e-5)
    assert telemetry._held_decisions  # held until the loop runs the flush
    await asyncio.sleep(0)
    assert not telemetry._held_decisions
    assert (
        registry.get_sample_value("hetroute_routing_decision_seconds_count", {"policy": "p"})
        == TELEMETRY_BATCH
    )


def test_without_a_sink_lines_go_to_the_logger_at_once_and_disabled_writes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    AccessLog().write(_record(1))
    assert [json.loads(r.getMessage())["request_id"] for r in caplog.records] == ["r1"]
    lines: list[str] = []
    off = AccessLog(lines.append, enabled=False)
    off.write(_record(2))
    off.flush()
    assert lines == []


def test_any_collection_of_the_registry_sees_every_held_request_and_decision() -> None:
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    n = TELEMETRY_BATCH + 5  # one batch applied on its own, five still held
    for k in range(n):
        telemetry.observe_request(
            RequestOutcome("b", MODEL, "openai", 200 if k % 2 else 503, "p", 0.01, 0.005, None, 3, 2)
        )
        telemetry.on_decision("p", "b", 2e-5)
    ok = registry.get_sample_value(
        "hetroute_requests_total",
        {"backend": "b", "model": MODEL, "api": "openai", "status": "200", "policy": "p"},
    )
    assert ok == n // 2
    assert registry.get_sample_value("hetroute_tokens_total", {"backend": "b", "kind": "prompt"}) == 3 * n
    assert registry.get_sample_value("hetroute_routing_decision_seconds_count", {"policy": "p"}) == n
    assert registry.get_sample_value("hetroute_ttft_seconds_count", {"backend": "b", "model": MODEL}) == n


async def _started(emu: Emu, sink: LineSink) -> tuple[web.AppRunner, str]:
    """A gateway in front of ``emu`` whose access-log lines go to ``sink``; its runner and URL."""
    cfg = config_from_dict(
        {
            "backends": [backend_entry(emu)],
            "policy": {"type": "round_robin"},
            "server": {"shutdown_grace_s": 1.0},
            "health": {"probe_interval_s": 60.0},
        },
        env={},
    )
    runner, port = await start_app(build_app(cfg, registry=CollectorRegistry(), access_sink=sink))
    return runner, f"http://127.0.0.1:{port}"


async def test_a_gateways_lines_reach_its_sink_soon_and_at_shutdown(emulate: EmulateFn) -> None:
    lines: list[str] = []
    runner, url = await _started(await emulate("vllm"), lines.append)
    try:
        async with aiohttp.ClientSession() as s:
            for k in range(3):
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
                async with s.post(url + "/v1/completions", json=body, headers={"x-request-id": f"q{k}"}) as r:
                    assert r.status == 200
            # within the flush interval (with room for a slow machine), in order
            assert await eventually(lambda: len(lines) == 3, timeout_s=10 * FLUSH_INTERVAL_S + 2.0)
            assert [json.loads(x)["request_id"] for x in lines] == ["q0", "q1", "q2"]
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body, headers={"x-request-id": "last"}) as r:
                assert r.status == 200
    finally:
        await runner.cleanup()
    # the line held at shutdown is written by the cleanup, not lost
    assert [json.loads(x)["request_id"] for x in lines][-1] == "last" and len(lines) == 4


async def test_metrics_are_exact_right_after_the_requests(emulate: EmulateFn) -> None:
    runner, url = await _started(await emulate("vllm"), lambda _line: None)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(5):
                async with s.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                    assert r.status == 200
            async with s.get(url + "/metrics") as r:
                text = await r.text()
    finally:
        await runner.cleanup()
    (line,) = [x for x in text.splitlines() if x.startswith("hetroute_requests_total{")]
    assert line.endswith(" 5.0"), line
    assert 'hetroute_routing_decision_seconds_count{policy="round_robin"} 5.0' in text


def _answers(n: int) -> list[Answer]:
    """Answers of two models over several prompt lengths, some without an engine count or output."""
    out = []
    for k in range(n):
        model = MODEL if k % 3 else "other"
        prompt = 40 + 97 * (k % 11)
        engine = None if k % 7 == 0 else prompt
        completion = None if k % 13 == 0 else 5 + (k * 37) % 300
        out.append(Answer(model, prompt * 4 + k % 5, engine, prompt, completion))
    return out


def _state(est: TokenEstimator, pred: OnlineQuantilePredictor) -> list[object]:
    return [
        *(est.chars_per_token(m) for m in (MODEL, "other")),
        *(pred.estimate(m, n) for m in (MODEL, "other") for n in (40, 300, 900, 5000)),
    ]


async def test_held_answers_reach_the_estimator_and_predictor_in_order_as_if_given_at_once() -> None:
    est, pred = TokenEstimator(), OnlineQuantilePredictor(min_samples=5)
    twin_est, twin_pred = TokenEstimator(), OnlineQuantilePredictor(min_samples=5)
    held = HeldAnswers(est, pred)
    answers = _answers(3 * ANSWER_BATCH)
    before = _state(est, pred)

    def twin(a: Answer) -> None:
        twin_est.observe(a.model, a.prompt_chars, a.engine_prompt_tokens)
        if a.completion_tokens is not None:
            twin_pred.observe(a.model, a.prompt_tokens, a.completion_tokens)

    for k, a in enumerate(answers[: 2 * ANSWER_BATCH + 5]):
        held.add(a)
        twin(a)
        if k == ANSWER_BATCH - 2:
            assert _state(est, pred) == before  # held: nothing taken in yet
        if k == ANSWER_BATCH - 1:
            assert len(held) == ANSWER_BATCH  # a full batch is taken in after the current step
            await asyncio.sleep(0)
            assert len(held) == 0 and _state(est, pred) == _state(twin_est, twin_pred)
    assert len(held) == ANSWER_BATCH + 5  # the second full batch is scheduled; the loop has not run
    await asyncio.sleep(0)
    assert len(held) == 0 and _state(est, pred) == _state(twin_est, twin_pred)
    for a in answers[2 * ANSWER_BATCH + 5 :]:
        held.add(a)
        twin(a)
    assert len(held) == ANSWER_BATCH - 5
    held.flush()
    assert _state(est, pred) == _state(twin_est, twin_pred) != before
    held.flush()  # nothing held: nothing taken in twice
    assert _state(est, pred) == _state(twin_est, twin_pred)


async def test_a_gateway_predictor_learns_the_answers_within_the_flush_interval(emulate: EmulateFn) -> None:
    runner, url = await _started(await emulate("vllm"), lambda _line: None)
    predictor = runner.app[FORWARDER].predictor
    try:
        assert predictor.predict(MODEL, 3, None) != 7
        async with aiohttp.ClientSession() as s:
            for _ in range(25):  # above the default predictor's 20 samples
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 7, "ignore_eos": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    assert (await r.json())["usage"]["completion_tokens"] == 7
        assert await eventually(
            lambda: predictor.predict(MODEL, 3, None) == 7, timeout_s=10 * FLUSH_INTERVAL_S + 2.0
        )
    finally:
        await runner.cleanup()


def test_a_batch_applied_per_label_set_leaves_every_sample_as_one_at_a_time() -> None:
    """Counters get one increment per label set and histograms their values in held order: every
    sample (sums and buckets included) equals applying each request on its own."""
    one, batched = CollectorRegistry(), CollectorRegistry()
    single, held = Telemetry(one), Telemetry(batched)
    rng = random.Random(8)
    for k in range(5 * TELEMETRY_BATCH + 7):
        outcome = RequestOutcome(
            rng.choice(["a", "b", "none"]),
            rng.choice([MODEL, "other"]),
            rng.choice(["openai", "tgi"]),
            rng.choice([200, 200, 404, 502]),
            rng.choice(["default", "round_robin"]),
            rng.random() * 3,
            rng.random() if k % 2 else None,
            rng.random() / 10 if k % 3 else None,
            rng.randint(0, 900),
            rng.randint(0, 300),
        )
        policy, elapsed_s = rng.choice(["default", "round_robin"]), rng.random() / 1000
        for t in (single, held):
            t.observe_request(outcome)
            t.on_decision(policy, outcome.backend, elapsed_s)
        single.flush()  # a batch of one: each request applied on its own

    def samples(registry: CollectorRegistry) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for family in registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        )

    assert samples(batched) == samples(one)
    assert len(samples(one)) > 100
