"""The profiling sweep: batches of concurrent requests of controlled shape, timed (method.md §3).

Owns: the sweep plan (which batch shapes, in which order), running each batch, dropping and
re-measuring batches the engine queued or interference disturbed, the time budget and the progress
report. (The calibration probes and prompts are :mod:`profiling.calibrate`; a batch's record, its
prefill and decode sample and the interference filters are :mod:`profiling.batches`.)

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from hetroute.types import Clock
from profiling.batches import BatchRecord, BatchShape, disturbed, undecided
from profiling.calibrate import Calibration, PromptMaker
from profiling.client import OutputControl, RequestFailed, request_body, stream_request
from profiling.discover import EngineInfo

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
    # Plain tasks and asyncio.wait, not a TaskGroup: on Python 3.11 a TaskGroup whose child fails while
    # the parent waits leaves its own cancel of the parent counted, so a failed batch could not be told
    # from a Ctrl-C. Here an outside cancel (or the timeout) arrives as itself at the ``wait``.
    tasks = [
        asyncio.create_task(stream_request(session, base, p, body, clock, started)) for p, body in bodies
    ]
    try:
        async with asyncio.timeout(limit_s):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # no-op on the finished ones; the rest close their responses (engine aborts)
        await asyncio.wait(tasks)
    for task in tasks:
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            continue
        if isinstance(exc, RequestFailed | aiohttp.ClientError | TimeoutError):
            raise BatchFailed(f"{type(exc).__name__}: {exc}") from exc
        raise exc
    return BatchRecord(shape=shape, requests=tuple(t.result() for t in tasks))


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

    When the plan is done, batches disturbed by interference (:func:`profiling.batches.disturbed`) are
    dropped and their shapes measured again, in at most 2 rounds and at most half the plan's batches more
    (within the budget and the request bound); batches still disturbed after that are dropped.
    """
    sweep = _Sweep(session, base, info, plan, cfg, calibration, clock, on_progress)
    return await sweep.run()


class _Sweep:
    """The state of one :func:`run_sweep`: the shapes still to measure, the re-measure allowance
    (``extra_left`` batches over ``rounds_left`` rounds), failures in a row and the result so far."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base: str,
        info: EngineInfo,
        plan: Sequence[BatchShape],
        cfg: SweepConfig,
        calibration: Calibration,
        clock: Clock,
        on_progress: Callable[[Progress], None] | None,
    ) -> None:
        self.session, self.base, self.info, self.plan, self.cfg = session, base, info, plan, cfg
        self.control = calibration.control
        self.clock = clock
        self.on_progress = on_progress
        self.result = SweepResult(planned=len(plan))
        self.prompts = PromptMaker(cfg.run_id, calibration)
        self.start_s = clock.now()
        self.deadline_s = self.start_s + cfg.budget_s
        self.last_duration_s: dict[BatchShape, float] = {}
        self.consecutive_failures = 0
        self.queue = QueueWatch()
        self.todo = deque(plan)
        self.extra_left = len(plan) // 2
        self.rounds_left = 2
        self.total = len(plan)
        self.done = 0

    async def run(self) -> SweepResult:
        """Warm up, measure every shape of the plan (and the re-measures), then drop what is disturbed."""
        await self._warm_up()
        result = self.result
        while self.todo:
            shape = self.todo.popleft()
            self.done += 1
            if self.queue.blocks(shape.batch) or result.requests_sent + shape.batch > self.cfg.max_requests:
                continue
            now = self.clock.now()
            if now + self.last_duration_s.get(shape, 0.0) > self.deadline_s:
                result.stop_reason = "budget"
                if now >= self.deadline_s:
                    break
                continue
            if not await self._measure(shape, now):
                break
            if self.consecutive_failures >= 3:
                result.stop_reason = "backend failing (3 batches in a row)"
                break
            if not self.todo and self.rounds_left > 0 and self.extra_left > 0:
                self._plan_remeasure()
            self._report(shape)
        self._drop_still_disturbed()
        result.elapsed_s = self.clock.now() - self.start_s
        return result

    async def _warm_up(self) -> None:
        """One discarded batch of the widest shape warms the engine's kernels and allocator."""
        if not self.plan:
            return
        warm = BatchShape(max(s.batch for s in self.plan), min(s.input_tokens for s in self.plan), 8)
        self.result.requests_sent += warm.batch
        try:
            warmed = await self._send(warm, self.cfg.timeout_s)
            if not warmed.queued:
                self.queue.ran_whole(warmed)
        except BatchFailed as exc:
            self.result.notes.append(f"warm-up batch failed: {exc}")

    async def _send(self, shape: BatchShape, limit_s: float) -> BatchRecord:
        """Run one batch of ``shape`` within ``limit_s`` (:func:`_run_batch`)."""
        return await _run_batch(
            self.session, self.base, self.info, shape, self.prompts, self.control, self.clock, limit_s
        )

    async def _measure(self, shape: BatchShape, now: float) -> bool:
        """Send one batch of ``shape`` (started at ``now``); False when the budget ran out meanwhile."""
        result = self.result
        result.requests_sent += shape.batch
        try:
            record = await self._send(shape, min(self.cfg.timeout_s, self.deadline_s - now))
        except TimeoutError:
            result.failed_batches += 1
            if self.clock.now() >= self.deadline_s - 1e-3:
                result.stop_reason = "budget"
                return False
            result.notes.append(f"batch {shape} timed out after {self.cfg.timeout_s} s")
            self.consecutive_failures += 1
        except BatchFailed as exc:
            result.failed_batches += 1
            self.consecutive_failures += 1
            result.notes.append(f"batch {shape} failed: {exc}")
        else:
            self.consecutive_failures = 0
            self.last_duration_s[shape] = self.clock.now() - now
            self._keep(record)
        return True

    def _keep(self, record: BatchRecord) -> None:
        """Keep a batch that ran whole; a queued one is dropped (and measured again if a hiccup)."""
        result, shape = self.result, record.shape
        if not record.queued:
            self.queue.ran_whole(record)
            result.batches.append(record)
            return
        result.notes.append(self.queue.observe(record))
        result.queued_at_batch = self.queue.limit_batch
        if not self.queue.blocks(shape.batch) and self.extra_left > 0:  # a hiccup: measure the shape again
            self.todo.append(shape)
            self.extra_left -= 1
            self.total += 1

    def _plan_remeasure(self) -> None:
        """One re-measure round: drop disturbed batches and queue their shapes, then undecided shapes."""
        result, tolerance = self.result, self.cfg.disturbed_tolerance
        self.rounds_left -= 1
        bad = disturbed(result.batches, tolerance)[: self.extra_left]
        self.todo.extend(result.batches[i].shape for i in bad)
        result.batches = [b for i, b in enumerate(result.batches) if i not in set(bad)]
        result.remeasured += len(bad)
        self.extra_left -= len(bad)
        unsure = undecided(result.batches, tolerance)[: self.extra_left]
        self.todo.extend(unsure)
        self.extra_left -= len(unsure)
        self.total += len(bad) + len(unsure)

    def _report(self, shape: BatchShape) -> None:
        """Report progress after ``shape`` (the ETA is capped by the time left in the budget)."""
        elapsed = self.clock.now() - self.start_s
        if self.on_progress is not None:
            eta = min(
                elapsed / self.done * (self.total - self.done), max(0.0, self.deadline_s - self.clock.now())
            )
            self.on_progress(Progress(self.done, self.total, elapsed, eta, shape))

    def _drop_still_disturbed(self) -> None:
        """Drop the batches still disturbed after the re-measure rounds, and say so in the notes."""
        result, tolerance = self.result, self.cfg.disturbed_tolerance
        still = set(disturbed(result.batches, tolerance))
        result.batches = [b for i, b in enumerate(result.batches) if i not in still]
        result.dropped_disturbed = len(still)
        if result.remeasured or still:
            result.notes.append(
                f"{result.remeasured} batches disturbed by interference (> {tolerance:.0%} off "
                f"their shape's median) were measured again; {len(still)} still disturbed were dropped"
            )
