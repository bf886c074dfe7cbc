"""Session affinity: the backend each session (conversation, user) was last sent to.

A bounded LRU map ``session key → (backend index, last use)``. The key comes from a configurable
request header (default ``x-session-id``) or, failing that, the OpenAI ``user`` field. Entries older
than ``ttl_s`` are ignored. The router passes the remembered backend to the policy as a *soft* hint
(``ClusterSnapshot.session_backend``): the policy keeps the session there only while its own cost
model rates that backend within a slack of the best (docs/prefix.md).
"""

from __future__ import annotations

DEFAULT_MAX_SESSIONS = 100_000
DEFAULT_SESSION_TTL_S = 1800.0


class SessionTable:
    """Bounded LRU of session → backend (see module docstring)."""

    __slots__ = ("_entries", "_max", "_ttl_s")

    def __init__(
        self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = DEFAULT_SESSION_TTL_S
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be ≥ 1, got {max_sessions}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._entries: dict[str, tuple[int, float]] = {}
        self._max = max_sessions
        self._ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def backend_of(self, session: str, now_s: float) -> int:
        """The session's last backend, or -1 (no session, unknown or expired)."""
        if not session:
            return -1
        found = self._entries.get(session)
        if found is None or now_s - found[1] > self._ttl_s:
            return -1
        return found[0]

    def record(self, session: str, backend: int, now_s: float) -> None:
        """Remember that ``session`` was just sent to ``backend``."""
        if not session:
            return
        entries = self._entries
        entries.pop(session, None)
        entries[session] = (backend, now_s)
        while len(entries) > self._max:
            del entries[next(iter(entries))]

    def forget_backend(self, backend: int) -> None:
        """Drop every session last sent to ``backend`` (it left the cluster; O(sessions), rare)."""
        self._entries = {k: v for k, v in self._entries.items() if v[0] != backend}
