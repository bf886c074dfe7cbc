"""The ``prefix:`` section of the router config (validated by ``hetroute.config``)."""

from __future__ import annotations

from dataclasses import dataclass

from hetroute.prefix.index import DEFAULT_MAX_CHUNKS, DEFAULT_TTL_S
from hetroute.prefix.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S


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
    ttl_s: float = DEFAULT_TTL_S
    max_chunks: int = DEFAULT_MAX_CHUNKS
    session_header: str = "x-session-id"
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    max_sessions: int = DEFAULT_MAX_SESSIONS
