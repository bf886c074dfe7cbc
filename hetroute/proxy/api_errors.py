"""Error responses in each client API's own shape.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; TGI: ``{"error", "error_type"}``.
Every locally produced error goes through :func:`error_response`, so a client library
always sees the shape it knows. Owns no state.
"""

from __future__ import annotations

import json

from aiohttp import web

from hetroute.types import Api

BACKEND_HEADER = "x-hetroute-backend"
WORKER_HEADER = "x-hetroute-worker"
"""Which ``hetroute serve --workers`` process answered (only when there are several)."""
REQUEST_ID_HEADER = "x-request-id"

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_TGI_TYPES = {
    400: "validation",
    401: "unauthorized",
    404: "not_found",
    413: "validation",
    422: "validation",
    429: "overloaded",
    502: "upstream",
    503: "unhealthy",
    504: "timeout",
}


class ApiError(Exception):
    """A client-visible error; ``param`` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(
    api: Api, status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    if api == "tgi":
        return json.dumps({"error": message, "error_type": _TGI_TYPES.get(status, "error")}).encode()
    err = {
        "message": message,
        "type": _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code if code is not None else status,
    }
    return json.dumps({"error": err}).encode()


def error_response(api: Api, err: ApiError, *, backend: str = "none", request_id: str = "") -> web.Response:
    headers = {BACKEND_HEADER: backend}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return web.Response(
        status=err.status,
        body=error_body(api, err.status, err.message, err.param, err.code),
        content_type="application/json",
        headers=headers,
    )
