"""One structured (JSON) access-log line per client request.

Owns the record's field set and its serialisation; the destination is a line sink (``hetroute
serve``: a :class:`WholeLineWriter` on stdout with ``ACCESS_BUFFER_BYTES``; each of ``hetroute serve
--workers``: one that writes at most ``PIPE_BUF`` bytes at a time) or, by default, the
``hetroute.access`` logger. Fields: request_id, api, path, model, backend, status, attempts, stream,
ttft_s, itl_s (mean gap between stream events), duration_s, prompt_tokens, completion_tokens, policy,
reason, error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
from collections.abc import Callable
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii

from hetroute.deferred import run_soon

ACCESS_LOGGER = "hetroute.access"


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    api: str
    path: str
    model: str | None = None
    backend: str | None = None
    status: int = 0
    attempts: int = 0
    stream: bool = False
    ttft_s: float | None = None
    itl_s: float | None = None
    duration_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    policy: str | None = None
    reason: str | None = None
    error: str | None = None


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps(separators=...) builds one per call


def _text(value: str | None) -> str:
    return "null" if value is None else encode_basestring_ascii(value)


def _count(value: int | None) -> str:
    return "null" if value is None else str(int(value))


def _time(value: float | None) -> str:
    if value is None:
        return "null"
    seconds = round(float(value), 6)
    return float.__repr__(seconds) if math.isfinite(seconds) else _ENCODE(seconds)


def record_line(r: AccessRecord) -> str:
    """``r`` as one compact JSON object, fields in declaration order: exactly what
    ``json.JSONEncoder(separators=(",", ":")).encode`` makes of its dict with the times rounded to the
    µs (the test checks that), in a third of the time, written out field by field."""
    return (
        f'{{"request_id":{_text(r.request_id)},"api":{_text(r.api)},"path":{_text(r.path)},'
        f'"model":{_text(r.model)},"backend":{_text(r.backend)},"status":{_count(r.status)},'
        f'"attempts":{_count(r.attempts)},"stream":{"true" if r.stream else "false"},'
        f'"ttft_s":{_time(r.ttft_s)},"itl_s":{_time(r.itl_s)},"duration_s":{_time(r.duration_s)},'
        f'"prompt_tokens":{_count(r.prompt_tokens)},"completion_tokens":{_count(r.completion_tokens)},'
        f'"policy":{_text(r.policy)},"reason":{_text(r.reason)},"error":{_text(r.error)}}}'
    )


LineSink = Callable[[str], object]
"""Where finished lines go: ``stream.write`` of a buffered stream, or a logger method."""


ACCESS_BATCH = 64
"""Records an :class:`AccessLog` with a sink holds before it writes them out together."""


class AccessLog:
    """Serialises :class:`AccessRecord` to one JSON line and hands it to a sink.

    ``hetroute serve`` passes a buffered writer on stdout (flushed periodically by the serve
    command, whatever ``PYTHONUNBUFFERED`` says): the ``logging`` machinery costs tens of µs per
    line, a large share of the router's per-request budget. With a sink, records are held and
    written out in order, in batches: once ``ACCESS_BATCH`` are held (after the current event-loop
    step, so that the request that filled the batch does not wait for it:
    :func:`~hetroute.deferred.run_soon`) and whenever :meth:`flush` is called (the app does every
    ``FLUSH_INTERVAL_S`` and at shutdown): encoding a batch in one go costs less CPU than a line
    at a time amid the request path (docs/performance.md). A crash loses at most what is held and
    what the sink buffers. Without a sink, lines go to the ``hetroute.access`` logger at INFO, at
    once. Disabled means no work at all. :meth:`write` takes the record over: nobody may change it
    afterwards.
    """

    def __init__(self, sink: LineSink | None = None, *, enabled: bool = True) -> None:
        self._logger = logging.getLogger(ACCESS_LOGGER)
        self._sink = sink
        self._held: list[AccessRecord] = []
        self.enabled = enabled

    def write(self, record: AccessRecord) -> None:
        if not self.enabled:
            return
        if self._sink is None:
            if self._logger.isEnabledFor(logging.INFO):
                self._logger.info(record_line(record))
            return
        held = self._held
        held.append(record)
        if len(held) == ACCESS_BATCH:  # once per batch: the flush takes everything held by then
            run_soon(self.flush)

    def flush(self) -> None:
        """Write out the held records, oldest first."""
        if not self._held or self._sink is None:
            return
        held, self._held = self._held, []
        sink = self._sink
        for record in held:
            sink(record_line(record) + "\n")


ACCESS_BUFFER_BYTES = 65_536
"""Access-log bytes ``hetroute serve`` (one process) buffers before it writes them to stdout."""


class WholeLineWriter:
    """A line sink for one of several processes that share a file descriptor (``hetroute serve
    --workers``): lines are buffered and written in whole lines, at most ``limit`` bytes per
    ``os.write`` (default ``PIPE_BUF``), so the lines of different processes never interleave
    mid-line: POSIX makes such a write to a pipe atomic, and Linux makes a write to a regular file
    atomic with respect to the shared offset. A single line longer than ``limit`` is written alone
    (then only the file case holds).

    ``write`` never calls ``os.write`` until the buffer would exceed ``limit``; the owner calls
    :meth:`flush` periodically and at shutdown. Like a buffered ``sys.stdout``, a write blocks while
    a pipe reader lags behind by a full pipe.
    """

    __slots__ = ("_fd", "_limit", "_parts", "_size")

    def __init__(self, fd: int, limit: int = select.PIPE_BUF) -> None:
        self._fd = fd
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def write(self, line: str) -> None:
        data = line.encode()
        if self._size + len(data) > self._limit:
            self.flush()
        self._parts.append(data)
        self._size += len(data)

    def flush(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts.clear()
        self._size = 0
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
