"""Incremental server-sent-events parsing for token accounting on the relay's hot path.

Owns: splitting a byte stream into complete SSE events, extracting an event's ``data``,
and the per-stream "taps" that count content events and pick up usage for the OpenAI and
TGI stream formats. Pure (bytes in, bytes and counters out); no I/O, no clock.

Invariants:
- bytes are never rewritten: a tap returns either the chunk it was given or, when it must
  drop the usage event the client did not ask for, the complete events it has seen minus
  that one (a partial trailing event waits for its end);
- JSON is decoded only for the rare events that carry usage/details or an error, never
  for ordinary token events (the relay's CPU budget is per event).
"""

from __future__ import annotations

import json
import re
from typing import Any

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
DONE = b"[DONE]"


class SseSplitter:
    """Accumulates bytes and yields complete raw events (each including its blank line)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    @property
    def pending(self) -> bytes:
        """Bytes of an event that has not ended yet."""
        return self._buf

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" not in buf:
            parts = buf.split(b"\n\n")
            self._buf = parts.pop()
            return [p + b"\n\n" for p in parts]
        events: list[bytes] = []
        start = 0
        for m in _BOUNDARY.finditer(buf):
            events.append(buf[start : m.end()])
            start = m.end()
        self._buf = buf[start:]
        return events


def event_data(raw: bytes) -> bytes | None:
    """The ``data`` of one raw event (multi-line data joined by ``\\n``); None if it has none."""
    if raw.startswith(b"data:"):
        body = raw.rstrip(b"\r\n")
        if b"\n" not in body and b"\r" not in body:  # one data line: the common case
            value = body[5:]
            return value[1:] if value[:1] == b" " else value
    lines: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value[:1] == b" " else value)
    return b"\n".join(lines) if lines else None


def _value_after(data: bytes, key: bytes) -> bytes:
    """The JSON text after ``"key":`` in ``data`` (empty when the key is absent)."""
    at = data.find(key)
    if at < 0:
        return b""
    rest = data[at + len(key) :].lstrip()
    return rest[1:].lstrip() if rest[:1] == b":" else b""


def _object_after(data: bytes, key: bytes) -> bool:
    """True when ``"key":`` in ``data`` is followed by a JSON object (not null)."""
    return _value_after(data, key)[:1] == b"{"


def _plain_events(chunk: bytes) -> bool:
    """Complete LF-delimited events with no [DONE] and no error (a quote inside a JSON string
    is escaped, so ``"error"`` only matches a key)."""
    return chunk.endswith(b"\n\n") and b"\r" not in chunk and DONE not in chunk and b'"error"' not in chunk


def _has_usage_object(chunk: bytes) -> bool:
    return b'"usage":{' in chunk or b'"usage": {' in chunk


def _loads(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class OpenAIStreamTap:
    """Counts content events of an OpenAI chat/completions stream and reads its usage.

    When ``strip_usage`` is set (hetroute itself asked for ``include_usage``), the usage-only
    chunk (``"choices": []``) is taken out of the client's stream.
    """

    __slots__ = ("strip_usage", "events", "prompt_tokens", "completion_tokens", "done", "error", "_split")

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.events = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.done = False
        self.error = False
        self._split = SseSplitter()

    def feed(self, chunk: bytes) -> bytes:
        if not self._split.pending and _plain_events(chunk) and not _has_usage_object(chunk):
            # Fast path: whole events, none carrying usage, [DONE] or an error. Counted
            # without splitting: inside a JSON string a newline is escaped, so "\ndata:"
            # only matches at line starts.
            self.events += chunk.startswith(b"data:") + chunk.count(b"\ndata:")
            return chunk
        had_pending = bool(self._split.pending)
        events = self._split.feed(chunk)
        dropped = False
        kept: list[bytes] = []
        for raw in events:
            if self._handle(raw):
                kept.append(raw)
            else:
                dropped = True
        if not self.strip_usage:
            return chunk
        if not dropped and not had_pending and not self._split.pending:
            return chunk
        return b"".join(kept)

    def flush(self) -> bytes:
        """What is left when the upstream ends (an unterminated last event)."""
        rest = self._split.pending
        self._split = SseSplitter()
        return rest if self.strip_usage else b""

    def _handle(self, raw: bytes) -> bool:
        """Account one event; False when it must not reach the client."""
        data = event_data(raw)
        if data is None:
            return True
        if data == DONE:
            self.done = True
            return True
        if _object_after(data, b'"usage"'):
            obj = _loads(data)
            if obj is not None and isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
                self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
                self.completion_tokens = _int_or_none(usage.get("completion_tokens"))
                if obj.get("choices") == []:
                    return not self.strip_usage
        if data.startswith(b'{"error"') or data.lstrip(b"{ ").startswith(b'"error"'):
            self.error = True
            return True
        self.events += 1
        return True


class TgiStreamTap:
    """Counts token events of a TGI ``/generate_stream`` and reads the final details."""

    __slots__ = ("events", "prompt_tokens", "completion_tokens", "done", "error", "_split")

    def __init__(self) -> None:
        self.events = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.done = False
        self.error = False
        self._split = SseSplitter()

    def feed(self, chunk: bytes) -> bytes:
        if not self._split.pending and _plain_events(chunk):
            n = chunk.startswith(b"data:") + chunk.count(b"\ndata:")
            if chunk.count(b'"generated_text":null') == n:  # token events only, not the last one
                self.events += n
                return chunk
        for raw in self._split.feed(chunk):
            data = event_data(raw)
            if data is None:
                continue
            if _value_after(data, b'"generated_text"')[:1] not in (b"", b"n"):
                self.done = True  # the last event carries the full text (details only if asked)
            if b'"generated_tokens"' in data:
                obj = _loads(data)
                details = obj.get("details") if obj is not None else None
                if isinstance(details, dict):
                    self.completion_tokens = _int_or_none(details.get("generated_tokens"))
                    self.prompt_tokens = _int_or_none(details.get("input_length"))
                    self.done = True
            if b'"token"' in data:
                self.events += 1
            elif b'"error"' in data:
                self.error = True
        return chunk

    def flush(self) -> bytes:
        return b""


def openai_error_event(message: str, err_type: str = "upstream_error", code: int = 502) -> bytes:
    """The OpenAI-style in-stream error (after the first byte), followed by ``[DONE]``."""
    body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}})
    return b"data: " + body.encode() + b"\n\ndata: [DONE]\n\n"


def tgi_error_event(message: str, error_type: str = "generation") -> bytes:
    """TGI's in-stream error event."""
    return b"data: " + json.dumps({"error": message, "error_type": error_type}).encode() + b"\n\n"
