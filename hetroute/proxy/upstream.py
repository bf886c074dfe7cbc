"""The gateway's client side: the lean HTTP/1.1 pool for forwarded requests, one aiohttp session for the rest.

Owns :class:`Upstream`. The composition root builds it (with the connect deadline) and hands it to the
forwarder, the probes, the scrapers and ``/info`` at construction; the app's cleanup context opens it
(aiohttp sessions need the running loop) before the first request and closes it after the last.

Contracts: ``open`` comes before any other call (the app guarantees it), so the hot path checks nothing;
first-byte and idle deadlines are the forwarder's, the clients bound only connection set-up; the pools
are unlimited (concurrency is the router's business); nothing is decompressed (the relay parses the bytes
the engine sent). Forwarded requests go through :class:`~hetroute.proxy.http1.Http1Pool` (≈ 50 µs of CPU
less per request than aiohttp's client); probes, scrapes and ``/info`` through aiohttp's session.
"""

from __future__ import annotations

import aiohttp
from multidict import CIMultiDict

from hetroute.proxy.http1 import Http1Pool, UpstreamResponse


class Upstream:
    """The clients of one app; see the module docstring."""

    _session: aiohttp.ClientSession

    def __init__(self, connect_s: float) -> None:
        self.connect_s = connect_s
        self.pool = Http1Pool(connect_s=connect_s)

    def open(self) -> None:
        """Create the aiohttp session (inside the running event loop)."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_s, sock_connect=self.connect_s)
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)

    async def close(self) -> None:
        self.pool.close()
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The aiohttp session (health probes, scrapes, TGI ``/info``)."""
        return self._session

    async def post(
        self, base_url: str, path: str, body: bytes, headers: CIMultiDict[str]
    ) -> UpstreamResponse:
        """``POST`` ``body`` to ``base_url + path`` on a pooled connection; the response once its head
        arrived. A pooled keep-alive socket that the upstream had already closed (llama.cpp after every
        stream) is retried once on a new connection by the pool; any other failure is raised as an
        :class:`~hetroute.proxy.http1.UpstreamError`."""
        return await self.pool.post(base_url, path, body, headers)
