"""The ``dns:`` section of the router config (its annotations are its bounds, read by ``hetroute.config``
through :mod:`hetroute.fields`): how backends marked ``discovery: dns`` are resolved
(:mod:`hetroute.backends.dns`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from hetroute.errors import ConfigError
from hetroute.fields import PositiveFloat, Reader

DNS_DISCOVERY = "dns"
"""The value of a backend entry's ``discovery`` that makes its URL's host a DNS name to re-resolve."""


def _nameservers(value: Any, path: str) -> tuple[str, ...]:
    """``host`` or ``host:port`` entries (a single string reads as a one-entry list)."""
    servers = [value] if isinstance(value, str) else value
    if not isinstance(servers, list) or not all(isinstance(x, str) and x for x in servers):
        raise ConfigError(path, f"expected a list of host or host:port, got {servers!r}")
    for j, server in enumerate(servers):
        _host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
        if port and (not port.isdigit() or not 0 < int(port) < 65536):
            raise ConfigError(f"{path}[{j}]", f"bad port in {server!r}")
    return tuple(servers)


@dataclass(frozen=True, slots=True)
class DnsConfig:
    """DNS discovery (docs/live-backends.md).

    - ``interval_s``: how often each name is resolved again (its A and AAAA records). A Kubernetes
      headless Service's records follow its ready pods, so this bounds how late a new pod is seen.
    - ``timeout_s``: bound of one resolution; a failed one keeps the backends found before.
    - ``nameservers``: ``host`` or ``host:port`` of the servers to ask (default: the system's, from
      /etc/resolv.conf, as a pod's cluster DNS).
    """

    interval_s: PositiveFloat = 10.0
    timeout_s: PositiveFloat = 2.0
    nameservers: Annotated[tuple[str, ...], Reader(_nameservers)] = ()
