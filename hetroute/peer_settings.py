"""The ``peers:`` section of the router config: router replicas exchanging summaries of their in-flight
requests and completions over UDP (:mod:`hetroute.peer_channel`, :mod:`hetroute.routing.peers`).

Its annotations are its bounds, read by ``hetroute.config`` through :mod:`hetroute.fields`; the
shared key comes from the environment (``HETROUTE_PEER_KEY``, read by ``hetroute.config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from hetroute.errors import ConfigError
from hetroute.fields import PositiveFloat, PositiveInt, Range, Reader

DEFAULT_PEER_PORT = 8471


def _host_port(value: Any, path: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for an IPv6 literal) into its parts."""
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected host:port, got {value!r}")
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(path, f"expected host:port with a port 1-65535, got {value!r}")
    return host, int(port)


def _addresses(value: Any, path: str) -> tuple[tuple[str, int], ...]:
    """A list of ``host:port``: the replicas to send to (a host name may resolve to several)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ConfigError(path, f"expected a list of host:port, got {value!r}")
    return tuple(_host_port(item, f"{path}[{k}]") for k, item in enumerate(items))


@dataclass(frozen=True, slots=True)
class PeersConfig:
    """Replicas exchanging summaries (docs/replicas.md, "Exchanging summaries"). Off while
    ``addresses`` is empty.

    - ``addresses``: ``host:port`` of the replicas to send this replica's summaries to. A host name
      (a Kubernetes headless Service naming every router pod) is resolved again every
      ``resolve_interval_s`` and each of its addresses gets the summary; this replica's own address may
      be among them (its own summaries are ignored). With ``server.workers`` = N, worker k listens on
      ``listen_port + k`` and every address gets a copy on each of port … port + N − 1.
    - ``listen_host`` / ``listen_port``: where this replica receives them (UDP).
    - ``interval_s``: how often a summary may be sent: one goes out when this replica dispatched or
      released a request since its last one, else every third of ``stale_after_s`` (a heartbeat). 5 ms
      by default: in the simulator (paper-b, 24 req/s, 4 replicas) p99 TTFT is 1.05× one router's with
      5 ms, 1.14× with 20 ms and 1.4× with a summary every 100 ms (docs/replicas.md).
    - ``stale_after_s``: how long a received summary counts (at least ``interval_s``).
    - ``max_observations``: completions carried per summary at most (the newest).
    - ``mirror``: between a peer's summaries, count the change this replica made since that summary
      (over at most the last :func:`mirror_follow_s`) as that peer's too
      (:mod:`hetroute.routing.peer_mirror`): a burst that every replica takes at once is then counted
      before any summary can arrive.
    """

    addresses: Annotated[tuple[tuple[str, int], ...], Reader(_addresses)] = ()
    listen_host: str = "0.0.0.0"
    listen_port: Annotated[int, Range(minimum=1, maximum=65535)] = DEFAULT_PEER_PORT
    interval_s: PositiveFloat = 0.005
    stale_after_s: PositiveFloat = 0.25
    resolve_interval_s: PositiveFloat = 10.0
    max_observations: PositiveInt = 200
    mirror: bool = True

    @property
    def follow_s(self) -> float:
        """How far back a replica mirrors its own changes onto a peer (0: ``mirror`` off)."""
        return mirror_follow_s(self.interval_s, self.stale_after_s) if self.mirror else 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.addresses)


def mirror_follow_s(interval_s: float, stale_after_s: float) -> float:
    """How far back the mirror follows this replica's own change onto a peer since that peer's summary:
    ``max(2 × interval_s, stale_after_s / 3)``. A peer with something new sends a summary within
    ``interval_s``, but the newest one held can be as old as a heartbeat (``stale_after_s / 3``) when
    the peer has sent nothing since, or when its event loop or this one is busy with a burst: through
    real gateways (paper-a, rate ∞, 4 replicas on 2 cores) summaries arrived later than 2 ×
    ``interval_s``, the window cut the mirror short, and each replica undercounted the others' share of
    the burst (docs/replicas.md)."""
    return max(2.0 * interval_s, stale_after_s / 3.0)


def check_peers(cfg: PeersConfig, key: str | None, workers: int) -> None:
    """The checks that tie ``peers`` to other settings; ConfigError names the field."""
    if not cfg.enabled:
        return
    if cfg.stale_after_s < cfg.interval_s:
        raise ConfigError("peers.stale_after_s", f"must be >= peers.interval_s ({cfg.interval_s:g})")
    if not key:
        raise ConfigError(
            "peers.addresses",
            "replicas exchanging summaries need a shared key in the environment variable "
            "HETROUTE_PEER_KEY (every replica the same; summaries steer the routing)",
        )
    if cfg.listen_port + workers - 1 > 65535:
        raise ConfigError("peers.listen_port", f"leaves no port for each of the {workers} workers")
