"""A :class:`~hetroute.routing.peers.PeerSummary` as one authenticated UDP datagram, and back.

Layout: ``MAGIC`` (4 bytes), an HMAC-SHA256 tag (32 bytes) over ``MAGIC`` and the payload, then the
payload: the header's length (4 bytes, little-endian), the header as compact JSON ``{"r": replica,
"s": seq, "t": sent_at_s, "b": [n backend names], "o": [[backend, 12 observation fields], ...]}``, then
the requests and the six rows as (1 + 6) × n little-endian float64 (binary: parsing thousands of
floats from JSON cost a millisecond at 512 backends; ``benchmarks/peers_cost.py``). The key is shared by every
replica (``HETROUTE_PEER_KEY``): a datagram without the right tag changes nothing, since summaries
steer the routing. :func:`decode` checks every field (types, lengths, finite non-negative numbers) and
raises :class:`PeerWireError` with a short reason; nothing in a rejected datagram is used.

:func:`encode` keeps a datagram under :data:`MAX_DATAGRAM_BYTES` by leaving out the oldest observations
(a summary carries at most ``max_observations``; the state part is always whole).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from typing import Any

import numpy as np

from hetroute.learning.observation import Observation
from hetroute.routing.ledger import FLOAT_ROWS
from hetroute.routing.peers import PeerSummary
from hetroute.types import FloatArray

MAGIC = b"HRP1"
TAG_BYTES = 32
MAX_DATAGRAM_BYTES = 60_000
"""Below UDP's 65,507-byte payload limit over IPv4."""
MAX_NAME_CHARS = 256
_OBS_FIELDS = tuple(f for f in Observation._fields if f != "backend_index")
"""An observation's fields on the wire, after the backend name (its index is the sender's own)."""
_SIGNED = frozenset({"finished_at_s"})  # a clock reading; every other number is >= 0
_OPTIONAL = frozenset({"ttft_s", "engine_running"})
_COUNTS = ("input_tokens", "output_tokens")


class PeerWireError(ValueError):
    """A datagram that is not a valid, authenticated summary; ``reason`` is one word for the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[type[PeerWireError], tuple[str, str]]:
        return (type(self), (self.reason, self.detail))


def signature(key: bytes, body: bytes) -> bytes:
    """The HMAC-SHA256 tag of ``MAGIC`` + ``body`` under ``key``."""
    return hmac.new(key, MAGIC + body, hashlib.sha256).digest()


def _obs_row(name: str, o: Observation) -> list[Any]:
    return [name, *(getattr(o, f) for f in _OBS_FIELDS)]


def pack_body(header: dict[str, Any], numbers: FloatArray) -> bytes:
    """The signed part of a datagram: the header's length (4 bytes, little-endian), the header as
    compact JSON, then ``numbers`` as little-endian float64."""
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return struct.pack("<I", len(text)) + text + np.ascontiguousarray(numbers, dtype="<f8").tobytes()


def encode(summary: PeerSummary, key: bytes, max_observations: int = 200) -> bytes:
    """``summary`` as one datagram signed with ``key``; the newest ``max_observations`` observations at
    most, fewer if the datagram would exceed :data:`MAX_DATAGRAM_BYTES`. :class:`PeerWireError`
    (``too_large``) when even the state alone would (more than about 800 backends)."""
    observations = summary.observations[-max_observations:] if max_observations > 0 else ()
    header: dict[str, Any] = {
        "r": summary.replica,
        "s": summary.seq,
        "t": summary.sent_at_s,
        "b": list(summary.backends),
    }
    numbers = np.vstack([summary.requests[None, :], summary.rows])
    rows = [_obs_row(name, o) for name, o in observations]
    while True:
        body = pack_body({**header, "o": rows}, numbers)
        if len(body) + len(MAGIC) + TAG_BYTES <= MAX_DATAGRAM_BYTES:
            break
        if not rows:
            raise PeerWireError("too_large", f"{len(body)} bytes for {len(summary.backends)} backends")
        rows = rows[len(rows) // 2 + 1 :]  # keep the newer half
    return MAGIC + signature(key, body) + body


def decode(data: bytes, key: bytes) -> PeerSummary:
    """The summary in ``data``; :class:`PeerWireError` unless it is well-formed and signed with ``key``."""
    if len(data) < len(MAGIC) + TAG_BYTES + 4 or not data.startswith(MAGIC):
        raise PeerWireError("malformed", "not a hetroute peer datagram")
    tag, body = data[len(MAGIC) : len(MAGIC) + TAG_BYTES], data[len(MAGIC) + TAG_BYTES :]
    if not hmac.compare_digest(tag, signature(key, body)):
        raise PeerWireError("unauthenticated", "bad tag (another key, or altered)")
    (size,) = struct.unpack_from("<I", body)
    if 4 + size > len(body):
        raise PeerWireError("malformed", "header longer than the datagram")
    try:
        raw = json.loads(body[4 : 4 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PeerWireError("malformed", f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise PeerWireError("malformed", "not an object")
    replica, seq, sent = raw.get("r"), raw.get("s"), raw.get("t")
    if not isinstance(replica, str) or not 0 < len(replica) <= MAX_NAME_CHARS:
        raise PeerWireError("malformed", "r: a replica id of 1-256 characters")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise PeerWireError("malformed", "s: an integer >= 0")
    sent_at = _number(sent, "t", signed=True)
    names = raw.get("b")
    if not isinstance(names, list) or not all(_is_name(x) for x in names):
        raise PeerWireError("malformed", "b: a list of backend names")
    n = len(names)
    packed = body[4 + size :]
    if len(packed) != (1 + FLOAT_ROWS) * n * 8:
        raise PeerWireError("malformed", f"numbers: {(1 + FLOAT_ROWS) * n} float64 for {n} backends")
    numbers = np.frombuffer(packed, dtype="<f8").reshape(1 + FLOAT_ROWS, n).astype(np.float64)
    bad = ~np.isfinite(numbers)
    bad[0] |= numbers[0] < 0  # request counts; the rows are float sums, a tiny negative is rounding
    if bad.any():
        r, k = (int(x) for x in np.argwhere(bad)[0])
        where = f"q[{k}]" if r == 0 else f"w[{r - 1}][{k}]"
        raise PeerWireError("malformed", f"{where}: a finite number{' >= 0' if r == 0 else ''}")
    observations = _observations(raw.get("o", []), set(names))
    return PeerSummary(replica, seq, sent_at, tuple(names), numbers[0], numbers[1:], observations)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def _number(value: Any, path: str, *, signed: bool = False, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PeerWireError("malformed", f"{path}: a number")
    x = float(value)
    if not math.isfinite(x) or (x < 0 and not signed):
        raise PeerWireError("malformed", f"{path}: a finite number{'' if signed else ' >= 0'}")
    return x


def _observations(value: Any, names: set[str]) -> tuple[tuple[str, Observation], ...]:
    if not isinstance(value, list):
        raise PeerWireError("malformed", "o: a list")
    out = []
    width = len(_OBS_FIELDS)
    for k, row in enumerate(value):
        path = f"o[{k}]"
        if not isinstance(row, list) or len(row) != width + 1 or row[0] not in names:
            raise PeerWireError("malformed", f"{path}: a backend of b and {width} fields")
        f = {
            field: _number(v, f"{path}[{j + 1}]", signed=field in _SIGNED, optional=field in _OPTIONAL)
            for j, (field, v) in enumerate(zip(_OBS_FIELDS, row[1:], strict=True))
        }
        if not all(f[field].is_integer() for field in _COUNTS):
            raise PeerWireError("malformed", f"{path}: whole token counts")
        f.update({field: int(f[field]) for field in _COUNTS})
        out.append((str(row[0]), Observation(backend_index=-1, **f)))
    return tuple(out)
