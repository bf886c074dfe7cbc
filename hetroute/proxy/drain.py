"""Graceful shutdown of a running gateway, bounded by the grace period.

:func:`drain` is what ``hetroute serve`` runs on SIGTERM/SIGINT:

1. the listeners close (no new connections) and every open connection is told to close
   after its current response (idle keep-alive connections close at once);
2. requests in progress get ``grace_s`` to finish;
3. then every request still running is ended by the forwarder: a stream gets the API's
   error event (``the gateway is shutting down``) before its connection closes, a request
   before its first byte gets ``503``;
4. after at most ``ABORT_WAIT_S`` for those answers to be written, the runner is cleaned up
   (its own shutdown timeout is short, :data:`hetroute.app.RUNNER_SHUTDOWN_S`).

So the whole shutdown takes at most ``grace_s`` plus well under a second.
"""

from __future__ import annotations

import logging

from aiohttp import web

from hetroute.proxy.client_limits import ClientGuard
from hetroute.proxy.forward import Forwarder

log = logging.getLogger("hetroute.serve")

SHUTDOWN_REASON = "the gateway is shutting down"
ABORT_WAIT_S = 0.3


async def drain(runner: web.AppRunner, forwarder: Forwarder, guard: ClientGuard, grace_s: float) -> None:
    """Stop ``runner``'s gateway gracefully within ``grace_s`` (+ < 1 s); see the module doc."""
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    if server is not None:
        server.pre_shutdown()  # close idle keep-alive connections; others after their response
    if not await guard.wait_idle(grace_s):
        aborted = forwarder.abort_in_flight(SHUTDOWN_REASON)
        log.warning("grace period of %gs over: ending %d request(s) still in flight", grace_s, aborted)
        await guard.wait_idle(ABORT_WAIT_S)
    await runner.cleanup()
