"""The streaming forwarder: route → send upstream → relay, with fail-over before the first byte.

Owns the per-request proxy loop (house style §9):

- a failure before any byte reached the client (connection refused/reset, 5xx, 429,
  a stream's first-byte timeout) is retried on another eligible backend, at most
  ``max_attempts`` tries in all;
- a non-streaming request is bounded by ``request_s`` as a whole (its engine sends nothing
  before the end). Expiry answers ``504`` and is not retried (the engine accepted the work)
  unless ``retry_request_timeouts``; it counts as a backend failure only when that backend
  completed nothing else meanwhile (a slow request does not eject a working backend);
- a pooled keep-alive socket the upstream had already closed is retried at
  once on a fresh connection (nothing was sent);
- streams are relayed chunk by chunk (``readany``) without buffering; after the first
  byte an upstream failure ends the client's stream with an error event in the API's own
  format, never a hang (``idle_s`` bounds every gap);
- the client's disconnect (handler cancellation or a failed write) closes the upstream
  connection at once, which makes the engine abort the request;
- every dispatch is released exactly once (``router.release`` in ``finally``), and the
  health, predictor, telemetry and access-log hooks run on every outcome.

Non-streaming answers are read whole (they are one JSON object, needed for ``usage``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any, NoReturn

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from hetroute.access_log import AccessLog, AccessRecord
from hetroute.admission.gate import AdmissionGate
from hetroute.admission.queue import Shed
from hetroute.backends.health import HealthTracker
from hetroute.errors import NoBackendAvailable, UnknownModel
from hetroute.prefix.hashing import ROUTER_CHUNK_CHARS, text_chunk_hashes
from hetroute.proxy.api_errors import BACKEND_HEADER, REQUEST_ID_HEADER, ApiError, error_response
from hetroute.proxy.hop_by_hop import strip_hop_by_hop
from hetroute.proxy.protocols import ParsedRequest, TokenEstimator
from hetroute.proxy.sse import OpenAIStreamTap, TgiStreamTap, openai_error_event, tgi_error_event
from hetroute.proxy.watchdog import Watchdog, Watchdogs
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.telemetry import Telemetry
from hetroute.types import Clock, OutputLengthPredictor, RequestFeatures

# The body sent upstream is the decoded one (hetroute.proxy.encodings): no Content-Encoding.
_DROP_REQUEST = ("host", "content-length", "content-encoding", "accept-encoding", "expect", REQUEST_ID_HEADER)
_DROP_RESPONSE = ("content-length", "date", "server", BACKEND_HEADER)


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    connect_s: float
    first_byte_s: float
    idle_s: float
    max_attempts: int
    request_s: float = 600.0
    """Whole-request deadline of a non-streaming request (its engine answers only at the end)."""
    retry_request_timeouts: bool = False
    """Retry a non-streaming request elsewhere after ``request_s`` (the engine's work is lost)."""


class _Failure(Exception):
    """An attempt failed before any byte reached the client (so another backend may be tried)."""

    def __init__(
        self, reason: str, *, status: int | None = None, body: bytes = b"", timeout: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.timeout = timeout


_DECODER = json.JSONDecoder()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _usage_of(api: str, body: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a non-streaming answer, None where absent.

    Only the small ``usage`` (OpenAI) or ``details`` (TGI) object is decoded, not the whole answer.
    """
    key = b'"details"' if api == "tgi" else b'"usage"'
    at = body.rfind(key)
    if at < 0:
        return None, None
    start = body.find(b"{", at + len(key), at + len(key) + 8)
    if start < 0:
        return None, None
    try:
        obj, _ = _DECODER.raw_decode(body[start:].decode("utf-8", "replace"))
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    if api == "tgi":
        prefill = obj.get("prefill")
        return (len(prefill) if isinstance(prefill, list) and prefill else None), _int(
            obj.get("generated_tokens")
        )
    return _int(obj.get("prompt_tokens")), _int(obj.get("completion_tokens"))


_OBSERVE_EVERY = 4
"""Report generated tokens to the ledger every few events (exact at the end): it is numpy work."""


class Forwarder:
    """Relays one client request to the backends chosen by the router."""

    def __init__(
        self,
        *,
        router: Router,
        health: HealthTracker,
        telemetry: Telemetry,
        access_log: AccessLog,
        estimator: TokenEstimator,
        predictor: OutputLengthPredictor,
        clock: Clock,
        settings: ForwardSettings,
        id_prefix: str,
    ) -> None:
        self.router = router
        self.health = health
        self.telemetry = telemetry
        self.access_log = access_log
        self.estimator = estimator
        self.predictor = predictor
        self.clock = clock
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None  # pooled; set by the app's cleanup_ctx
        self.fresh_session: aiohttp.ClientSession | None = None  # one new connection per request
        self._ids = itertools.count(1)
        self._watchdogs = Watchdogs()
        self._id_prefix = id_prefix
        self.admission: AdmissionGate | None = None  # set by the app when the queue is enabled

    def abort_in_flight(self, reason: str) -> int:
        """End every request in flight now (shutdown after the grace period): streams get the
        API's error event with ``reason``, requests before their first byte a ``503``; no backend
        failure is recorded. Returns how many attempts were aborted."""
        return self._watchdogs.expire_all(reason)

    def next_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"

    async def relay(self, request: web.Request, parsed: ParsedRequest, model: str) -> web.StreamResponse:
        """Route and relay ``parsed``; always returns a response (or re-raises cancellation)."""
        rid = request.headers.get(REQUEST_ID_HEADER) or self.next_request_id()
        rec = AccessRecord(rid, parsed.api, request.path, model=model, stream=parsed.stream)
        start = self.clock.now()
        input_est = self.estimator.estimate(model, parsed)
        predicted = self.predictor.predict(model, input_est, parsed.max_tokens)
        features = self._features(request, parsed, rid, model, input_est, predicted)
        rec.prompt_tokens = input_est
        tried: list[int] = []
        failure: _Failure | None = None
        try:
            while len(tried) < self.settings.max_attempts:
                try:
                    if not tried and self.admission is not None:  # the queue is only before the 1st try
                        ticket = await self.admission.acquire(features, request.headers)
                    else:
                        ticket = self.router.route(features, exclude=tried)
                except Shed as exc:
                    raise ApiError(429, str(exc), code=exc.reason) from exc
                except UnknownModel as exc:
                    raise ApiError(404, str(exc), param="model", code="model_not_found") from exc
                except NoBackendAvailable as exc:
                    if failure is None:
                        raise ApiError(503, str(exc)) from exc
                    break
                if failure is not None and rec.backend is not None:
                    self.telemetry.retry(rec.backend, failure.reason.split(":")[0])
                tried.append(ticket.backend_index)
                rec.backend, rec.policy, rec.reason = ticket.backend_name, ticket.policy, ticket.reason
                rec.attempts = len(tried)
                try:
                    return await self._attempt(request, parsed, ticket, rec, start)
                except _Failure as f:
                    failure = f
                finally:
                    self.router.release(ticket)
                    if self.admission is not None:
                        self.admission.wake()  # a completion frees capacity for waiting requests
            assert failure is not None
            return self._exhausted(parsed, failure, rec)
        except ApiError as err:
            rec.status, rec.error = err.status, err.message
            resp = error_response(parsed.api, err, backend=rec.backend or "none", request_id=rid)
            if isinstance(err.__cause__, Shed):
                resp.headers["Retry-After"] = str(err.__cause__.retry_after_s)
            return resp
        except asyncio.CancelledError:
            rec.status, rec.error = 499, "client disconnected"
            raise
        finally:
            rec.duration_s = self.clock.now() - start
            self._finish(rec)

    def _features(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        rid: str,
        model: str,
        input_est: int,
        predicted: int,
    ) -> RequestFeatures:
        """The router's view of the request; with prefix routing on, its prompt's chunk hashes (256
        characters each, ≈ 256 / chars-per-token tokens) and its session key (header, else ``user``)."""
        prefix = self.router.prefix
        if prefix is None:
            return RequestFeatures(
                rid, model, parsed.api, input_est, parsed.max_tokens, predicted, parsed.stream
            )
        header = prefix.config.session_header
        session = (request.headers.get(header, "") if header else "") or parsed.user
        return RequestFeatures(
            rid,
            model,
            parsed.api,
            input_est,
            parsed.max_tokens,
            predicted,
            parsed.stream,
            text_chunk_hashes(parsed.prefix_text) if parsed.prefix_text else (),
            ROUTER_CHUNK_CHARS / self.estimator.chars_per_token(model),
            session[:256],
        )

    def _finish(self, rec: AccessRecord) -> None:
        self.telemetry.observe_request(
            backend=rec.backend or "none",
            model=rec.model or "",
            api=rec.api,
            status=rec.status,
            policy=rec.policy or "",
            duration_s=rec.duration_s,
            ttft_s=rec.ttft_s if rec.stream else None,
            itl_s=rec.itl_s,
            prompt_tokens=rec.prompt_tokens or 0,
            completion_tokens=rec.completion_tokens or 0,
        )
        self.access_log.write(rec)

    def _exhausted(self, parsed: ParsedRequest, failure: _Failure, rec: AccessRecord) -> web.Response:
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
        return error_response(parsed.api, err, backend=rec.backend or "none", request_id=rec.request_id)

    def _upstream_headers(self, request: web.Request, rid: str) -> CIMultiDict[str]:
        headers = CIMultiDict(request.headers)  # a C-level copy, then drop the few bad ones
        strip_hop_by_hop(headers, _DROP_REQUEST)
        headers.setdefault("Content-Type", "application/json")  # the body is validated JSON
        headers["Accept-Encoding"] = "identity"  # we parse the stream, so no compression upstream
        headers[REQUEST_ID_HEADER] = rid
        return headers

    def _client_headers(self, resp: aiohttp.ClientResponse, backend: str, rid: str) -> CIMultiDict[str]:
        headers = CIMultiDict(resp.headers)
        strip_hop_by_hop(headers, _DROP_RESPONSE)
        headers[BACKEND_HEADER] = backend
        headers[REQUEST_ID_HEADER] = rid
        return headers

    async def _open(self, url: str, body: bytes, headers: CIMultiDict[str]) -> aiohttp.ClientResponse:
        assert self.session is not None and self.fresh_session is not None, (
            "the app's sessions are not running"
        )
        try:
            return await self.session.post(url, data=body, headers=headers)
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            aiohttp.ClientConnectionResetError,
        ) as exc:
            # A refused connection is a real failure. A pooled keep-alive socket that the
            # upstream had closed (llama.cpp after every stream: "Cannot write to closing
            # transport", ServerDisconnected) failed before anything was answered: retry once
            # on a connection that is certainly new (the pool may hold more stale ones).
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise
            return await self.fresh_session.post(url, data=body, headers=headers)

    async def _attempt(
        self, request: web.Request, parsed: ParsedRequest, ticket: Ticket, rec: AccessRecord, start: float
    ) -> web.StreamResponse:
        spec = self.router.backends[ticket.backend_index]
        i = ticket.backend_index
        resp: aiohttp.ClientResponse | None = None
        sent_at = self.clock.now()
        limit_s = self.settings.first_byte_s if parsed.stream else self.settings.request_s
        watchdog = self._watchdogs.start(limit_s)
        try:
            try:
                resp = await self._open(
                    spec.url + parsed.upstream_path,
                    parsed.body,
                    self._upstream_headers(request, rec.request_id),
                )
                status = resp.status
                if status >= 500 or status == 429:
                    body = await resp.read()
                    if status != 429:
                        self.health.record_failure(i, f"status {status}")
                    raise _Failure(f"status {status}", status=status, body=body)
                if not parsed.stream or status != 200:
                    body = await resp.read()
                    return self._complete(parsed, ticket, rec, resp, body, start)
                first = await resp.content.readany()
            except asyncio.CancelledError as exc:
                if not watchdog.fired():
                    raise
                if watchdog.reason is not None:
                    raise ApiError(503, watchdog.reason) from exc
                if parsed.stream:
                    self.health.record_failure(i, "first-byte timeout")
                    raise _Failure("first-byte timeout", timeout=True) from exc
                self._request_timeout(i, sent_at, rec)
            except (aiohttp.ClientError, OSError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                self.health.record_failure(i, reason)
                raise _Failure(reason) from exc
            watchdog.rearm(self.settings.idle_s)
            return await self._stream(request, parsed, ticket, rec, resp, first, start, watchdog)
        finally:
            watchdog.close()
            if resp is not None:
                resp.close()  # no-op when the payload was read; aborts the upstream otherwise

    def _request_timeout(self, i: int, sent_at: float, rec: AccessRecord) -> NoReturn:
        """A non-streaming request ran past ``request_s``; raises what ``relay`` answers."""
        reason = f"request timeout ({self.settings.request_s:g} s)"
        if not self.health.succeeded_since(i, sent_at):
            self.health.record_failure(i, reason)  # no sign of life from the backend meanwhile
        if self.settings.retry_request_timeouts:
            raise _Failure(reason, timeout=True)
        rec.error = reason
        raise ApiError(504, f"the request did not complete within {self.settings.request_s:g} s")

    def _learn(
        self,
        parsed: ParsedRequest,
        rec: AccessRecord,
        ticket: Ticket,
        prompt: int | None,
        completion: int | None,
        *,
        streamed: bool,
    ) -> None:
        """A successful answer teaches the token estimator, the output-length predictor and, through
        ``router.complete``, the backend's live latency model."""
        model = rec.model or ""
        self.estimator.observe(model, parsed.prompt_chars, prompt)
        if prompt is not None:
            rec.prompt_tokens = prompt
        if completion is not None:
            rec.completion_tokens = completion
            self.predictor.observe(model, rec.prompt_tokens or 0, completion)
            self.router.complete(ticket, completion, input_tokens=prompt, streamed=streamed)

    def _complete(
        self,
        parsed: ParsedRequest,
        ticket: Ticket,
        rec: AccessRecord,
        resp: aiohttp.ClientResponse,
        body: bytes,
        start: float,
    ) -> web.Response:
        now = self.clock.now()
        self.router.ledger.first_token(ticket, now)
        rec.ttft_s, rec.status = now - start, resp.status
        self.health.record_success(ticket.backend_index)
        if resp.status == 200:
            self._learn(parsed, rec, ticket, *_usage_of(parsed.api, body), streamed=False)
        headers = self._client_headers(resp, ticket.backend_name, rec.request_id)
        return web.Response(status=resp.status, body=body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        ticket: Ticket,
        rec: AccessRecord,
        resp: aiohttp.ClientResponse,
        first: bytes,
        start: float,
        watchdog: Watchdog,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=resp.status, headers=self._client_headers(resp, ticket.backend_name, rec.request_id)
        )
        tap: OpenAIStreamTap | TgiStreamTap = (
            OpenAIStreamTap(strip_usage=parsed.strip_usage) if parsed.api == "openai" else TgiStreamTap()
        )
        ledger = self.router.ledger
        rec.status = resp.status
        try:
            await out.prepare(request)
            first_at = self.clock.now()
            ledger.first_token(ticket, first_at)
            rec.ttft_s = first_at - start
            data = tap.feed(first)
            if data:
                await out.write(data)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            rec.status, rec.error = 499, "client disconnected"
            return out
        except asyncio.CancelledError:
            if not watchdog.fired():
                raise
            rec.status, rec.error = 499, "client did not read the first chunk in time"
            return out
        error, client_gone = await self._pump(out, resp, tap, ticket, watchdog)
        if client_gone:
            rec.status, rec.error = 499, "client disconnected"
            return out
        if error is None and not tap.done and not tap.error:
            error = "upstream stream ended early"
        if error is not None:
            rec.status, rec.error = 502, error
            if watchdog.reason is None:
                self.health.record_failure(ticket.backend_index, error)
                openai_event, tgi_type = openai_error_event(error), "upstream"
            else:  # ended by the gateway's shutdown, not by the backend
                rec.status = 503
                openai_event, tgi_type = openai_error_event(error, "service_unavailable", 503), "unhealthy"
            event = openai_event if parsed.api == "openai" else tgi_error_event(error, tgi_type)
            try:
                await out.write(event)
                await out.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                pass
            return out
        self.health.record_success(ticket.backend_index)
        end_at = self.clock.now()
        if tap.events > 1:
            rec.itl_s = (end_at - first_at) / (tap.events - 1)
        self._learn(
            parsed,
            rec,
            ticket,
            tap.prompt_tokens,
            tap.completion_tokens if tap.completion_tokens is not None else tap.events,
            streamed=True,
        )
        try:
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            rec.status, rec.error = 499, "client disconnected"
        return out

    async def _pump(
        self,
        out: web.StreamResponse,
        resp: aiohttp.ClientResponse,
        tap: OpenAIStreamTap | TgiStreamTap,
        ticket: Ticket,
        watchdog: Watchdog,
    ) -> tuple[str | None, bool]:
        """Relay until EOF: (upstream error or None, client gone)."""
        loop = asyncio.get_running_loop()
        observe = self.router.ledger.observe_generated
        content = resp.content
        write = out.write
        feed = tap.feed
        reported = 0
        try:
            while True:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientError, OSError) as exc:
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
                if tap.events - reported >= _OBSERVE_EVERY:
                    reported = tap.events
                    observe(ticket, reported)
        except asyncio.CancelledError:
            if watchdog.fired():
                return watchdog.reason or f"upstream idle for more than {self.settings.idle_s:g} s", False
            raise
        observe(ticket, tap.events)
        rest = tap.flush()
        if rest:
            try:
                await write(rest)
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                return None, True
        return None, False
