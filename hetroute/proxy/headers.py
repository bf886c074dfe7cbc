"""The headers the forwarder sends each way: what it drops, sets and adds. Owns no state.

Upstream: the client's headers minus hop-by-hop, framing and encoding ones (the body sent is the decoded
one, hetroute.proxy.encodings, so no Content-Encoding), with ``Accept-Encoding: identity`` (the relay parses
the stream) and the request id. To the client: the backend's headers minus hop-by-hop and framing ones, plus
the backend's name and the request id.
"""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from hetroute.proxy.api_errors import BACKEND_HEADER, REQUEST_ID_HEADER
from hetroute.proxy.hop_by_hop import strip_hop_by_hop

_DROP_REQUEST = ("host", "content-length", "content-encoding", "accept-encoding", "expect", REQUEST_ID_HEADER)
_DROP_RESPONSE = ("content-length", "date", "server", BACKEND_HEADER)


def upstream_headers(client: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
    """The headers of the upstream request for a client request with headers ``client``."""
    headers = CIMultiDict(client)  # a C-level copy, then drop the few bad ones
    strip_hop_by_hop(headers, _DROP_REQUEST)
    headers.setdefault("Content-Type", "application/json")  # the body is validated JSON
    headers["Accept-Encoding"] = "identity"  # we parse the stream, so no compression upstream
    headers[REQUEST_ID_HEADER] = rid
    return headers


def client_headers(upstream: CIMultiDictProxy[str], backend: str, rid: str) -> CIMultiDict[str]:
    """The headers of the response to the client for an upstream response with headers ``upstream``."""
    headers = CIMultiDict(upstream)
    strip_hop_by_hop(headers, _DROP_RESPONSE)
    headers[BACKEND_HEADER] = backend
    headers[REQUEST_ID_HEADER] = rid
    return headers
