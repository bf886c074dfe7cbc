"""Work that a request's own path should not wait for: run it after the current step of the event loop.

The held records of a finished request (metrics, access log, learning observations) are applied in
batches. When a batch fills, applying it inside the request that filled it would delay that request's
response by the whole batch's work; :func:`run_soon` runs it once the current task step is done (by
then the response has been handed to the transport), or at once when no event loop runs (the
simulator, a unit test).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def run_soon(callback: Callable[[], None]) -> None:
    """``callback()`` after the running event loop's current step, or now without a running loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        callback()
        return
    loop.call_soon(callback)
