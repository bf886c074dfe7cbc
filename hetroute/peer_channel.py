"""The UDP channel between router replicas: send this replica's summary every ``peers.interval_s``,
hand every valid one received to the router (:mod:`hetroute.routing.peers`, wire format
:mod:`hetroute.routing.peer_wire`).

Owns :class:`PeerChannel` (a non-blocking UDP socket, its reader and its send loop). Why UDP
(docs/replicas.md): a summary is the sender's whole state, so the newest one supersedes every earlier
one; a lost datagram costs one interval of staleness and is better not retransmitted; a datagram needs
no connection, never blocks the sender behind a slow peer, and costs one ``sendto`` per peer per
interval whatever the request rate. Sending never blocks: a full socket buffer or an unreachable peer
drops that datagram (counted). Host names in ``peers.addresses`` are resolved (A and AAAA, through
``dns.nameservers``) at start and every ``peers.resolve_interval_s``; a failed resolution keeps the
addresses found before.

Why the channel owns its socket, and polls it from the decision path. The event loop reads the socket
when it is readable and the send loop wakes every ``interval_s``, but both wait for the loop to come
round, and a burst of requests keeps it busy: through real gateways (4 replicas, 400 requests at once on
2 cores) the summaries each replica held were 0.1 s old at the end of the burst, peers went stale
mid-burst, and each replica decided on a fraction of the others' load. So :meth:`PeerChannel.poll`,
which the router calls before every decision (``Router.before_decide``), does the same work at most
once per ``interval_s``: it reads every datagram waiting in the socket (a non-blocking ``recvfrom``,
which returns at once when none is) and sends this replica's summary when one is due.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

import dns.asyncresolver

from hetroute.backends.dns import DnsError, resolve_addresses
from hetroute.clock import Sleeper
from hetroute.peer_settings import PeersConfig
from hetroute.routing.peer_wire import PeerWireError, decode, encode
from hetroute.routing.peers import peer_heartbeat_s
from hetroute.routing.router import Router

log = logging.getLogger("hetroute.peers")

_DATAGRAM_MAX = 65_535
"""The largest UDP payload: a summary never exceeds it (peer_wire.py)."""
_READ_MAX = 256
"""Datagrams taken per read at most, so that a flood cannot hold the event loop."""


class PeerChannel:
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
        self._sock: socket.socket | None = None
        self._polled_at_s = -float("inf")
        self._warned = False
        self._heartbeat_s = peer_heartbeat_s(cfg.stale_after_s)
        self._family = socket.AF_INET6 if ":" in cfg.listen_host else socket.AF_INET

    # ------------------------------------------------------------ receiving

    def _readable(self) -> None:
        """Take every datagram waiting in the socket (the event loop's reader, and :meth:`poll`)."""
        sock = self._sock
        for _ in range(_READ_MAX):
            if sock is None:
                return
            try:
                data, addr = sock.recvfrom(_DATAGRAM_MAX)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ICMP unreachable for an earlier datagram, on Linux
                self._count("send_failed")
                log.debug("peer channel: %s", exc)
                continue
            self.datagram_received(data, addr)
            sock = self._sock

    def datagram_received(self, data: bytes, addr: Any) -> None:
        """One datagram: a valid summary goes to the router, anything else is counted and dropped."""
        try:
            summary = decode(data, self.key)
        except PeerWireError as exc:
            self._count(exc.reason)
            log.debug("peer datagram from %s dropped: %s", addr, exc)
            return
        self.router.receive(summary)
        self._count("accepted")

    def poll(self) -> None:
        """Before a routing decision (``Router.before_decide``): at most once per ``interval_s``, take the
        summaries waiting in the socket and send this replica's if one is due (see the module docstring).
        A few µs when it runs (one ``recvfrom`` that finds nothing, one clock read); a clock read and a
        comparison otherwise."""
        now = self.router.clock.now()
        if now - self._polled_at_s < self.cfg.interval_s or self._sock is None:
            return
        self._polled_at_s = now
        self._readable()
        self._send_if_due()

    def _send_if_due(self) -> None:
        """Send this replica's summary if one is due; a failure is counted and logged, never raised (one
        bad summary must neither fail a request nor stop the exchange)."""
        try:
            if self.router.summary_due(self._heartbeat_s):
                self.send()
        except Exception:
            self._count("send_failed")
            log.exception("peer channel: a summary could not be sent")

    def _count(self, result: str) -> None:
        self.results[result] += 1
        if self._on_result is not None:
            self._on_result(result)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the listening socket (raises OSError when the port is taken), read it whenever it is
        readable, and poll it before every routing decision."""
        sock = socket.socket(self._family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind(self.listen)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.router.before_decide = self.poll

    def close(self) -> None:
        if self.router.before_decide == self.poll:
            self.router.before_decide = None
        sock, self._sock = self._sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()

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
            self._send_if_due()
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
        sock = self._sock
        if sock is None:
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
                sock.sendto(data, target)
            except OSError as exc:  # BlockingIOError too: a full buffer drops the datagram
                self._count("send_failed")
                log.debug("peer channel: sending to %s: %s", target, exc)
