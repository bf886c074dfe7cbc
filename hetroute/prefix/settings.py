"""The ``prefix:`` section of the router config; its annotations are its bounds (``hetroute.fields``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from hetroute.errors import ConfigError
from hetroute.fields import PositiveFloat, PositiveInt, Reader
from hetroute.prefix.index import DEFAULT_MAX_CHUNKS, DEFAULT_TTL_S
from hetroute.prefix.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S


def _header_name(value: Any, path: str) -> str:
    """A request header name, lower-cased; ``""`` (session affinity off) is allowed."""
    if not isinstance(value, str) or any(c.isspace() or c == ":" for c in value):
        raise ConfigError(path, f"not a header name: {value!r}")
    return value.lower()


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    """Prefix-cache locality and session affinity (docs/prefix.md). Defaults are what ``serve`` runs.

    - ``enabled``: keep the per-backend prefix index and give the policies each backend's estimated
      cached tokens for a request (default on; with no shared prefixes it changes no decision).
    - ``ttl_s``: a chunk not reused for this long is assumed evicted by the engine.
    - ``max_chunks``: bound of the whole index in chunks (each 256 characters of prompt).
    - ``session_header``: request header naming a session (the OpenAI ``user`` field is used when the
      header is absent); ``""`` turns session affinity off.
    - ``session_ttl_s`` / ``max_sessions``: how long and how many sessions are remembered.
    """

    enabled: bool = True
    ttl_s: PositiveFloat = DEFAULT_TTL_S
    max_chunks: PositiveInt = DEFAULT_MAX_CHUNKS
    session_header: Annotated[str, Reader(_header_name)] = "x-session-id"
    session_ttl_s: PositiveFloat = DEFAULT_SESSION_TTL_S
    max_sessions: PositiveInt = DEFAULT_MAX_SESSIONS
