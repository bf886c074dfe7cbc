"""Weighted fair sharing between tenants inside one priority class (start-time fair queueing).

Owns one FIFO per tenant and the virtual clock of one class. Each tenant's head carries a
virtual start tag; :meth:`FairQueues.peek` returns the head with the smallest tag and
:meth:`FairQueues.pop_head` advances that tenant by ``cost / weight``:

    on becoming backlogged:  S_t = max(V, F_t)
    on dispatch of t's head: V = S_t;  F_t = S_t + cost / w_t;  S_t = F_t (if t still waits)

so over any interval in which tenants stay backlogged, their dispatched cost is proportional
to their weights (within one request's cost), and a tenant that was idle banks no credit
(Goyal et al., "Start-time fair queueing", 1996). Ties go to the tenant that queued first.

Invariants: no empty tenant FIFO is kept; a tenant's state is dropped once it is empty and
owes nothing (``F_t <= V``), so memory is bounded by the waiting requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the fair queue needs from an entry."""

    @property
    def tenant(self) -> str: ...

    @property
    def cost(self) -> float: ...

    @property
    def seq(self) -> int: ...


E = TypeVar("E", bound=Queued)


class FairQueues(Generic[E]):
    """Per-tenant FIFOs of one class, served in weighted-fair order."""

    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self._weight_of = weight_of
        self._fifos: dict[str, deque[E]] = {}
        self._start: dict[str, float] = {}  # S_t of each backlogged tenant's head
        self._finish: dict[str, float] = {}  # F_t of each tenant's last dispatch
        self._vtime = 0.0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[E]:
        for fifo in self._fifos.values():
            yield from fifo

    def push(self, entry: E) -> None:
        t = entry.tenant
        fifo = self._fifos.get(t)
        if fifo is None:
            fifo = self._fifos[t] = deque()
            self._start[t] = max(self._vtime, self._finish.get(t, 0.0))
        fifo.append(entry)
        self._len += 1

    def peek(self) -> E | None:
        """The head with the smallest virtual start tag (earliest queued on ties), or None."""
        best: E | None = None
        best_key = (0.0, 0)
        for t, fifo in self._fifos.items():
            head = fifo[0]
            key = (self._start[t], head.seq)
            if best is None or key < best_key:
                best, best_key = head, key
        return best

    def oldest(self) -> E | None:
        """The entry queued first (smallest ``seq``) of all tenants' heads, or None."""
        heads = [fifo[0] for fifo in self._fifos.values()]
        return min(heads, key=lambda e: e.seq) if heads else None

    def pop_head(self, entry: E) -> None:
        """Dispatch ``entry``, which must be its tenant's head: charge the tenant."""
        t = entry.tenant
        fifo = self._fifos[t]
        if fifo[0] is not entry:
            raise ValueError("only a tenant's head can be dispatched")
        fifo.popleft()
        self._len -= 1
        start = self._start[t]
        self._vtime = max(self._vtime, start)
        self._finish[t] = start + entry.cost / self._weight_of(t)
        if fifo:
            self._start[t] = self._finish[t]
        else:
            self._drop(t)

    def remove(self, entry: E) -> bool:
        """Take ``entry`` out without charging its tenant (disconnect, shed). False if absent."""
        t = entry.tenant
        fifo = self._fifos.get(t)
        if fifo is None:
            return False
        try:
            fifo.remove(entry)
        except ValueError:
            return False
        self._len -= 1
        if not fifo:
            self._drop(t)
        return True

    def _drop(self, t: str) -> None:
        del self._fifos[t]
        del self._start[t]
        if self._finish.get(t, 0.0) <= self._vtime:
            self._finish.pop(t, None)
        # Finish tags of idle tenants at or below V no longer matter (max(V, F) = V).
        if len(self._finish) > 4 * (len(self._fifos) + 1):
            self._finish = {k: f for k, f in self._finish.items() if f > self._vtime or k in self._fifos}
