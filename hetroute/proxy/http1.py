"""A lean HTTP/1.1 client for the forwarder's upstream ``POST``: pooled keep-alive asyncio protocols.

Owns :class:`Http1Pool` (connections per origin, LIFO, idle ones closed after ``idle_s``) and
:class:`UpstreamResponse` (status, headers, body read whole or chunk by chunk). It replaces aiohttp's
client on the hot path only, where that cost ≈ 60 µs of CPU per request against ≈ 10 µs for this
(``benchmarks/overhead.py``); probes, scrapes and ``/info`` keep aiohttp's session.

Contracts:

- a response's body is framed by ``Content-Length``, ``Transfer-Encoding: chunked`` (RFC 9112 §7.1;
  chunk extensions and trailers are read and dropped) or the connection's end; ``1xx`` heads are
  skipped, ``204``/``304`` have no body;
- a connection goes back to the pool only after its response was read to the end without error and
  neither side said ``Connection: close``; :meth:`UpstreamResponse.close` before that closes it (the
  engine sees the disconnect and aborts the request);
- nothing is decompressed and no redirect is followed: the bytes the engine sent are what the relay sees;
- at most ``HIGH_WATER_BYTES`` of body are buffered: beyond, reading from the socket pauses until the
  reader catches up (a slow client slows the engine's socket, not the router's memory);
- every failure is an :class:`UpstreamError`: :class:`UpstreamConnectError` (no connection; a timeout
  after ``connect_s``), :class:`UpstreamDisconnected` (closed before a response head: nothing was
  answered, so the caller may retry), :class:`UpstreamProtocolError` (a malformed head or framing) and
  :class:`UpstreamPayloadError` (the body ended early).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from multidict import CIMultiDict, CIMultiDictProxy

HIGH_WATER_BYTES = 256 * 1024
"""Body bytes buffered per response before the socket's reading pauses."""
MAX_HEAD_BYTES = 64 * 1024
"""A response head (status line and header fields) longer than this is a protocol error."""
MAX_CHUNK_LINE_BYTES = 4096
"""A chunk-size line (with extensions) longer than this is a protocol error."""

_HEX_DIGITS = b"0123456789abcdefABCDEF"
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
"""A response's headers until its head arrived (read-only, so one is shared)."""
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


def _find(buf: bytes, sep: bytes, limit: int, what: str) -> int:
    """Where ``sep`` starts in ``buf``; -1 while it may still come; a protocol error naming ``what``
    when ``buf`` is already longer than ``limit`` without it."""
    end = buf.find(sep)
    if end < 0 and len(buf) > limit:
        raise UpstreamProtocolError(f"{what} is too long")
    return end


class UpstreamError(Exception):
    """Any failure of an upstream exchange."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, TLS failure, or not within ``connect_s``)."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed before a response head arrived."""


class UpstreamProtocolError(UpstreamError):
    """The response head or its framing was malformed."""


class UpstreamPayloadError(UpstreamError):
    """The connection ended, or failed, before the response body was complete."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend's base URL points: the pool key, the ``Host`` header and the path prefix."""

    scheme: str
    host: str
    port: int
    host_header: str
    path_prefix: str


def parse_origin(base_url: str) -> Origin:
    """The origin of ``base_url`` (``http`` or ``https``; a path is kept as a prefix)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == default else f"{shown}:{port}"
    return Origin(parts.scheme, host, port, host_header, parts.path.rstrip("/"))


class UpstreamResponse:
    """One response: ``status`` and ``headers`` once the head arrived; the body through :meth:`readany`
    (what has arrived, ``b""`` at the end) or :meth:`read` (all of it). Call :meth:`close` when done."""

    __slots__ = (
        "_conn", "_chunks", "_buffered", "_waiter", "_error", "_eof", "_head_future", "status", "headers"
    )  # fmt: skip

    def __init__(self, conn: _Connection, head_future: asyncio.Future[None]) -> None:
        self._conn: _Connection | None = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._eof = False
        self._head_future = head_future
        self.status = 0
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; ``b""`` at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._buffered > HIGH_WATER_BYTES and self._conn is not None:
            self._conn.resume()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The whole body (what is left of it)."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Hand the connection back to its pool if the body was read whole and it may be reused; else
        close it. Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reusable=self._eof and self._error is None and not self._chunks)

    # -- fed by the connection --------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _body(self, data: bytes) -> bool:
        """Buffer ``data``; True when reading should pause."""
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        return self._buffered > HIGH_WATER_BYTES

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._eof or self._error is not None:
            return
        self._error = error
        if not self._head_future.done():
            self._head_future.set_exception(error)
        self._wake()


class _Connection(asyncio.Protocol):
    """One upstream socket: parses the response to the request last written on it."""

    def __init__(self, pool: Http1Pool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since_s = 0.0
        self._resp: UpstreamResponse | None = None
        self._buf = b""
        self._state = _DONE
        self._left = 0
        self._keep_alive = True
        self._paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self._resp
        if resp is None:
            return
        if self._state == _HEAD:
            if self._buf:
                resp._fail(UpstreamProtocolError("the connection closed inside the response head"))
            else:
                resp._fail(UpstreamDisconnected("the server closed the connection before answering"))
        elif self._state == _UNTIL_CLOSE and exc is None:
            self._state = _DONE
            resp._end()
        elif self._state != _DONE:
            detail = f": {exc}" if exc is not None else ""
            resp._fail(UpstreamPayloadError(f"the response body ended early{detail}"))

    def data_received(self, data: bytes) -> None:
        resp = self._resp
        if resp is None or self._state == _DONE:  # nothing was asked: the connection is out of step
            self._abort()
            return
        if self._state == _CHUNK_SIZE and not self._buf:
            # A streaming engine's usual segment, one whole chunk (size line, one event, CRLF) and
            # nothing after it: the step _parse takes for it, without its loop.
            end = data.find(b"\r\n", 0, 18)
            if end > 0:
                size = data[:end]
                if not size.strip(_HEX_DIGITS):
                    start = end + 2
                    stop = start + int(size, 16)
                    if stop > start and len(data) == stop + 2 and data.endswith(b"\r\n"):
                        self._pause_if(resp._body(data[start:stop]))
                        return
        try:
            self._parse(resp, self._buf + data if self._buf else data)
        except UpstreamError as err:
            resp._fail(err)
            self._abort()

    # -- request / response ------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        """Write one request; its response (the head is awaited by the pool)."""
        assert self.transport is not None
        future = asyncio.get_running_loop().create_future()
        resp = UpstreamResponse(self, future)
        self._resp, self._buf, self._state, self._keep_alive = resp, b"", _HEAD, True
        self.transport.write(head + body)
        return resp

    def finish(self, *, reusable: bool) -> None:
        """The response is done with: back to the pool, or closed."""
        self._resp = None
        if reusable and self._keep_alive and not self.closed and self._state == _DONE and not self._buf:
            if self._paused:
                self.resume()
            self._pool.release(self)
        else:
            self._abort()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _parse(self, resp: UpstreamResponse, buf: bytes) -> None:
        """Advance the response's state machine over ``buf`` (RFC 9112 §6, §7.1). A chunk that arrived
        whole (a streaming engine's usual segment: size line, one event, CRLF) takes one step."""
        while buf:
            state = self._state
            if state == _CHUNK_SIZE:
                end = _find(buf, b"\r\n", MAX_CHUNK_LINE_BYTES, "a chunk-size line")
                if end < 0:
                    break
                size = buf[:end]
                if b";" in size:  # chunk extensions are ignored
                    size = size.split(b";", 1)[0].rstrip(b" \t")
                if not size or size.strip(_HEX_DIGITS):
                    raise UpstreamProtocolError("a chunk size is not hexadecimal")
                left = int(size, 16)
                start = end + 2
                stop = start + left
                if left and len(buf) >= stop + 2:  # the whole chunk is here
                    if buf[stop : stop + 2] != b"\r\n":
                        raise UpstreamProtocolError("a chunk does not end with CRLF")
                    self._pause_if(resp._body(buf[start:stop]))
                    buf = buf[stop + 2 :]
                    continue
                self._left = left
                buf = buf[start:]
                self._state = _CHUNK_DATA if left else _TRAILERS
            elif state in (_LENGTH, _CHUNK_DATA):
                take = buf if len(buf) <= self._left else buf[: self._left]
                self._left -= len(take)
                buf = buf[len(take) :]
                self._pause_if(resp._body(take))
                if self._left == 0:
                    if state == _LENGTH:
                        self._done(resp, buf)
                        return
                    self._state = _CHUNK_CRLF
            elif state == _UNTIL_CLOSE:
                self._pause_if(resp._body(buf))
                buf = b""
            elif state == _HEAD:
                end = _find(buf, b"\r\n\r\n", MAX_HEAD_BYTES, "the response head")
                if end < 0:
                    break
                self._head(resp, buf[:end])
                buf = buf[end + 4 :]
                if self._state == _DONE:  # a body-less answer (204, 304, Content-Length: 0)
                    self._done(resp, buf)
                    return
            elif state == _CHUNK_CRLF:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise UpstreamProtocolError("a chunk does not end with CRLF")
                buf = buf[2:]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = _find(buf, b"\r\n", MAX_HEAD_BYTES, "the trailer section")
                if end < 0:
                    break
                buf = buf[end + 2 :]
                if end == 0:  # the empty line ends the message
                    self._done(resp, buf)
                    return
            else:  # _DONE: bytes after the end of the response
                raise UpstreamProtocolError("bytes after the end of the response")
        self._buf = buf

    def _head(self, resp: UpstreamResponse, head: bytes) -> None:
        """Parse a response head; set the body's framing, or skip a 1xx head."""
        lines = head.decode("utf-8", "surrogateescape").split("\r\n")  # as aiohttp decodes heads
        status_line = lines[0]
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise UpstreamProtocolError("malformed response status line")
        status = int(code)
        fields: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise UpstreamProtocolError("malformed response header field")
            fields.append((name, value.strip()))
        if status < 200:
            return  # 100 Continue, 103 Early Hints: the real head follows
        headers = CIMultiDict(fields)
        connection = headers.get("Connection", "").lower()
        self._keep_alive = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
        resp.status = status
        resp.headers = CIMultiDictProxy(headers)
        if not resp._head_future.done():
            resp._head_future.set_result(None)
        encoding = headers.get("Transfer-Encoding")
        length = headers.get("Content-Length")
        if status in (204, 304):
            self._state = _DONE
        elif encoding is not None:  # chunked last, else the body runs to the connection's end
            if encoding.lower().rsplit(",", 1)[-1].strip() == "chunked":
                self._state = _CHUNK_SIZE
            else:
                self._state, self._keep_alive = _UNTIL_CLOSE, False
        elif length is not None:
            if not length.isdigit():
                raise UpstreamProtocolError("malformed Content-Length")
            self._left = int(length)
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state, self._keep_alive = _UNTIL_CLOSE, False

    def _done(self, resp: UpstreamResponse, rest: bytes) -> None:
        self._state = _DONE
        self._buf = b""
        if rest:  # a server may not answer what was not asked
            self._keep_alive = False
        resp._end()

    def _pause_if(self, pause: bool) -> None:
        if pause and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()


class Http1Pool:
    """Keep-alive connections per origin; see the module docstring. Use inside one event loop."""

    def __init__(
        self, *, connect_s: float, idle_s: float = 15.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        """``connect_s`` bounds a new connection's set-up (TCP, and TLS for ``https``); an idle pooled
        connection is closed after ``idle_s``; ``ssl_context`` is used for ``https`` origins (default:
        the system's CAs, certificate and host name verified, made on the first ``https`` connection)."""
        self.connect_s = connect_s
        self.idle_s = idle_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._ssl = ssl_context
        self._closed = False

    def origin(self, base_url: str) -> Origin:
        """The cached origin of ``base_url``."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = parse_origin(base_url)
        return origin

    async def post(
        self, base_url: str, path: str, body: bytes, headers: CIMultiDict[str]
    ) -> UpstreamResponse:
        """``POST`` ``body`` to ``base_url + path``; the response once its head arrived.

        A pooled connection the server had already closed (it answered nothing) is retried once on a
        new connection; a new connection's failure is raised.
        """
        origin = self.origin(base_url)
        parts = [f"POST {origin.path_prefix}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise UpstreamProtocolError(f"header {name!r} holds a line break")
            parts.append(f"{name}: {value}\r\n")
        parts.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(parts).encode("utf-8", "surrogateescape")
        conn = self._pooled(origin)
        if conn is not None:
            resp = conn.send(head, body)
            try:
                await resp._head_future
                return resp
            except UpstreamDisconnected:
                resp.close()
            except BaseException:
                resp.close()
                raise
        conn = await self._connect(origin)
        resp = conn.send(head, body)
        try:
            await resp._head_future
        except BaseException:
            resp.close()
            raise
        return resp

    def release(self, conn: _Connection) -> None:
        """Park a connection whose response is complete; the oldest idle one goes if it is too old."""
        if self._closed:
            conn.finish(reusable=False)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        conn.idle_since_s = now
        idle = self._idle.setdefault(conn.origin, [])
        idle.append(conn)
        while idle and (idle[0].closed or now - idle[0].idle_since_s > self.idle_s):
            idle.pop(0)._abort()

    def idle_connections(self) -> int:
        """How many connections are parked (open ones)."""
        return sum(1 for conns in self._idle.values() for c in conns if not c.closed)

    def close(self) -> None:
        """Close every idle connection; later releases close theirs."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn._abort()
        self._idle.clear()

    def _pooled(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if conn.closed or transport is None or transport.is_closing():
                continue
            if now - conn.idle_since_s > self.idle_s:
                conn._abort()
                continue
            return conn
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if context is not None else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"no connection to {origin.host_header} within {self.connect_s:g} s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConnectError(f"cannot connect to {origin.host_header}: {exc}") from exc
        return conn
