"""The UDP channel between router replicas: send this replica's summary every ``peers.interval_s``,
hand every valid one received to the router (:mod:`hetroute.routing.peers`, wire format
:mod:`hetroute.routing.peer_wire`).

Owns :class:`PeerChannel` (an asyncio datagram protocol and its send loop). Why UDP (docs/replicas.md):
a summary is the sender's whole state, so the newest one supersedes every earlier one; a lost datagram
costs one interval of staleness and is better not retransmitted; a datagram needs no connection, never
blocks the sender behind a slow peer, and costs one ``sendto`` per peer per interval whatever the
request rate. Sending never blocks: a full socket buffer or an unreachable peer drops that datagram
(counted). Host names in ``peers.addresses`` are resolved (A and AAAA, through ``dns.nameservers``)
at start and every ``peers.resolve_interval_s``; a failed resolution keeps the addresses found before.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import dns.asyncresolver

from hetroute.backends.dns import DnsError, resolve_addresses
from hetroute.clock import Sleeper
from hetroute.peer_settings import PeersConfig
from hetroute.routing.peer_wire import PeerWireError, decode, encode
from hetroute.routing.peers import peer_heartbeat_s
from hetroute.routing.router import Router

log = logging.getLogger("hetroute.peers")


class PeerChannel(asyncio.DatagramProtocol):
    """Sends ``router``'s summaries to the configured peers and feeds it theirs."""

    def __init__(
        self,
        router: Router,
        cfg: PeersConfig,
        key: bytes,
        resolver: dns.asyncresolver.Resolver,
        *,
        worker: int = 0,
        workers: int = 1,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        """``on_result`` hears every outcome counted in ``results`` (the telemetry's counter)."""
        self.router = router
        self._on_result = on_result
        self.cfg = cfg
        self.key = key
        self.resolver = resolver
        self.listen = (cfg.listen_host, cfg.listen_port + worker)
        self.workers = workers
        self.targets: tuple[tuple[str, int], ...] = ()
        self._found: dict[str, tuple[str, ...]] = {}  # each configured host's addresses, last resolved
        self.results: Counter[str] = Counter()
        """Datagrams received, by outcome: ``accepted``, ``unauthenticated``, ``malformed``; and
        ``send_failed`` for datagrams this replica could not send, ``too_large`` for summaries too
        large for one datagram."""
        self._transport: asyncio.DatagramTransport | None = None
        self._warned = False
        self._heartbeat_s = peer_heartbeat_s(cfg.stale_after_s)
        self._family = socket.AF_INET6 if ":" in cfg.listen_host else socket.AF_INET

    # ------------------------------------------------------------ asyncio.DatagramProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)  # uvloop's is not a subclass

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            summary = decode(data, self.key)
        except PeerWireError as exc:
            self._count(exc.reason)
            log.debug("peer datagram from %s dropped: %s", addr, exc)
            return
        self.router.receive(summary)
        self._count("accepted")

    def error_received(self, exc: Exception) -> None:
        self._count("send_failed")  # ICMP unreachable for an earlier datagram, on Linux
        log.debug("peer channel: %s", exc)

    def _count(self, result: str) -> None:
        self.results[result] += 1
        if self._on_result is not None:
            self._on_result(result)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the listening socket (raises OSError when the port is taken)."""
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=self.listen, family=self._family)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    async def run(self, sleep: Sleeper = asyncio.sleep) -> None:
        """Resolve the addresses, then every ``interval_s`` send a summary if one is due (a dispatch or
        release since the last one, or a third of ``stale_after_s`` since it went out), resolving again
        every ``resolve_interval_s``; until cancelled."""
        clock = self.router.clock
        resolved_at = -float("inf")
        while True:
            if clock.now() - resolved_at >= self.cfg.resolve_interval_s:
                resolved_at = clock.now()
                await self.resolve()
            try:
                if self.router.summary_due(self._heartbeat_s):
                    self.send()
            except Exception:  # never let one bad summary stop the exchange
                self._count("send_failed")
                log.exception("peer channel: a summary could not be sent")
            await sleep(self.cfg.interval_s)

    async def resolve(self) -> None:
        """Set ``targets`` from ``peers.addresses``: each address of each host, on each worker's port."""
        found: list[tuple[str, int]] = []
        for host, port in self.cfg.addresses:
            try:
                addresses = await resolve_addresses(self.resolver, host)
            except DnsError as exc:
                addresses = self._found.get(host, ())
                log.warning(
                    "peers: cannot resolve %s (%s); keeping %d address(es)", host, exc, len(addresses)
                )
            self._found[host] = addresses
            for address in addresses:
                if (":" in address) != (self._family == socket.AF_INET6):
                    continue  # another address family than the listening socket's
                found += [(address, port + k) for k in range(self.workers)]
        targets = tuple(dict.fromkeys(found))
        if targets != self.targets:
            log.info("peers: sending summaries to %s", ", ".join(f"{h}:{p}" for h, p in targets) or "nobody")
        self.targets = targets

    def send(self) -> None:
        """Send the router's summary to every target now (never blocks)."""
        transport = self._transport
        if transport is None:
            return
        try:
            data = encode(self.router.publish(), self.key, self.cfg.max_observations)
        except PeerWireError as exc:  # more backends than one datagram holds
            self._count(exc.reason)
            if not self._warned:
                self._warned = True
                log.warning("peers: no summary sent: %s (one datagram holds about 800 backends)", exc)
            return
        for target in self.targets:
            try:
                transport.sendto(data, target)
            except OSError as exc:
                self._count("send_failed")
                log.debug("peer channel: sending to %s: %s", target, exc)
