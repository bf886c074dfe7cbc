"""The admission queue: requests waiting in the router for a backend that is not full.

Owns the waiting requests of every priority class and the order in which they leave. It is
synchronous, does no I/O and reads time only from the ``now_s`` it is given, so the gateway
(:mod:`hetroute.admission.gate`) and the simulator (:mod:`hetroute.simulation.admission_run`) run the
same code.

Order of service (:meth:`AdmissionQueue.pump`):

1. **Ageing** (no starvation): a class whose oldest request has waited ``ageing_s`` and which
   has had no dispatch for ``ageing_s`` goes first (the most overdue such class);
2. otherwise **strict priority**: the highest non-empty class;
3. inside a class, **weighted fair sharing** between tenants (:mod:`hetroute.admission.fairness`),
   cost = the request's predicted tokens ``I + Õ``.

The chosen request is offered to ``place`` (late binding: the policy picks its backend at
that moment). When ``place`` answers None (every candidate is full) the pump stops: nothing
overtakes the head, so priorities hold. Bounds: :meth:`offer` refuses a request when its class
already holds ``max_queue_len``; :meth:`expire` removes requests older than ``max_queue_wait_s``.

Invariants: every offered entry leaves exactly once, through :meth:`pump` (dispatched or
failed), :meth:`expire` or :meth:`remove`; ``len(queue)`` is the number waiting, 0 when idle.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from hetroute.admission.config import AdmissionConfig, ClassConfig
from hetroute.admission.fairness import FairQueues
from hetroute.errors import HetrouteError
from hetroute.routing.ledger import Ticket
from hetroute.types import RequestFeatures

P = TypeVar("P")

ShedReason = Literal["queue_full", "wait_timeout"]


@dataclass(eq=False, slots=True)
class Entry(Generic[P]):
    """One waiting request; ``payload`` is the caller's handle (a future, a request index)."""

    features: RequestFeatures
    class_index: int
    tenant: str
    cost: float
    enqueued_s: float
    deadline_s: float
    seq: int
    payload: P


class Shed(Exception):
    """A request refused by the queue: the client gets 429 with ``Retry-After``."""

    def __init__(self, reason: ShedReason, priority_class: str, retry_after_s: int) -> None:
        what = "the queue is full" if reason == "queue_full" else "waited too long for a free backend"
        super().__init__(f"overloaded: {what} (class {priority_class})")
        self.reason: ShedReason = reason
        self.priority_class = priority_class
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Class(Generic[P]):
    config: ClassConfig
    fifos: FairQueues[Entry[P]]
    last_dispatch_s: float = -math.inf


@dataclass(slots=True)
class PumpResult(Generic[P]):
    """What one :meth:`AdmissionQueue.pump` did: entries dispatched with their ticket, and entries
    whose placement raised (unknown model, no available backend) with the error."""

    dispatched: list[tuple[Entry[P], Ticket]] = field(default_factory=list)
    failed: list[tuple[Entry[P], HetrouteError]] = field(default_factory=list)


PlaceFn = Callable[[RequestFeatures, int, ClassConfig], "Ticket | None"]
"""``place(features, waiting, klass)``: dispatch now (a ticket) or None; ``waiting`` counts this
request too; ``klass`` is its priority class."""


class AdmissionQueue(Generic[P]):
    """Priority classes × weighted-fair tenants, bounded in length and in waiting time."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._classes: list[_Class[P]] = [_Class(c, FairQueues(config.weight_of)) for c in config.classes]
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def length(self, class_index: int) -> int:
        return len(self._classes[class_index].fifos)

    def class_config(self, class_index: int) -> ClassConfig:
        return self._classes[class_index].config

    def offer(
        self, features: RequestFeatures, class_index: int, tenant: str, payload: P, now_s: float
    ) -> Entry[P]:
        """Queue a request; raises :class:`Shed` (``queue_full``) when its class is at its bound."""
        cls = self._classes[class_index]
        cfg = cls.config
        if len(cls.fifos) >= cfg.max_queue_len:
            raise Shed("queue_full", cfg.name, cfg.retry_after)
        cost = float(max(1, features.input_tokens + features.predicted_output_tokens))
        entry = Entry(
            features, class_index, tenant, cost, now_s, now_s + cfg.max_queue_wait_s, next(self._seq), payload
        )
        cls.fifos.push(entry)
        self._len += 1
        return entry

    def remove(self, entry: Entry[P]) -> bool:
        """Take a waiting entry out (client gone). False when it had already left."""
        if self._classes[entry.class_index].fifos.remove(entry):
            self._len -= 1
            return True
        return False

    def expire(self, now_s: float) -> list[Entry[P]]:
        """Remove and return every entry whose ``max_queue_wait_s`` has passed at ``now_s``.

        One wait bound per class, so a class's entries expire in queueing order: only the
        oldest heads are looked at (cheap when nothing expires).
        """
        out: list[Entry[P]] = []
        for cls in self._classes:
            while (oldest := cls.fifos.oldest()) is not None and oldest.deadline_s <= now_s:
                cls.fifos.remove(oldest)
                out.append(oldest)
        self._len -= len(out)
        return out

    def next_deadline_s(self) -> float | None:
        """The earliest ``deadline_s`` of a waiting entry (None when empty)."""
        best: float | None = None
        for cls in self._classes:
            head = cls.fifos.oldest()  # one wait bound per class: the oldest expires first
            if head is not None and (best is None or head.deadline_s < best):
                best = head.deadline_s
        return best

    def _select(self, now_s: float) -> Entry[P] | None:
        overdue: tuple[float, int] | None = None
        first: int | None = None
        for i, cls in enumerate(self._classes):
            if not len(cls.fifos):
                continue
            if first is None:
                first = i
                continue
            oldest = cls.fifos.oldest()
            assert oldest is not None
            waited = now_s - max(cls.last_dispatch_s, oldest.enqueued_s)
            if waited >= cls.config.ageing_s:
                over = waited - cls.config.ageing_s
                if overdue is None or over > overdue[0]:
                    overdue = (over, i)
        pick = overdue[1] if overdue is not None else first
        return None if pick is None else self._classes[pick].fifos.peek()

    def pump(self, now_s: float, place: PlaceFn) -> PumpResult[P]:
        """Dispatch waiting requests in service order until one cannot be placed (or none wait)."""
        result: PumpResult[P] = PumpResult()
        while self._len:
            entry = self._select(now_s)
            assert entry is not None
            try:
                ticket = place(entry.features, self._len, self._classes[entry.class_index].config)
            except HetrouteError as exc:  # unknown model, no available backend: the waiter gets it
                self._leave(entry, now_s, charge=False)
                result.failed.append((entry, exc))
                continue
            if ticket is None:
                break
            self._leave(entry, now_s, charge=True)
            result.dispatched.append((entry, ticket))
        return result

    def _leave(self, entry: Entry[P], now_s: float, *, charge: bool) -> None:
        cls = self._classes[entry.class_index]
        if charge:
            cls.fifos.pop_head(entry)
            cls.last_dispatch_s = now_s
        else:
            cls.fifos.remove(entry)
        self._len -= 1
