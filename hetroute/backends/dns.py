"""DNS discovery: a backend entry whose URL's host names a set of servers, re-resolved periodically.

An entry with ``discovery: dns`` (for example ``url: http://vllm.default.svc.cluster.local:8000``, a
Kubernetes headless Service, whose A/AAAA records are its ready pods) is not a backend itself. Every
``dns.interval_s`` its host's A and AAAA records are resolved (``dnspython``'s asyncio resolver: no
thread, a bounded wait), and each address becomes a backend ``<entry name>@<address>`` with the
entry's scheme, port, path and every other field (engine, models, gpu, tp, profile, ...). Engine and
models the entry leaves out are asked of each new address, as at start-up.

The addresses are then made the members of origin ``dns:<entry name>``
(:meth:`~hetroute.backends.membership.Membership.reconcile`): a new address joins, an address gone
from the answer leaves (its in-flight requests finish). A resolution that fails (timeout, SERVFAIL)
changes nothing, so a DNS hiccup never empties the cluster; a name that exists with no address
(NXDOMAIN, no records: every pod gone) removes them all. An address that cannot be discovered is
left out and asked again at the next resolution.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from hetroute.backends.discovery import discover_backend
from hetroute.backends.membership import Changes, Membership, MembershipError
from hetroute.clock import Sleeper
from hetroute.config import BackendConfig
from hetroute.dns_settings import DnsConfig
from hetroute.errors import ConfigError
from hetroute.types import BackendSpec

log = logging.getLogger(__name__)


class DnsError(Exception):
    """A resolution that failed (as opposed to one that found no address)."""


def make_resolver(config: DnsConfig) -> dns.asyncresolver.Resolver:
    """A resolver asking ``config.nameservers`` (default: the system's, read once here)."""
    if not config.nameservers:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        servers: list[str | dns.nameserver.Nameserver] = []
        for entry in config.nameservers:
            host, port = entry, 53
            if entry.count(":") == 1:
                host, _, raw = entry.partition(":")
                port = int(raw)
            servers.append(dns.nameserver.Do53Nameserver(host, port))
        resolver.nameservers = servers
    resolver.lifetime = config.timeout_s
    resolver.timeout = config.timeout_s
    return resolver


async def resolve_addresses(resolver: dns.asyncresolver.Resolver, host: str) -> tuple[str, ...]:
    """The A and AAAA addresses of ``host``, sorted (an IP literal is its own answer); () when the name
    has none; :class:`DnsError` when the resolution failed. A relative name goes through the resolver's
    search list as the system's resolver does (``ndots``): a pod's ``vllm`` is
    ``vllm.<namespace>.svc.cluster.local``."""
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:
        pass
    found: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(host, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except dns.exception.DNSException as exc:
            raise DnsError(f"{rdtype} {host}: {type(exc).__name__}: {exc}") from exc
        found.update(r.to_text() for r in answer)
    return tuple(sorted(found, key=lambda a: (":" in a, a)))


def address_entry(entry: BackendConfig, address: str) -> BackendConfig:
    """The backend entry for one address of ``entry``: named ``<name>@<address>``, its URL's host
    replaced by the address (port, scheme and path kept)."""
    parts = urlsplit(entry.url)
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return replace(entry, name=f"{entry.name}@{address}", url=url, discovery=None)


class DnsDiscovery:
    """Keeps the members of one ``discovery: dns`` entry equal to its host's addresses."""

    def __init__(
        self,
        entry: BackendConfig,
        membership: Membership,
        resolver: dns.asyncresolver.Resolver,
        session: aiohttp.ClientSession,
        *,
        discovery_timeout_s: float,
    ) -> None:
        self.entry = entry
        self.origin = f"dns:{entry.name}"
        self.host = urlsplit(entry.url).hostname or ""
        self.membership = membership
        self.resolver = resolver
        self.session = session
        self.discovery_timeout_s = discovery_timeout_s
        self.last_error: str | None = None

    async def refresh(self) -> Changes | None:
        """Resolve once and apply the answer; None when the resolution failed (nothing changed)."""
        try:
            addresses = await resolve_addresses(self.resolver, self.host)
        except DnsError as exc:
            self.last_error = str(exc)
            log.warning("DNS discovery of %s failed, keeping its backends: %s", self.entry.name, exc)
            return None
        self.last_error = None
        known = self.membership.members_of(self.origin)
        backends = self.membership.router.backends
        specs: list[BackendSpec] = []
        for entry in (address_entry(self.entry, a) for a in addresses):
            if entry.name in known:
                specs.append(backends[known[entry.name]])  # already asked: no new discovery
                continue
            spec = await self._spec(entry)
            if spec is not None:
                specs.append(spec)
        try:
            changes = self.membership.reconcile(specs, self.origin)
        except MembershipError as exc:
            log.error("DNS discovery of %s: %s", self.entry.name, exc)
            return None
        if changes:
            log.info(
                "DNS discovery of %s: added %s, removed %s",
                self.entry.name,
                list(changes.added),
                list(changes.removed),
            )
        return changes

    async def _spec(self, entry: BackendConfig) -> BackendSpec | None:
        try:
            resolved = await discover_backend(self.session, entry, 0, self.discovery_timeout_s)
            return resolved.to_spec(0)
        except ConfigError as exc:
            log.warning(
                "DNS discovery of %s: %s left out for now: %s", self.entry.name, entry.url, exc.message
            )
            return None


async def dns_loop(
    discoveries: Sequence[DnsDiscovery], interval_s: float, sleep: Sleeper = asyncio.sleep
) -> None:
    """Refresh every entry, then wait ``interval_s`` through ``sleep``; until cancelled."""
    while True:
        await asyncio.gather(*(d.refresh() for d in discoveries))
        await sleep(interval_s)
