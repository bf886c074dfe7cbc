"""The stream relay's inner loop and its in-stream error ending (the forwarder's hot path).

Owns :func:`pump` (upstream chunks → tap → client, until EOF) and :func:`end_with_error` (the API's
error event after the first byte). Invariants:

- nothing is buffered beyond what the tap holds back (a partial event it must inspect);
- every chunk stores the loop time in ``watchdog.last_s`` (the idle deadline restarts) and allocates
  nothing else here; generated tokens reach the ledger every ``OBSERVE_EVERY`` events and exactly at EOF;
- a failed write to the client reports "client gone" and stops reading: the caller closes the upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from hetroute.proxy.http1 import UpstreamError, UpstreamResponse
from hetroute.proxy.sse import OpenAIStreamTap, TgiStreamTap, openai_error_event, tgi_error_event
from hetroute.proxy.watchdog import Watchdog
from hetroute.routing.ledger import Ticket

OBSERVE_EVERY = 4
"""Report generated tokens to the ledger every few events (exact at the end): it is numpy work."""


async def pump(
    out: web.StreamResponse,
    resp: UpstreamResponse,
    tap: OpenAIStreamTap | TgiStreamTap,
    ticket: Ticket,
    watchdog: Watchdog,
    observe: Callable[[Ticket, int], None],
    idle_s: float,
) -> tuple[str | None, bool]:
    """Relay until EOF: (upstream error or None, client gone).

    ``observe`` is the ledger's ``observe_generated``; ``idle_s`` only names the limit in the error when
    the watchdog ends an idle stream. Cancellation not caused by the watchdog propagates.
    """
    loop = asyncio.get_running_loop()
    readany = resp.readany
    write = out.write
    feed = tap.feed
    reported = 0
    try:
        while True:
            try:
                chunk = await readany()
            except (UpstreamError, OSError) as exc:
                return f"upstream failed mid-stream: {type(exc).__name__}", False
            if not chunk:
                break
            watchdog.last_s = loop.time()
            data = feed(chunk)
            if data:
                try:
                    await write(data)
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    return None, True
            if tap.events - reported >= OBSERVE_EVERY:
                reported = tap.events
                observe(ticket, reported)
    except asyncio.CancelledError:
        if watchdog.fired():
            return watchdog.reason or f"upstream idle for more than {idle_s:g} s", False
        raise
    observe(ticket, tap.events)
    rest = tap.flush()
    if rest:
        try:
            await write(rest)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return None, True
    return None, False


async def end_with_error(out: web.StreamResponse, api: str, error: str, *, shutdown: bool) -> None:
    """End a started stream with ``api``'s error event for ``error``, then EOF (a gone client is ignored).

    ``shutdown``: the gateway ended the stream (a 503-style ``service_unavailable``/``unhealthy`` event),
    not the backend (an upstream error event).
    """
    if shutdown:
        openai_event, tgi_type = openai_error_event(error, "service_unavailable", 503), "unhealthy"
    else:
        openai_event, tgi_type = openai_error_event(error), "upstream"
    event = openai_event if api == "openai" else tgi_error_event(error, tgi_type)
    try:
        await out.write(event)
        await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass
