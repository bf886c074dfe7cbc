"""Client-side limits: per-connection read deadlines, a connection cap, and local-error accounting.

Owns :class:`ConnectionDeadline` (a pure state machine over times passed in), the
:class:`ClientGuard` that one app shares between its connections (settings, the open-connection
count, and the access-log line and metric of every error the gateway answers itself), and the
raw HTTP answer written when no aiohttp request object exists (header timeout, connection cap).

A connection is in one of three phases:

- ``idle``: waiting for the first byte of a request head, at most ``keepalive_idle_s`` from the
  moment the connection opened or the previous response ended; then it is closed silently;
- ``head``: bytes of a head arrived; the whole head must be parsed within ``header_timeout_s``
  of its first byte, or the client gets ``408`` and the connection is closed;
- ``request``: a request is being handled; the body read is bounded by ``body_timeout_s`` in the
  handler (:mod:`hetroute.proxy.server`), the rest by the upstream timeouts.

Invariant: a connection is never waiting for a client without a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hetroute.access_log import AccessLog, AccessRecord
from hetroute.config import ServerConfig
from hetroute.proxy.api_errors import BACKEND_HEADER, REQUEST_ID_HEADER, error_body
from hetroute.telemetry import Telemetry
from hetroute.types import Api

Phase = Literal["idle", "head", "request"]
Expiry = Literal["idle", "head"]
CloseReason = Literal["idle", "header_timeout", "body_timeout", "too_many_connections"]


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """The ``server`` settings that bound what one client can hold (all seconds are > 0)."""

    header_timeout_s: float
    body_timeout_s: float
    keepalive_idle_s: float
    max_connections: int


def limits_of(server: ServerConfig) -> ClientLimits:
    return ClientLimits(
        server.header_timeout_s, server.body_timeout_s, server.keepalive_idle_s, server.max_connections
    )


class ConnectionDeadline:
    """The read deadline of one connection; times are the caller's clock (the loop's)."""

    __slots__ = ("_limits", "phase", "deadline_s")

    def __init__(self, limits: ClientLimits, now_s: float) -> None:
        self._limits = limits
        self.phase: Phase = "idle"
        self.deadline_s: float | None = now_s + limits.keepalive_idle_s

    def ready(self, now_s: float) -> None:
        """The connection waits for a new request (just opened, or a response ended)."""
        self.phase = "idle"
        self.deadline_s = now_s + self._limits.keepalive_idle_s

    def bytes_received(self, now_s: float) -> None:
        """Bytes arrived; in ``idle`` they start a request head and its deadline."""
        if self.phase == "idle":
            self.phase = "head"
            self.deadline_s = now_s + self._limits.header_timeout_s

    def head_complete(self) -> None:
        """The parser produced a request (or a parse error): the handler owns the time now."""
        self.phase = "request"
        self.deadline_s = None

    def expired(self, now_s: float) -> Expiry | None:
        """The phase whose deadline has passed at ``now_s``, or None."""
        if self.deadline_s is None or now_s < self.deadline_s or self.phase == "request":
            return None
        return self.phase


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


def raw_error_response(status: int, message: str, request_id: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 answer in the OpenAI error shape.

    Used where no aiohttp request exists (before a head was parsed); the head of the
    request is unknown, so the shape is the OpenAI one.
    """
    body = error_body("openai", status, message)
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{REQUEST_ID_HEADER}: {request_id}\r\n"
        f"{BACKEND_HEADER}: none\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class ClientGuard:
    """What every connection of one app shares: limits, the open count, local-error accounting.

    Built by the composition root; the protocol handler (:mod:`hetroute.proxy.protocol`) and
    the error middleware (:mod:`hetroute.proxy.local_errors`) report to it. Each locally
    answered error gets one access-log line and one ``hetroute_requests_total`` sample with
    ``backend="none"``; each connection the gateway closes or refuses counts in
    ``hetroute_client_connections_closed_total{reason}``.
    """

    def __init__(
        self,
        limits: ClientLimits,
        *,
        telemetry: Telemetry,
        access_log: AccessLog,
        next_request_id: Callable[[], str],
    ) -> None:
        self.limits = limits
        self.telemetry = telemetry
        self.access_log = access_log
        self.next_request_id = next_request_id
        self.open_connections = 0
        self.requests_in_progress = 0  # kept by the error middleware: handlers running now
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> bool:
        """Count a new connection; False (and not counted) when the cap is reached."""
        if self.open_connections >= self.limits.max_connections:
            return False
        self.open_connections += 1
        return True

    def release(self) -> None:
        self.open_connections -= 1

    def request_started(self) -> None:
        self.requests_in_progress += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self.requests_in_progress -= 1
        if self.requests_in_progress == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until no request handler runs; True when none does."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def closed(self, reason: CloseReason) -> None:
        self.telemetry.client_closed.labels(reason).inc()

    def local_error(
        self,
        *,
        api: Api,
        path: str,
        status: int,
        error: str,
        request_id: str,
        duration_s: float = 0.0,
        model: str | None = None,
    ) -> None:
        """Account one error answered by the gateway itself (never by a backend)."""
        self.telemetry.requests.labels("none", model or "", api, str(status), "").inc()
        rec = AccessRecord(request_id, api, path, model=model, backend=None, status=status)
        rec.error, rec.duration_s = error, duration_s
        self.access_log.write(rec)
