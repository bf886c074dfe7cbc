"""Hop-by-hop headers (RFC 9110 §7.6.1): the fixed set, plus every header ``Connection`` names.

Owns no state. A proxy must not forward them in either direction: the fixed set below, and
each field name listed in the message's own ``Connection`` header (``Connection: close,
x-secret`` makes ``x-secret`` hop-by-hop).
"""

from __future__ import annotations

from multidict import CIMultiDict

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
     "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)  # fmt: skip


def connection_nominated(headers: CIMultiDict[str]) -> list[str]:
    """The field names listed in every ``Connection`` header of ``headers``."""
    names: list[str] = []
    for value in headers.getall("Connection", ()):
        names.extend(t.strip() for t in value.split(",") if t.strip())
    return names


def strip_hop_by_hop(headers: CIMultiDict[str], also: tuple[str, ...] = ()) -> None:
    """Delete, in place, the fixed hop-by-hop set, the ``Connection``-nominated names and ``also``."""
    nominated = connection_nominated(headers) if "Connection" in headers else []
    for name in (*HOP_BY_HOP, *nominated, *also):
        if name in headers:
            del headers[name]
