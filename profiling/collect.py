"""The profiling sweep: batches of concurrent requests of controlled shape, timed (method.md §3).

Owns: the sweep plan (which batch shapes, in which order), running each batch and turning it into a
prefill and a decode sample, dropping batches the engine queued or interference disturbed, the time
budget and the progress report. (The calibration probes and prompts are :mod:`profiling.calibrate`.)

A batch is ``b`` requests of ~I input tokens and O output tokens sent together; the next batch starts
only when every request of this one has ended, so the engine holds exactly this batch. Its prefill
sample is the last first token (continuous batching with chunked prefill may split a big batch's
prefill over several steps; the batch is prefilled when its last request has its first token); its
decode sample is last end − last first token, covering O − 1 decode steps of the whole batch.

Invariants (safe against a production backend): at most ``max_concurrency`` requests in flight, at
most ``max_requests`` requests in all (warm-up and re-measured batches included), every request under
an explicit timeout, and cancellation (Ctrl-C, budget, timeout) closes every open response so the
engine aborts the work. Shapes are visited in passes (one batch of every shape per pass, shuffled with
the seeded RNG) so a sweep cut short by its budget still covers every shape.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from hetroute.types import Clock
from profiling.calibrate import Calibration, PromptMaker
from profiling.client import OutputControl, RequestFailed, RequestRecord, request_body, stream_request
from profiling.discover import EngineInfo
from profiling.fit import BatchSample, DecodeSample, PrefillSample

KV_HEADROOM = 0.9  # use at most this share of the KV capacity, so a batch never preempts


class BatchFailed(RuntimeError):
    """A request of the batch failed (HTTP error, unreadable stream, connection or read timeout)."""


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """What to measure and the bounds that keep the sweep safe."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    input_lens: tuple[int, ...] | None = None  # None: chosen from the engine's max length
    output_lens: tuple[int, ...] = (64, 128)
    reps: int = 3
    max_concurrency: int = 32
    max_requests: int = 4000
    budget_s: float = 600.0
    timeout_s: float = 120.0
    run_id: str = "run"
    disturbed_tolerance: float = 0.25

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "output_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name}: expected positive integers, got {values}")
        if self.input_lens is not None and (not self.input_lens or min(self.input_lens) < 1):
            raise ValueError(f"input_lens: expected positive integers, got {self.input_lens}")
        for name in ("reps", "max_concurrency", "max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("budget_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class BatchShape:
    batch: int
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class BatchRecord:
    shape: BatchShape
    requests: tuple[RequestRecord, ...]

    @property
    def queued(self) -> bool:
        """True when some request ended before another got its first token: the engine did not run
        the batch as one (more requests than its max sequences, or preemption), so it is unusable."""
        return min(r.end_s for r in self.requests) < max(r.first_token_s for r in self.requests)

    @property
    def ran_together(self) -> int:
        """How many requests had their first token before the first one ended (the engine's concurrency)."""
        first_end = min(r.end_s for r in self.requests)
        return sum(1 for r in self.requests if r.first_token_s <= first_end)

    def to_sample(self) -> BatchSample:
        """Prefill = last first token; decode = last end − last first token over (max O − 1) steps."""
        first = max(r.first_token_s for r in self.requests)
        end = max(r.end_s for r in self.requests)
        prompts = [r.prompt_tokens for r in self.requests if r.prompt_tokens is not None]
        inp = max(prompts) if prompts else self.shape.input_tokens
        outs = [r.completion_tokens if r.completion_tokens is not None else r.chunks for r in self.requests]
        steps = max(outs) - 1
        b = len(self.requests)
        decode = DecodeSample(b, inp, steps, end - first) if steps >= 1 and end > first else None
        shape = (self.shape.batch, self.shape.input_tokens, self.shape.output_tokens)
        return BatchSample(prefill=PrefillSample(b, inp, first), decode=decode, shape=shape)


@dataclass
class QueueWatch:
    """Finds an engine limit on concurrent sequences below the sweep's batch sizes (vLLM hides it).

    A queued batch is always dropped. A batch size queued ``strikes_to_limit`` times blocks every batch
    size at or above it for the rest of the sweep, unless a batch at least that wide already ran whole
    (then the engine can hold it and the queueing was a hiccup, e.g. a request delayed in transit).
    """

    strikes_to_limit: int = 2
    strikes: dict[int, int] = field(default_factory=dict)
    limit_batch: int | None = None
    ran_together: int | None = None
    widest_whole: int = 0

    def blocks(self, batch: int) -> bool:
        return self.limit_batch is not None and batch >= self.limit_batch

    def ran_whole(self, record: BatchRecord) -> None:
        self.widest_whole = max(self.widest_whole, record.shape.batch)

    def observe(self, record: BatchRecord) -> str:
        """Count a queued batch; the returned note says whether it now caps the batch sizes."""
        b = record.shape.batch
        self.strikes[b] = self.strikes.get(b, 0) + 1
        together = record.ran_together
        text = f"engine queued part of a batch of {b} ({together} ran together): batch dropped"
        if b <= self.widest_whole:
            return text + f" (a batch of {self.widest_whole} ran whole: not a limit)"
        if self.strikes[b] >= self.strikes_to_limit and not self.blocks(b):
            self.limit_batch = b
            self.ran_together = together
            text += f"; batch sizes >= {b} skipped from now on"
        return text


@dataclass(frozen=True, slots=True)
class Progress:
    done: int
    total: int
    elapsed_s: float
    eta_s: float
    shape: BatchShape


@dataclass
class SweepResult:
    batches: list[BatchRecord] = field(default_factory=list)
    planned: int = 0
    requests_sent: int = 0
    failed_batches: int = 0
    stop_reason: str = "complete"
    remeasured: int = 0
    dropped_disturbed: int = 0
    queued_at_batch: int | None = None
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def default_input_lens(max_model_len: int | None, max_output: int) -> tuple[int, ...]:
    """A few input lengths spanning short to long prompts that fit the engine's max length.

    Prompts start at 128 tokens: below ~100 a GPU's prefill is bound by reading the weights, not by
    the tokens, and Eq. 3's straight line fits that corner poorly (router traffic rarely lives there).
    """
    limit = (max_model_len or 4096) - max_output
    lens = tuple(i for i in (128, 512, 1024, 2048) if i <= limit)
    return lens or (max(1, limit // 2),)


def plan_sweep(cfg: SweepConfig, info: EngineInfo, rng: random.Random) -> list[BatchShape]:
    """Feasible shapes in ``reps`` shuffled passes, truncated to ``max_requests`` requests in all
    (including the warm-up batch of the widest shape that :func:`run_sweep` sends first).

    A shape is feasible when b ≤ max_concurrency (and the engine's max sequences when known),
    I + O ≤ max_model_len, and b·(I + O) ≤ 90 % of the KV capacity (no preemption).
    """
    inputs = cfg.input_lens or default_input_lens(info.max_model_len, max(cfg.output_lens))
    max_b = min(cfg.max_concurrency, info.max_num_seqs or cfg.max_concurrency)
    shapes = [
        BatchShape(b, i, o)
        for b in sorted(set(cfg.batch_sizes))
        for i in sorted(set(inputs))
        for o in sorted(set(cfg.output_lens))
        if b <= max_b
        and (info.max_model_len is None or i + o <= info.max_model_len)
        and b * (i + o) <= KV_HEADROOM * info.kv_capacity_tokens
    ]
    plan: list[BatchShape] = []
    sent = max((s.batch for s in shapes), default=0)  # the warm-up batch counts too
    for _ in range(cfg.reps):
        order = list(shapes)
        rng.shuffle(order)
        for shape in order:
            if sent + shape.batch > cfg.max_requests:
                return plan
            plan.append(shape)
            sent += shape.batch
    return plan


async def _run_batch(
    session: aiohttp.ClientSession,
    base: str,
    info: EngineInfo,
    shape: BatchShape,
    prompts: PromptMaker,
    control: OutputControl,
    clock: Clock,
    limit_s: float,
) -> BatchRecord:
    bodies = [
        request_body(info.engine, info.model, prompts.make(shape.input_tokens), shape.output_tokens, control)
        for _ in range(shape.batch)
    ]
    started = clock.now()
    try:
        async with asyncio.timeout(limit_s), asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(stream_request(session, base, p, body, clock, started)) for p, body in bodies
            ]
    except ExceptionGroup as group:
        first = group.exceptions[0]
        if isinstance(first, RequestFailed | aiohttp.ClientError | TimeoutError):
            raise BatchFailed(f"{type(first).__name__}: {first}") from first
        raise
    return BatchRecord(shape=shape, requests=tuple(t.result() for t in tasks))


def _by_shape(batches: Sequence[BatchRecord]) -> dict[BatchShape, list[int]]:
    by_shape: dict[BatchShape, list[int]] = {}
    for idx, batch in enumerate(batches):
        by_shape.setdefault(batch.shape, []).append(idx)
    return by_shape


def undecided(batches: Sequence[BatchRecord], tolerance: float) -> list[BatchShape]:
    """Shapes measured exactly twice whose two batches disagree by more than ``tolerance``: one more
    batch lets :func:`disturbed` tell which one is off."""
    out = []
    for shape, (i, j) in ((k, v) for k, v in _by_shape(batches).items() if len(v) == 2):
        a, b = batches[i].to_sample(), batches[j].to_sample()
        da = a.decode.time_s if a.decode else 0.0
        db = b.decode.time_s if b.decode else 0.0
        pre_off = abs(a.prefill.time_s - b.prefill.time_s) > tolerance * min(
            a.prefill.time_s, b.prefill.time_s
        )
        if pre_off or abs(da - db) > tolerance * min(da, db):
            out.append(shape)
    return out


def _step_s(sample: BatchSample) -> float:
    return sample.decode.time_s / sample.decode.steps if sample.decode is not None else 0.0


def burst_read(batches: Sequence[BatchRecord], floor: float = 0.25) -> list[int]:
    """Indices of batches whose decode time per step is under ``floor`` × the median per-step time of all
    batches of the same width (needs ≥ 3 of them): their streams were read in one burst after a stall
    of the reader (the host's scheduler), so their decode time means nothing."""
    by_width: dict[int, list[int]] = {}
    for idx, batch in enumerate(batches):
        by_width.setdefault(batch.shape.batch, []).append(idx)
    out: list[int] = []
    for members in by_width.values():
        if len(members) >= 3:
            per_step = [_step_s(batches[i].to_sample()) for i in members]
            median = statistics.median(per_step)
            out += [i for i, v in zip(members, per_step, strict=True) if v < floor * median]
    return out


def disturbed(batches: Sequence[BatchRecord], tolerance: float) -> list[int]:
    """Indices of batches whose prefill or decode time is off the median of their shape's batches by more
    than ``tolerance`` (a fraction; needs at least 3 batches of a shape to tell which one is off), or
    that were read in a burst (:func:`burst_read`)."""
    out: list[int] = list(burst_read(batches))
    for members in _by_shape(batches).values():
        if len(members) < 3:
            continue
        samples = [batches[i].to_sample() for i in members]
        pre = statistics.median(s.prefill.time_s for s in samples)
        dec = statistics.median(s.decode.time_s if s.decode else 0.0 for s in samples)
        for idx, s in zip(members, samples, strict=True):
            d = s.decode.time_s if s.decode else 0.0
            if abs(s.prefill.time_s - pre) > tolerance * pre or abs(d - dec) > tolerance * dec:
                out.append(idx)
    return sorted(set(out))


async def run_sweep(
    session: aiohttp.ClientSession,
    base: str,
    info: EngineInfo,
    plan: Sequence[BatchShape],
    cfg: SweepConfig,
    calibration: Calibration,
    clock: Clock,
    on_progress: Callable[[Progress], None] | None = None,
) -> SweepResult:
    """Run ``plan`` batch by batch within the budget; failed or cut-off batches are dropped.

    When the plan is done, batches disturbed by interference (:func:`disturbed`) are dropped and their
    shapes measured again, in at most 2 rounds and at most half the plan's batches more (within
    the budget and the request bound); batches still disturbed after that are dropped.
    """
    result = SweepResult(planned=len(plan))
    prompts = PromptMaker(cfg.run_id, calibration)
    start = clock.now()
    deadline = start + cfg.budget_s
    last_duration: dict[BatchShape, float] = {}
    consecutive_failures = 0
    request_limit = cfg.max_requests
    queue = QueueWatch()
    if plan:  # one discarded batch of the widest shape warms the engine's kernels and allocator
        warm = BatchShape(max(s.batch for s in plan), min(s.input_tokens for s in plan), 8)
        result.requests_sent += warm.batch
        try:
            ctl = calibration.control
            warmed = await _run_batch(session, base, info, warm, prompts, ctl, clock, cfg.timeout_s)
            if not warmed.queued:
                queue.ran_whole(warmed)
        except BatchFailed as exc:
            result.notes.append(f"warm-up batch failed: {exc}")
    todo = deque(plan)
    extra_left = len(plan) // 2
    rounds_left = 2
    total = len(plan)
    done = 0
    while todo:
        shape = todo.popleft()
        done += 1
        if queue.blocks(shape.batch) or result.requests_sent + shape.batch > request_limit:
            continue
        now = clock.now()
        if now + last_duration.get(shape, 0.0) > deadline:
            result.stop_reason = "budget"
            if now >= deadline:
                break
            continue
        result.requests_sent += shape.batch
        try:
            limit_s = min(cfg.timeout_s, deadline - now)
            record = await _run_batch(
                session, base, info, shape, prompts, calibration.control, clock, limit_s
            )
        except TimeoutError:
            result.failed_batches += 1
            if clock.now() >= deadline - 1e-3:
                result.stop_reason = "budget"
                break
            result.notes.append(f"batch {shape} timed out after {cfg.timeout_s} s")
            consecutive_failures += 1
        except BatchFailed as exc:
            result.failed_batches += 1
            consecutive_failures += 1
            result.notes.append(f"batch {shape} failed: {exc}")
        else:
            consecutive_failures = 0
            last_duration[shape] = clock.now() - now
            if record.queued:
                result.notes.append(queue.observe(record))
                result.queued_at_batch = queue.limit_batch
                if not queue.blocks(shape.batch) and extra_left > 0:  # a hiccup: measure the shape again
                    todo.append(shape)
                    extra_left -= 1
                    total += 1
            else:
                queue.ran_whole(record)
                result.batches.append(record)
        if consecutive_failures >= 3:
            result.stop_reason = "backend failing (3 batches in a row)"
            break
        if not todo and rounds_left > 0 and extra_left > 0:
            rounds_left -= 1
            bad = disturbed(result.batches, cfg.disturbed_tolerance)[:extra_left]
            todo.extend(result.batches[i].shape for i in bad)
            result.batches = [b for i, b in enumerate(result.batches) if i not in set(bad)]
            result.remeasured += len(bad)
            extra_left -= len(bad)
            unsure = undecided(result.batches, cfg.disturbed_tolerance)[:extra_left]
            todo.extend(unsure)
            extra_left -= len(unsure)
            total += len(bad) + len(unsure)
        elapsed = clock.now() - start
        if on_progress is not None:
            eta = min(elapsed / done * (total - done), max(0.0, deadline - clock.now()))
            on_progress(Progress(done, total, elapsed, eta, shape))
    still = set(disturbed(result.batches, cfg.disturbed_tolerance))
    result.batches = [b for i, b in enumerate(result.batches) if i not in still]
    result.dropped_disturbed = len(still)
    if result.remeasured or still:
        result.notes.append(
            f"{result.remeasured} batches disturbed by interference (> {cfg.disturbed_tolerance:.0%} off "
            f"their shape's median) were measured again; {len(still)} still disturbed were dropped"
        )
    result.elapsed_s = clock.now() - start
    return result
