"""The gateway's client side: one pooled session for the app's lifetime, one never-pooled for retries.

Owns :class:`Upstream`. The composition root builds it (with the connect deadline) and hands it to the
forwarder, the probes, the scrapers and ``/info`` at construction; the app's cleanup context opens it
(aiohttp sessions need the running loop) before the first request and closes it after the last.

Contracts: ``open`` comes before any other call (the app guarantees it), so the hot path checks nothing;
first-byte and idle deadlines are the forwarder's, the sessions bound only connection set-up; the pool
is unlimited (concurrency is the router's business); nothing is decompressed (the relay parses the bytes
the engine sent).
"""

from __future__ import annotations

import aiohttp
from multidict import CIMultiDict


class Upstream:
    """The two client sessions of one app; see the module docstring."""

    _pooled: aiohttp.ClientSession
    _fresh: aiohttp.ClientSession

    def __init__(self, connect_s: float) -> None:
        self.connect_s = connect_s

    def open(self) -> None:
        """Create the sessions (inside the running event loop)."""
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_s, sock_connect=self.connect_s)
        pooled = aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=False)
        self._pooled = aiohttp.ClientSession(timeout=timeout, connector=pooled, auto_decompress=False)
        # For the one retry after a pooled socket turned out stale: never pooled, always new.
        fresh = aiohttp.TCPConnector(force_close=True, limit=0)
        self._fresh = aiohttp.ClientSession(timeout=timeout, connector=fresh, auto_decompress=False)

    async def close(self) -> None:
        await self._pooled.close()
        await self._fresh.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session (health probes, scrapes, TGI ``/info``)."""
        return self._pooled

    async def post(self, url: str, body: bytes, headers: CIMultiDict[str]) -> aiohttp.ClientResponse:
        """``POST`` ``body`` to ``url`` on a pooled connection; the response once its head arrived.

        A pooled keep-alive socket that the upstream had already closed (llama.cpp after every stream:
        "Cannot write to closing transport", ServerDisconnected) failed before anything was answered: it
        is retried once on a connection that is certainly new (the pool may hold more stale ones). A
        refused connection is a real failure and raised.
        """
        try:
            return await self._pooled.post(url, data=body, headers=headers)
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
            aiohttp.ClientConnectionResetError,
        ) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise
            return await self._fresh.post(url, data=body, headers=headers)
