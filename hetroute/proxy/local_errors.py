"""The middleware that answers, logs and counts every error the gateway produces itself.

``Expect`` is handled here too (every route's own expect handler is :func:`defer_expect`), so
a refusal is accounted like any other error: ``100 Continue`` is sent only for a body the
gateway would accept (not over ``max_body_bytes``, a supported ``Content-Encoding``).

A handler raises :class:`ApiError` (or aiohttp raises an ``HTTPException``, e.g. for an
unknown ``Expect``); the middleware answers it in the API's shape (TGI paths get TGI's, all
others OpenAI's), closes the connection after a ``408``, and writes one access-log line and one
metric sample per error answer. Requests handed to the forwarder (marked :data:`RELAYED`) are
logged by the forwarder instead, so every request has exactly one access-log line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.typedefs import Middleware

from hetroute.proxy.api_errors import REQUEST_ID_HEADER, ApiError, error_response
from hetroute.proxy.client_limits import ClientGuard
from hetroute.proxy.encodings import check_content_encoding
from hetroute.types import Api, Clock

RELAYED = web.RequestKey("hetroute_relayed", bool)
"""Set on a request once the forwarder owns its accounting."""

TGI_PATHS = frozenset({"/generate", "/generate_stream", "/", "/info"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def api_of_path(path: str) -> Api:
    return "tgi" if path in TGI_PATHS else "openai"


async def defer_expect(request: web.Request) -> None:
    """Every route's expect handler: ``Expect`` is answered by the middleware instead."""
    return None


async def _expect(request: web.Request, max_body_bytes: int) -> None:
    """Answer ``Expect: 100-continue`` only for a body that will be accepted."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise ApiError(417, "unsupported Expect header (only 100-continue)")
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {max_body_bytes}")
    check_content_encoding(request)
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the real response has not started


def error_middleware(guard: ClientGuard, clock: Clock, max_body_bytes: int) -> Middleware:
    """The app's outermost middleware; see the module docstring."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = clock.now()
        guard.request_started()
        try:
            if "Expect" in request.headers:
                await _expect(request, max_body_bytes)
            return await handler(request)
        except ApiError as err:
            error = err
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = ApiError(exc.status, exc.reason)
        finally:
            guard.request_finished()
        api = api_of_path(request.path)
        rid = request.headers.get(REQUEST_ID_HEADER) or guard.next_request_id()
        resp = error_response(api, error, request_id=rid)
        if error.status == 408:
            resp.force_close()
            guard.closed("body_timeout")
        if not request.get(RELAYED, False):
            guard.local_error(
                api=api,
                path=request.path[:200],
                status=error.status,
                error=error.message,
                request_id=rid,
                duration_s=clock.now() - start,
            )
        return resp

    return middleware
