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

The pieces live beside it: the stream relay loop and its in-stream error ending (:mod:`.relay`), the
headers sent each way (:mod:`.headers`), failures before the first byte and the answer when all attempts
failed (:mod:`.failover`), the usage of a non-streaming answer (:mod:`.usage`), and the client sessions
(:mod:`.upstream`, injected at construction). The ledger is reached through the router only.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import NoReturn

import aiohttp
from aiohttp import web

from hetroute.access_log import AccessLog, AccessRecord
from hetroute.admission.gate import AdmissionGate
from hetroute.admission.queue import Shed
from hetroute.backends.health import HealthTracker
from hetroute.errors import NoBackendAvailable, UnknownModel
from hetroute.output_limits import output_cut, output_limit
from hetroute.prefix.hashing import ROUTER_CHUNK_CHARS, text_chunk_hashes
from hetroute.proxy.api_errors import REQUEST_ID_HEADER, ApiError, error_response
from hetroute.proxy.failover import AttemptFailure, exhausted_response
from hetroute.proxy.headers import client_headers, upstream_headers
from hetroute.proxy.held_answers import Answer, HeldAnswers
from hetroute.proxy.http1 import UpstreamError, UpstreamResponse
from hetroute.proxy.protocols import ParsedRequest, TokenEstimator
from hetroute.proxy.relay import end_with_error, pump
from hetroute.proxy.sse import OpenAIStreamTap, TgiStreamTap
from hetroute.proxy.upstream import Upstream
from hetroute.proxy.usage import usage_of
from hetroute.proxy.watchdog import Watchdog, Watchdogs
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.telemetry import RequestOutcome, Telemetry
from hetroute.types import Clock, OutputLengthPredictor, RequestFeatures


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


@dataclass(slots=True)
class Attempt:
    """One try of a client request on the backend its ticket names: what every step reads and records."""

    request: web.Request
    parsed: ParsedRequest
    ticket: Ticket
    rec: AccessRecord
    start_s: float
    """When the client request reached the forwarder (its clock): TTFT and duration count from here."""
    watchdog: Watchdog
    """First-byte (or whole-request), then idle deadline of this attempt; closed when it ends."""


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
        upstream: Upstream,
        admission: AdmissionGate | None = None,
    ) -> None:
        """``upstream``: the client sessions, opened by the app before the first request;
        ``admission``: the queue in front of the router when it is enabled."""
        self.router = router
        self.health = health
        self.telemetry = telemetry
        self.access_log = access_log
        self.estimator = estimator
        self.predictor = predictor
        self.answers = HeldAnswers(estimator, predictor)
        self.clock = clock
        self.settings = settings
        self.upstream = upstream
        self._ids = itertools.count(1)
        self._watchdogs = Watchdogs()
        self._id_prefix = id_prefix
        self.admission = admission

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
        limit = output_limit(parsed.max_tokens, self.router.context_tokens(model), input_est)
        predicted = self.predictor.predict(model, input_est, limit)
        features = self._features(request, parsed, rid, model, input_est, predicted)
        rec.prompt_tokens = input_est
        tried: list[int] = []
        failure: AttemptFailure | None = None
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
                limit_s = self.settings.first_byte_s if parsed.stream else self.settings.request_s
                try:
                    attempt = Attempt(request, parsed, ticket, rec, start, self._watchdogs.start(limit_s))
                    return await self._attempt(attempt)
                except AttemptFailure as f:
                    failure = f
                finally:
                    self.router.release(ticket)
                    if self.admission is not None:
                        self.admission.wake()  # a completion frees capacity for waiting requests
            assert failure is not None
            return exhausted_response(parsed.api, failure, rec)
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
        header = prefix.config.session_header  # "" turns session affinity off, `user` included
        session = (request.headers.get(header, "") or parsed.user) if header else ""
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
            RequestOutcome(
                rec.backend or "none",
                rec.model or "",
                rec.api,
                rec.status,
                rec.policy or "",
                rec.duration_s,
                rec.ttft_s if rec.stream else None,
                rec.itl_s,
                rec.prompt_tokens or 0,
                rec.completion_tokens or 0,
            )
        )
        self.access_log.write(rec)

    async def _attempt(self, a: Attempt) -> web.StreamResponse:
        """Send ``a`` upstream and answer the client; AttemptFailure when another backend may be tried."""
        parsed, watchdog = a.parsed, a.watchdog
        i = a.ticket.backend_index
        resp: UpstreamResponse | None = None
        sent_at = self.clock.now()
        try:
            try:
                resp = await self.upstream.post(
                    self.router.backends[i].url,
                    parsed.upstream_path,
                    parsed.body,
                    upstream_headers(a.request.headers, a.rec.request_id),
                )
                status = resp.status
                if status >= 500 or status == 429:
                    body = await resp.read()
                    if status != 429:
                        self.health.record_failure(i, f"status {status}")
                    raise AttemptFailure(f"status {status}", status=status, body=body)
                if not parsed.stream or status != 200:
                    return self._complete(a, resp, await resp.read())
                first = await resp.readany()
            except asyncio.CancelledError as exc:
                if not watchdog.fired():
                    raise
                if watchdog.reason is not None:
                    raise ApiError(503, watchdog.reason) from exc
                if parsed.stream:
                    self.health.record_failure(i, "first-byte timeout")
                    raise AttemptFailure("first-byte timeout", timeout=True) from exc
                self._request_timeout(i, sent_at, a.rec)
            except (UpstreamError, OSError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                self.health.record_failure(i, reason)
                raise AttemptFailure(reason) from exc
            watchdog.rearm(self.settings.idle_s)
            return await self._stream(a, resp, first)
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
            raise AttemptFailure(reason, timeout=True)
        rec.error = reason
        raise ApiError(504, f"the request did not complete within {self.settings.request_s:g} s")

    def _learn(self, a: Attempt, prompt: int | None, completion: int | None, *, streamed: bool) -> None:
        """A successful answer teaches the token estimator and the output-length predictor (held and
        taken in batches, :class:`HeldAnswers`; an output that filled the backend's context window is
        marked cut, ``output_cut``) and, through ``router.complete``, the backend's live latency
        model."""
        rec = a.rec
        if prompt is not None:
            rec.prompt_tokens = prompt
        if completion is not None:
            rec.completion_tokens = completion
            self.router.complete(a.ticket, completion, input_tokens=prompt, streamed=streamed)
        window = self.router.backends[a.ticket.backend_index].max_model_len
        cut = completion is not None and output_cut(window, rec.prompt_tokens or 0, completion)
        self.answers.add(
            Answer(rec.model or "", a.parsed.prompt_chars, prompt, rec.prompt_tokens or 0, completion, cut)
        )

    def _complete(self, a: Attempt, resp: UpstreamResponse, body: bytes) -> web.Response:
        """The client's answer to a non-streaming request (or a stream's non-200), read whole."""
        now = self.clock.now()
        ticket, rec = a.ticket, a.rec
        self.router.first_token(ticket, now)
        rec.ttft_s, rec.status = now - a.start_s, resp.status
        self.health.record_success(ticket.backend_index)
        if resp.status == 200:
            self._learn(a, *usage_of(a.parsed.api, body), streamed=False)
        headers = client_headers(resp.headers, ticket.backend_name, rec.request_id)
        return web.Response(status=resp.status, body=body, headers=headers)

    async def _stream(self, a: Attempt, resp: UpstreamResponse, first: bytes) -> web.StreamResponse:
        """Relay a 200 stream whose first chunk is ``first``; errors after it end the stream in-band."""
        parsed, ticket, rec, watchdog = a.parsed, a.ticket, a.rec, a.watchdog
        out = web.StreamResponse(
            status=resp.status, headers=client_headers(resp.headers, ticket.backend_name, rec.request_id)
        )
        tap: OpenAIStreamTap | TgiStreamTap = (
            OpenAIStreamTap(strip_usage=parsed.strip_usage) if parsed.api == "openai" else TgiStreamTap()
        )
        router = self.router
        rec.status = resp.status
        try:
            await out.prepare(a.request)
            first_at = self.clock.now()
            router.first_token(ticket, first_at)
            rec.ttft_s = first_at - a.start_s
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
        error, client_gone = await pump(
            out, resp, tap, ticket, watchdog, router.observe_generated, self.settings.idle_s
        )
        if client_gone:
            rec.status, rec.error = 499, "client disconnected"
            return out
        if error is None and not tap.done and not tap.error:
            error = "upstream stream ended early"
        if error is not None:
            rec.status, rec.error = 502, error
            if watchdog.reason is None:
                self.health.record_failure(ticket.backend_index, error)
            else:  # ended by the gateway's shutdown, not by the backend
                rec.status = 503
            await end_with_error(out, parsed.api, error, shutdown=watchdog.reason is not None)
            return out
        self.health.record_success(ticket.backend_index)
        end_at = self.clock.now()
        if tap.events > 1:
            rec.itl_s = (end_at - first_at) / (tap.events - 1)
        self._learn(
            a,
            tap.prompt_tokens,
            tap.completion_tokens if tap.completion_tokens is not None else tap.events,
            streamed=True,
        )
        try:
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            rec.status, rec.error = 499, "client disconnected"
        return out
