"""The forwarder's HTTP/1.1 client against a scripted server on 127.0.0.1 (real sockets).

The server parses each request (head and Content-Length body), records it with the connection it came
on, and answers with the bytes a test scripts, piece by piece, so framing split at every boundary is
exercised.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import trustme
from multidict import CIMultiDict

from hetroute.proxy.http1 import (
    HIGH_WATER_BYTES,
    Http1Pool,
    UpstreamConnectError,
    UpstreamPayloadError,
    UpstreamProtocolError,
    parse_origin,
)


@dataclass
class Answer:
    pieces: list[bytes]
    close: bool = False  # close the connection after writing
    gap_s: float = 0.0


@dataclass
class Seen:
    head: str
    body: bytes
    connection: int


@dataclass
class Server:
    script: Callable[[int], Answer]
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    eofs: int = 0
    ended: int = 0  # connections whose handler returned (EOF, reset or scripted close)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                try:
                    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                except asyncio.IncompleteReadError:
                    self.eofs += 1
                    return
                length = 0
                for line in head.split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length)
                self.seen.append(Seen(head, body, number))
                answer = self.script(len(self.seen) - 1)
                for piece in answer.pieces:
                    writer.write(piece)
                    await writer.drain()
                    if answer.gap_s:
                        await asyncio.sleep(answer.gap_s)
                if answer.close:
                    return
        except ConnectionError:
            return
        finally:
            self.ended += 1
            writer.close()


Serve = Callable[[Callable[[int], Answer]], Awaitable[Server]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.AbstractServer] = []

    async def start(script: Callable[[int], Answer]) -> Server:
        state = Server(script)
        server = await asyncio.start_server(state.handle, "127.0.0.1", 0)
        servers.append(server)
        state.port = server.sockets[0].getsockname()[1]
        return state

    yield start
    for server in servers:
        server.close()


def ok(body: bytes, extra: bytes = b"") -> Answer:
    return Answer([b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
                   + b"Content-Length: %d\r\n\r\n" % len(body) + body])  # fmt: skip


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


HEADERS: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "r-1"})


async def test_a_content_length_answer_is_read_and_its_connection_reused(serve: Serve) -> None:
    server = await serve(lambda i: ok(b'{"n":%d}' % i, b"X-Engine: e\r\n"))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}/base"
    for i in range(3):
        resp = await pool.post(url, "/v1/completions", b'{"prompt":"hi"}', HEADERS)
        assert resp.status == 200
        assert resp.headers["x-engine"] == "e"
        assert await resp.read() == b'{"n":%d}' % i
        resp.close()
    assert [s.connection for s in server.seen] == [1, 1, 1]
    head = server.seen[0].head
    assert head.startswith("POST /base/v1/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}\r\n" in head
    assert "X-Request-Id: r-1\r\n" in head and "Content-Length: 15\r\n" in head
    assert server.seen[0].body == b'{"prompt":"hi"}'
    pool.close()


async def test_header_values_are_read_as_utf8_like_aiohttps_client(serve: Serve) -> None:
    server = await serve(lambda i: ok(b"{}", "X-Name: caf\u00e9\r\n".encode()))
    pool = Http1Pool(connect_s=2.0)
    resp = await pool.post(f"http://127.0.0.1:{server.port}", "/generate", b"{}", HEADERS)
    assert resp.headers["X-Name"] == "caf\u00e9"
    resp.close()
    pool.close()


async def _stream_then_reuse(pool: Http1Pool, url: str, server: Server) -> bytes:
    """The body of a streamed answer read with ``readany``; then a second request on the same
    connection (the answer ended where it should) gets the scripted ``{}``. Closes ``pool``."""
    resp = await pool.post(url, "/v1/completions", b"{}", HEADERS)
    got = b""
    while chunk := await resp.readany():
        got += chunk
    resp.close()
    second = await pool.post(url, "/v1/completions", b"{}", HEADERS)
    assert await second.read() == b"{}"
    second.close()
    assert server.connections == 1
    pool.close()
    return got


async def test_a_chunked_stream_split_at_every_byte_is_relayed_whole(serve: Serve) -> None:
    events = b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"
    wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-Trailer: t\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    server = await serve(lambda i: Answer(bytewise(head + wire)) if i == 0 else ok(b"{}"))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    assert await _stream_then_reuse(pool, url, server) == b"".join(events)  # the trailer was consumed


async def test_whole_chunks_each_in_its_own_segment_are_relayed_and_the_connection_reused(
    serve: Serve,
) -> None:
    """A streaming engine's usual segment, one whole chunk (taken in one step by ``data_received``),
    then the last chunk and a trailer-less end."""
    events = [b"data: %d\n\n" % k for k in range(4)] + [b"data: " + b"x" * 300 + b"\n\n"]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    pieces = [head, *(b"%x\r\n%s\r\n" % (len(e), e) for e in events), b"0\r\n\r\n"]
    server = await serve(lambda i: Answer(pieces, gap_s=0.005) if i == 0 else ok(b"{}"))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    assert await _stream_then_reuse(pool, url, server) == b"".join(events)


async def test_a_whole_chunk_with_a_bad_end_is_a_protocol_error(serve: Serve) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = await serve(lambda i: Answer([head, b"5\r\nhelloXX"], gap_s=0.005, close=True))
    pool = Http1Pool(connect_s=2.0)
    resp = await pool.post(f"http://127.0.0.1:{server.port}", "/v1/completions", b"{}", HEADERS)
    with pytest.raises(UpstreamProtocolError, match="CRLF"):
        await resp.read()
    resp.close()
    pool.close()


async def test_an_answer_without_length_runs_to_the_close_and_is_not_reused(serve: Serve) -> None:
    server = await serve(lambda i: Answer([b"HTTP/1.1 200 OK\r\n\r\n", b"part1,", b"part2"], close=True))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    for _ in range(2):
        resp = await pool.post(url, "/generate", b"{}", HEADERS)
        assert await resp.read() == b"part1,part2"
        resp.close()
    assert server.connections == 2
    pool.close()


async def test_connection_close_100_continue_and_204_are_honoured(serve: Serve) -> None:
    answers = [
        Answer([b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]),
        Answer([b"HTTP/1.1 204 No Content\r\n\r\n"]),
        Answer([b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye"]),
        ok(b"new"),
    ]
    server = await serve(lambda i: answers[i])
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    bodies = []
    for _ in answers:
        resp = await pool.post(url, "/generate", b"{}", HEADERS)
        bodies.append((resp.status, await resp.read()))
        resp.close()
    assert bodies == [(200, b"ok"), (204, b""), (200, b"bye"), (200, b"new")]
    assert [s.connection for s in server.seen] == [1, 1, 1, 2]
    pool.close()


async def test_a_pooled_connection_the_server_closed_is_retried_on_a_new_one(serve: Serve) -> None:
    # The server closes after each answer without saying so: the next request finds a stale socket.
    server = await serve(lambda i: Answer(ok(b"%d" % i).pieces, close=True))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    first = await pool.post(url, "/generate", b"{}", HEADERS)
    assert await first.read() == b"0"
    first.close()
    await asyncio.sleep(0.05)  # the close reaches us
    second = await pool.post(url, "/generate", b"{}", HEADERS)
    assert await second.read() == b"1"
    second.close()
    assert server.connections == 2 and len(server.seen) == 2
    pool.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    pool = Http1Pool(connect_s=2.0)
    with pytest.raises(UpstreamConnectError, match="cannot connect to 127.0.0.1:1"):
        await pool.post("http://127.0.0.1:1", "/generate", b"{}", HEADERS)


@pytest.mark.parametrize(
    ("pieces", "error"),
    [
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"], UpstreamPayloadError),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"], UpstreamPayloadError),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], UpstreamProtocolError),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY"], UpstreamProtocolError),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n"], UpstreamProtocolError),
    ],
)
async def test_a_broken_body_fails_the_read(
    serve: Serve, pieces: list[bytes], error: type[Exception]
) -> None:
    server = await serve(lambda i: Answer(pieces, close=True))
    pool = Http1Pool(connect_s=2.0)
    with pytest.raises(error):
        resp = await pool.post(f"http://127.0.0.1:{server.port}", "/generate", b"{}", HEADERS)
        await resp.read()
    pool.close()


@pytest.mark.parametrize(
    "pieces",
    [
        [b"SPDY/3 200 OK\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"],
        [b"HTTP/1.1 2"],
        [b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000],  # past MAX_HEAD_BYTES without an end
    ],
)
async def test_a_malformed_head_is_a_protocol_error(serve: Serve, pieces: list[bytes]) -> None:
    server = await serve(lambda i: Answer(pieces, close=True))
    pool = Http1Pool(connect_s=2.0)
    with pytest.raises(UpstreamProtocolError):
        await pool.post(f"http://127.0.0.1:{server.port}", "/generate", b"{}", HEADERS)
    pool.close()


async def test_closing_before_the_end_drops_the_connection_and_the_server_sees_it(serve: Serve) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server = await serve(lambda i: Answer([head] + [b"6\r\nevent\n\r\n"] * 50, gap_s=0.01))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    resp = await pool.post(url, "/generate_stream", b"{}", HEADERS)
    assert (await resp.readany()).startswith(b"event\n")
    resp.close()  # the client went away mid-stream
    assert pool.idle_connections() == 0
    for _ in range(200):  # the server's next write fails: it saw the disconnect
        if server.ended:
            break
        await asyncio.sleep(0.01)
    assert server.ended == 1
    second = await pool.post(url, "/generate_stream", b"{}", HEADERS)
    assert second.status == 200
    second.close()
    assert server.connections == 2
    pool.close()


async def test_a_reader_that_lags_pauses_the_socket_and_loses_nothing(serve: Serve) -> None:
    piece = b"x" * 65536
    n = 4 * HIGH_WATER_BYTES // len(piece)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (n * len(piece))
    server = await serve(lambda i: Answer([head] + [piece] * n))
    pool = Http1Pool(connect_s=2.0)
    resp = await pool.post(f"http://127.0.0.1:{server.port}", "/generate", b"{}", HEADERS)
    await asyncio.sleep(0.2)  # the server writes as fast as it can; nobody reads
    assert resp._buffered <= HIGH_WATER_BYTES + 2 * len(piece)  # paused, not 4x the bound
    total = 0
    while chunk := await resp.readany():
        total += len(chunk)
    assert total == n * len(piece)
    resp.close()
    assert pool.idle_connections() == 1  # read whole: reusable
    pool.close()


async def test_bytes_after_the_answer_make_the_connection_unusable(serve: Serve) -> None:
    server = await serve(lambda i: Answer([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA"]))
    pool = Http1Pool(connect_s=2.0)
    url = f"http://127.0.0.1:{server.port}"
    resp = await pool.post(url, "/generate", b"{}", HEADERS)
    assert await resp.read() == b"ok"
    resp.close()
    assert pool.idle_connections() == 0
    pool.close()


async def test_an_idle_connection_past_its_age_is_not_reused(serve: Serve) -> None:
    server = await serve(lambda i: ok(b"{}"))
    pool = Http1Pool(connect_s=2.0, idle_s=0.0)
    url = f"http://127.0.0.1:{server.port}"
    for _ in range(2):
        resp = await pool.post(url, "/generate", b"{}", HEADERS)
        await resp.read()
        resp.close()
        await asyncio.sleep(0.01)
    assert server.connections == 2
    pool.close()


async def test_a_header_with_a_line_break_is_refused_before_sending(serve: Serve) -> None:
    server = await serve(lambda i: ok(b"{}"))
    pool = Http1Pool(connect_s=2.0)
    bad: CIMultiDict[str] = CIMultiDict({"X-Evil": "a\r\nX-Injected: 1"})
    with pytest.raises(UpstreamProtocolError, match="line break"):
        await pool.post(f"http://127.0.0.1:{server.port}", "/generate", b"{}", bad)
    assert server.seen == []
    pool.close()


async def test_https_verifies_the_backends_certificate() -> None:
    """TLS to an ``https`` backend: a certificate from a trusted CA for the host name works; with the
    system's CAs (which do not trust this test CA) the connection is refused as a connect error."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    state = Server(lambda i: ok(b'{"tls":true}'))
    server = await asyncio.start_server(state.handle, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        client_context = ssl.create_default_context()
        ca.configure_trust(client_context)
        pool = Http1Pool(connect_s=5.0, ssl_context=client_context)
        resp = await pool.post(f"https://localhost:{port}", "/generate", b"{}", HEADERS)
        assert resp.status == 200 and await resp.read() == b'{"tls":true}'
        resp.close()
        assert f"Host: localhost:{port}\r\n" in state.seen[0].head
        pool.close()
        untrusting = Http1Pool(connect_s=5.0)
        with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await untrusting.post(f"https://localhost:{port}", "/generate", b"{}", HEADERS)
        untrusting.close()
    finally:
        server.close()


def test_origins_keep_the_port_the_prefix_and_bracket_ipv6() -> None:
    assert parse_origin("http://h:8000/api/").path_prefix == "/api"
    assert parse_origin("http://h:80").host_header == "h"
    assert parse_origin("https://h").port == 443
    assert parse_origin("http://[::1]:9000").host_header == "[::1]:9000"
    with pytest.raises(ValueError, match="not an http"):
        parse_origin("ftp://h")
