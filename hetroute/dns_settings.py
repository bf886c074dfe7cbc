"""The ``dns:`` section of the router config (validated by ``hetroute.config``): how backends marked
``discovery: dns`` are resolved (:mod:`hetroute.backends.dns`)."""

from __future__ import annotations

from dataclasses import dataclass

DNS_DISCOVERY = "dns"
"""The value of a backend entry's ``discovery`` that makes its URL's host a DNS name to re-resolve."""


@dataclass(frozen=True, slots=True)
class DnsConfig:
    """DNS discovery (docs/live-backends.md).

    - ``interval_s``: how often each name is resolved again (its A and AAAA records). A Kubernetes
      headless Service's records follow its ready pods, so this bounds how late a new pod is seen.
    - ``timeout_s``: bound of one resolution; a failed one keeps the backends found before.
    - ``nameservers``: ``host`` or ``host:port`` of the servers to ask (default: the system's, from
      /etc/resolv.conf, as a pod's cluster DNS).
    """

    interval_s: float = 10.0
    timeout_s: float = 2.0
    nameservers: tuple[str, ...] = ()
