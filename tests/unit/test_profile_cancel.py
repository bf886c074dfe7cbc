"""An interrupted profile stops: cancelling a batch whose requests fail as they are torn down (a client
error instead of CancelledError, as an aborted stream can raise) is a cancellation, not a failed batch
the sweep would skip before going on with the next one."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from hetroute.clock import MonotonicClock
from profiling import collect
from profiling.batches import BatchRecord, BatchShape
from profiling.calibrate import Calibration, PromptMaker
from profiling.discover import EngineInfo


async def _run_batch(batch: int) -> BatchRecord:
    """One batch of ``batch`` requests through ``collect._run_batch`` (its requests are the test's fake)."""
    calibration = Calibration(1.0, 0.0, "exact", True)
    return await collect._run_batch(
        None,  # type: ignore[arg-type]  # the fake request never uses the session
        "http://127.0.0.1:1",
        EngineInfo("vllm", "m", 100_000, "test"),
        BatchShape(batch, 16, 16),
        PromptMaker("t", calibration),
        "exact",
        MonotonicClock(),
        30.0,
    )


async def test_cancelling_a_batch_whose_requests_raise_on_teardown_is_a_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = asyncio.Event()

    async def stream_request(*_args: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise aiohttp.ServerDisconnectedError() from None  # torn down mid-stream

    monkeypatch.setattr(collect, "stream_request", stream_request)
    batch = asyncio.create_task(_run_batch(2))
    await asyncio.wait_for(started.wait(), 5)
    batch.cancel()  # Ctrl-C: asyncio.run cancels the main task
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(batch, 5)


async def test_requests_failing_while_the_batch_waits_are_a_failed_batch_not_a_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CI failure of stop 33: three requests of a real vLLM batch hit stale keep-alive sockets and
    # failed while the batch was waiting for them. On Python 3.11 a TaskGroup leaves its own cancel of
    # the waiting task counted after such a failure, so the batch was taken for a Ctrl-C and the whole
    # profile stopped. It is one failed batch: the sweep notes it and goes on.
    async def stream_request(*_args: Any) -> None:
        await asyncio.sleep(0.05)
        raise aiohttp.ServerDisconnectedError()

    monkeypatch.setattr(collect, "stream_request", stream_request)
    with pytest.raises(collect.BatchFailed, match="ServerDisconnectedError"):
        await _run_batch(3)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
