"""The forwarder's inactivity watchdogs (hetroute/proxy/watchdog.py), on a virtual-time loop.

The watchdogs read time only through ``loop.time()`` and ``loop.call_at``, so an event loop whose
``time()`` is a number the test moves gives exact deadlines with no real waiting. One test runs on
the real loop with a tiny limit, bounded in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from hetroute.proxy.watchdog import Watchdog, Watchdogs

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def close(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a failed test left running, then close the loop."""
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.close()


@pytest.fixture
def loop() -> Iterator[VirtualTimeLoop]:
    lp = VirtualTimeLoop()
    try:
        yield lp
    finally:
        close(lp)


def run(loop: asyncio.AbstractEventLoop, main: Callable[[], Awaitable[T]]) -> T:
    async def wrapped() -> T:
        return await main()

    return loop.run_until_complete(wrapped())


async def settle() -> None:
    """Let due timers, cancellations and their handlers run (no virtual time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def advance(loop: VirtualTimeLoop, to_s: float) -> None:
    loop.now = to_s
    await settle()


class Relay:
    """A stand-in for one forwarded request: waits for ever under a watchdog, like the forwarder."""

    def __init__(self, dogs: Watchdogs, limit_s: float) -> None:
        self.dog: Watchdog | None = None
        self.outcome: str | None = None
        self.task = asyncio.get_running_loop().create_task(self._run(dogs, limit_s))

    async def _run(self, dogs: Watchdogs, limit_s: float) -> None:
        self.dog = dogs.start(limit_s)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.dog.fired():
                self.outcome = f"expired: {self.dog.reason}" if self.dog.reason else "expired"
                return
            self.outcome = "cancelled from outside"
            raise
        finally:
            self.dog.close()

    @property
    def watchdog(self) -> Watchdog:
        assert self.dog is not None
        return self.dog

    def expired(self) -> bool:
        """``watchdog.expired`` read afresh (a method call, so type checkers do not narrow it)."""
        return self.watchdog.expired


async def started(dogs: Watchdogs, limit_s: float) -> Relay:
    relay = Relay(dogs, limit_s)
    await settle()
    return relay


def test_start_records_the_loop_time_and_the_limit(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 5.0)
        dog = relay.watchdog
        assert dog.last_s == 1000.0 and dog.limit_s == 5.0
        assert not dog.expired and dog.reason is None and dog.task is relay.task
        relay.task.cancel()
        await settle()

    run(loop, main)


def test_fires_exactly_at_the_deadline_and_the_cancellation_is_absorbed(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 5.0)
        await advance(loop, 1004.999)
        assert not relay.task.done() and not relay.expired()
        await advance(loop, 1005.0)
        assert relay.task.done() and not relay.task.cancelled()  # fired() absorbed it
        assert relay.outcome == "expired" and relay.expired() and relay.watchdog.reason is None

    run(loop, main)


def test_activity_moves_the_deadline(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 10.0)
        await advance(loop, 1006.0)
        relay.watchdog.last_s = loop.time()  # a chunk arrived: the forwarder only stores the time
        await advance(loop, 1010.0)  # the timer fires for the old deadline, finds it moved, re-arms
        assert not relay.task.done()
        await advance(loop, 1015.999)
        assert not relay.task.done()
        await advance(loop, 1016.0)
        assert relay.outcome == "expired"

    run(loop, main)


def test_rearm_to_a_shorter_limit_fires_earlier(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 100.0)
        await advance(loop, 1001.0)
        relay.watchdog.rearm(2.0)  # first byte seen: from now on 2 s between chunks
        assert relay.watchdog.limit_s == 2.0 and relay.watchdog.last_s == 1001.0
        await advance(loop, 1002.9)
        assert not relay.task.done()
        await advance(loop, 1003.0)
        assert relay.outcome == "expired"

    run(loop, main)


def test_each_watchdog_fires_at_its_own_deadline(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        late = await started(dogs, 30.0)
        early = await started(dogs, 10.0)  # earlier than the armed timer: the timer moves up
        middle = await started(dogs, 20.0)
        await advance(loop, 1010.0)
        assert early.outcome == "expired" and not middle.task.done() and not late.task.done()
        await advance(loop, 1020.0)
        assert middle.outcome == "expired" and not late.task.done()
        await advance(loop, 1030.0)
        assert late.outcome == "expired"

    run(loop, main)


def test_a_closed_watchdog_never_fires(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 5.0)
        other = await started(dogs, 8.0)
        relay.watchdog.close()
        await advance(loop, 1006.0)
        assert not relay.task.done() and not relay.expired()
        await advance(loop, 1008.0)
        assert other.outcome == "expired"
        relay.task.cancel()
        await settle()
        assert relay.task.cancelled() and relay.outcome == "cancelled from outside"
        assert dogs.expire_all("late") == 0  # nothing left open

    run(loop, main)


def test_a_cancellation_not_caused_by_the_watchdog_propagates(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 5.0)
        relay.task.cancel()  # the client went away
        await settle()
        assert relay.task.cancelled() and relay.outcome == "cancelled from outside"
        assert not relay.expired()
        await advance(loop, 1010.0)  # closed in the finally: the timer has nothing to cancel
        assert dogs.expire_all("late") == 0

    run(loop, main)


def test_an_outside_cancellation_racing_the_deadline_still_propagates(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relay = await started(dogs, 5.0)
        loop.now = 1005.0
        await asyncio.sleep(0)  # the timer fires and cancels the task ...
        relay.task.cancel()  # ... and the client disconnects before the task runs
        await settle()
        assert relay.expired() and relay.task.cancelled()
        assert relay.outcome == "cancelled from outside"

    run(loop, main)


def test_expire_all_cancels_every_open_watchdog_with_the_reason(loop: VirtualTimeLoop) -> None:
    async def main() -> None:
        dogs = Watchdogs()
        relays = [await started(dogs, limit) for limit in (5.0, 50.0, 500.0)]
        closed = await started(dogs, 5.0)
        closed.watchdog.close()
        assert dogs.expire_all("shutting down") == 3
        await settle()
        for relay in relays:
            assert relay.outcome == "expired: shutting down"
            assert relay.expired() and relay.watchdog.reason == "shutting down"
        assert not closed.task.done() and closed.watchdog.reason is None
        assert dogs.expire_all("again") == 0
        # the timer was disarmed and the set emptied: a new watchdog works as before
        fresh = await started(dogs, 1.0)
        await advance(loop, 1001.0)
        assert fresh.outcome == "expired"
        closed.task.cancel()
        await settle()

    run(loop, main)


def test_a_new_event_loop_starts_clean(loop: VirtualTimeLoop) -> None:
    dogs = Watchdogs()

    async def first() -> Relay:
        return await started(dogs, 5.0)

    stale = run(loop, first)
    stale.task.cancel()
    loop.run_until_complete(settle())
    other = VirtualTimeLoop()
    try:
        other.now = 0.0

        async def second() -> None:
            relay = await started(dogs, 2.0)
            assert dogs.expire_all("x") == 1  # only this loop's watchdog, not the stale one
            await settle()
            assert relay.outcome == "expired: x"

        run(other, second)
    finally:
        close(other)


async def test_real_loop_tiny_limit_fires_promptly() -> None:
    dogs = Watchdogs()
    relay = Relay(dogs, 0.01)
    await asyncio.wait_for(relay.task, timeout=5.0)
    assert relay.outcome == "expired"
