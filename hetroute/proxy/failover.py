"""Failures before the first byte, and the answer when every attempt failed.

Owns :class:`AttemptFailure` (an attempt failed before any byte reached the client, so the forwarder may
try another backend) and :func:`exhausted_response`. Invariant: an upstream status (5xx, 429) is passed to
the client as the backend sent it; anything else becomes a 502 (504 for a timeout) in the API's own error
shape whose message names only the failure's kind: details such as the backend's host:port stay in the
access log.
"""

from __future__ import annotations

from aiohttp import web

from hetroute.access_log import AccessRecord
from hetroute.proxy.api_errors import BACKEND_HEADER, REQUEST_ID_HEADER, ApiError, error_response
from hetroute.types import Api


class AttemptFailure(Exception):
    """An attempt failed before any byte reached the client (so another backend may be tried).

    ``reason`` starts with the failure's kind (``status 503``, ``first-byte timeout``, an exception's
    name), optionally followed by ``:`` and details; ``status`` and ``body`` are the upstream's answer
    when it sent one.
    """

    def __init__(
        self, reason: str, *, status: int | None = None, body: bytes = b"", timeout: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.timeout = timeout


def exhausted_response(api: Api, failure: AttemptFailure, rec: AccessRecord) -> web.Response:
    """The answer after the last attempt failed with ``failure``; sets ``rec``'s status and error."""
    rec.error = failure.reason
    if failure.status is not None:
        rec.status = failure.status
        headers = {BACKEND_HEADER: rec.backend or "none", REQUEST_ID_HEADER: rec.request_id}
        return web.Response(
            status=failure.status, body=failure.body, content_type="application/json", headers=headers
        )
    status = 504 if failure.timeout else 502
    rec.status = status
    # The reason's details (exception text with the backend's host:port) stay in the log.
    cause = failure.reason.split(":")[0]
    err = ApiError(status, f"no backend could answer ({cause}, {rec.attempts} attempt(s))")
    return error_response(api, err, backend=rec.backend or "none", request_id=rec.request_id)
