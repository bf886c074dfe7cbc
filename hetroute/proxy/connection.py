"""The gateway's HTTP connection handler: aiohttp's, with client deadlines and JSON errors.

Owns :class:`GuardedRequestHandler` (a subclass of aiohttp's ``RequestHandler``; the parser is
aiohttp's, unchanged), the :class:`GuardedServer` that makes one per connection and the
:class:`GuardedRunner` every entry point uses. Contracts:

- every connection has a read deadline (:class:`ConnectionDeadline`): idle keep-alive
  connections are closed after ``keepalive_idle_s``, a head not complete within
  ``header_timeout_s`` of its first byte gets ``408`` and is closed;
- beyond ``max_connections`` open connections a new one gets ``503`` and is closed at once;
- an error raised by aiohttp's HTTP parser (bad method, over-long line, too many headers, NUL
  bytes, bad framing, ...) is answered in the OpenAI error shape with a 4xx status and a fixed
  message that never echoes the client's bytes; it is logged at DEBUG without a traceback,
  and gets an access-log line and a metric like every other local error;
- an unexpected exception in a handler (a bug) is logged with its traceback and answered
  ``500`` in the JSON shape, without details.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from hetroute.proxy.api_errors import BACKEND_HEADER, REQUEST_ID_HEADER, ApiError, error_body
from hetroute.proxy.client_limits import ClientGuard, ConnectionDeadline, raw_error_response
from hetroute.proxy.encodings import SUPPORTED_ENCODINGS

log = logging.getLogger("hetroute.connection")

LINGERING_S = 1.0
"""After an error answer, unread body bytes are drained for at most this long (aiohttp's
``lingering_time``, 10 s by default) before the connection is closed."""


def parser_error(exc: BaseException | None) -> ApiError:
    """The client-facing error for an exception of aiohttp's HTTP parser (no client bytes)."""
    if isinstance(exc, LineTooLong):
        return ApiError(431, "a request line or header field is too long")
    if isinstance(exc, ContentEncodingError):  # at head time: no decoder for it (br, zstd)
        supported = ", ".join(SUPPORTED_ENCODINGS)
        return ApiError(415, f"unsupported Content-Encoding; supported: {supported} or identity")
    if isinstance(exc, BadHttpMethod):
        return ApiError(400, "malformed request line or unsupported HTTP method")
    message = str(getattr(exc, "message", "") or "")
    if "Too many headers" in message:
        return ApiError(431, "too many header fields")
    if isinstance(exc, HttpProcessingError):
        return ApiError(400, "malformed HTTP request")
    return ApiError(400, "bad request")


class GuardedRequestHandler(RequestHandler):
    """One client connection; see the module docstring for what it adds to aiohttp's."""

    def __init__(self, manager: web.Server, *, guard: ClientGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._deadline = ConnectionDeadline(guard.limits, self._loop.time())
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._admitted = False
        self._lingering = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._guard.admit():
            self._guard.closed("too_many_connections")
            rid = self._guard.next_request_id()
            self._guard.local_error(
                api="openai", path="-", status=503, error="too many connections", request_id=rid
            )
            body = raw_error_response(503, "too many open connections; retry later", rid)
            self._write_and_close(body)
            return
        self._admitted = True
        self._deadline.ready(self._loop.time())
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._admitted:
            self._admitted = False
            self._guard.release()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered and closing: discard
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._deadline.head_complete()
        elif data and self._deadline.phase == "idle":
            self._deadline.bytes_received(self._loop.time())
            self._arm()

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # Raised by aiohttp outside the app's middleware (e.g. the expect handler of a
            # system route): answer in the JSON shape too.
            resp = self._error_response(request.rel_url.path, ApiError(resp.status, resp.reason))
        result = await super().finish_response(request, resp, start_time)
        if resp.status == 408 or request.content.exception() is not None:
            # A stalled or broken body: close now. aiohttp's lingering read of the rest would
            # wait, or re-raise the body's error as an "Unhandled exception" with a traceback.
            self.force_close()
        elif not self._messages:
            self._deadline.ready(self._loop.time())
            self._arm()
        return result

    def _arm(self) -> None:
        """Make the one timer fire at or before the current deadline."""
        at = self._deadline.deadline_s
        if at is None or not self._admitted:
            return
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = at
            self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        expired = self._deadline.expired(self._loop.time())
        if expired is None:
            self._arm()  # the deadline moved later (or a request is running)
            return
        if expired == "idle":
            self._guard.closed("idle")
            self.force_close()
            return
        self._guard.closed("header_timeout")
        rid = self._guard.next_request_id()
        limit = self._guard.limits.header_timeout_s
        message = f"the request head was not received within {limit:g} s"
        self._guard.local_error(api="openai", path="-", status=408, error=message, request_id=rid)
        self._write_and_close(raw_error_response(408, message, rid))

    def _write_and_close(self, data: bytes) -> None:
        """Send ``data``, then close after a lingering close.

        The write side is shut at once (the client reads the answer, then EOF); what the
        client still sends is discarded for at most :data:`LINGERING_S` before the socket is
        closed. Closing at once would make the kernel answer that late data with a reset,
        which can destroy the answer before the client has read it.
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            self.force_close()
            return
        self._lingering = True
        transport.write(data)
        if transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(LINGERING_S, self.force_close)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's error hook, for parser errors and exceptions escaping a handler."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error response")
        if isinstance(exc, HttpProcessingError) or (status < 500 and exc is not None):
            err = parser_error(exc)
            log.debug("client error %d from %s: %s", err.status, request.remote, type(exc).__name__)
            path = "-"
        elif status == 504:
            err = ApiError(504, "the request timed out")
            path = request.rel_url.path[:200]
        else:
            log.error("unhandled error answering %s", request.rel_url.path[:200], exc_info=exc)
            err = ApiError(500, "internal error")
            path = request.rel_url.path[:200]
        return self._error_response(path, err)

    def _error_response(self, path: str, err: ApiError) -> web.Response:
        """An accounted, connection-closing JSON error in the OpenAI shape."""
        rid = self._guard.next_request_id()
        path = path[:200]
        self._guard.local_error(api="openai", path=path, status=err.status, error=err.message, request_id=rid)
        resp = web.Response(
            status=err.status,
            body=error_body("openai", err.status, err.message),
            content_type="application/json",
            headers={REQUEST_ID_HEADER: rid, BACKEND_HEADER: "none"},
        )
        resp.force_close()
        return resp


class GuardedServer(web.Server):
    """aiohttp's low-level server, making :class:`GuardedRequestHandler` connections."""

    def __init__(self, *args: Any, guard: ClientGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a :class:`GuardedServer` sharing ``guard``."""

    def __init__(self, app: web.Application, *, guard: ClientGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's start-up, merges handler args
        return GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            guard=self._guard,
            **plain._kwargs,
        )
