"""The ledger: the single owner of per-request mutable accounting (house style §3).

Per backend it keeps, in numpy arrays indexed like the router's backends:

- ``requests_in_flight``: dispatched and not yet released requests;
- ``input_tokens_in_flight``: Σ I_r;
- ``remaining_predicted_tokens``: Σ max(Õ_r − generated_r, 0) (closing the loop, method.md §5);
- ``generated_tokens_in_flight``: Σ tokens generated so far;
- ``predicted_output_tokens_in_flight``: Σ Õ_r as predicted at dispatch (the paper's kvusage
  numerator is Σ (I_r + Õ_r), method.md §5);
- ``workload``: L_s, Σ of the policy costs w_r^s of in-flight requests (method.md §5);
- ``prefill_pending_tokens``: Σ I_r of in-flight requests whose first token has not been seen yet
  (added at dispatch, removed once: at :meth:`Ledger.first_token`, or at release if none came);
- ``prefill_pending_uncached_tokens``: the same requests' Σ ``prefill_tokens`` (their prompts less the
  tokens expected in the engine's prefix cache), the prefill work queued ahead of a new request that
  the latency learner reads (``Ticket.pending_tokens_ahead``). It is the ledger's own: not in the
  snapshot, whose policies see the whole prompts (docs/prefix.md, "The cost model").

Invariant: every :meth:`Ledger.dispatch` is undone by exactly one effective
:meth:`Ledger.release`, whatever the outcome; a second release is a no-op that returns
False. When nothing is in flight every counter is exactly zero (``workload`` is re-zeroed
when a backend empties, so float rounding never accumulates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from hetroute.types import FloatArray, IntArray


@dataclass(slots=True)
class Ticket:
    """One dispatched request. Mutated only by the :class:`Ledger` that issued it."""

    request_id: str
    backend_index: int
    backend_name: str
    input_tokens: int
    predicted_output_tokens: int
    workload_cost: float
    dispatched_at_s: float
    policy: str = ""
    reason: str = ""
    generated_tokens: int = 0
    first_token_at_s: float | None = None
    released: bool = False
    released_at_s: float | None = None
    pending_tokens_ahead: float = 0.0
    """Σ ``prefill_tokens`` of the requests on the backend still waiting for their first token when this
    one was dispatched: the prefill work ahead of it (cached parts of those prompts are skipped)."""
    in_flight_at_first: float = 0.0
    context_at_first: float = 0.0
    prefill_tokens: int = 0
    """Prompt tokens the engine is expected to prefill: ``input_tokens`` less the tokens expected in its
    prefix cache (the router's estimate at dispatch); the latency learner fits prefill on it.
    ``prefill_pending_tokens`` still counts the whole prompt (docs/prefix.md, "The cost model")."""


class ItemView(Protocol):
    """Item access to a 1-D array through a memoryview: plain Python numbers in and out."""

    def __getitem__(self, i: int, /) -> float: ...
    def __setitem__(self, i: int, value: float, /) -> None: ...


def item_view(array: FloatArray | IntArray) -> ItemView:
    """A memoryview of the C-contiguous 1-D ``array`` (writes go to the array)."""
    return cast(ItemView, memoryview(cast(Any, array)))


FLOAT_ROWS = 6
"""Rows of the ledger's float counters (``Ledger.snapshot_arrays``), in this order:"""
INPUT_ROW, REMAINING_ROW, GENERATED_ROW, PREDICTED_ROW, WORKLOAD_ROW, PENDING_ROW = range(FLOAT_ROWS)


class Ledger:
    """Per-backend in-flight accounting with exactly-once release."""

    def __init__(self, backend_names: Sequence[str]) -> None:
        n = len(backend_names)
        self.backend_names: tuple[str, ...] = tuple(backend_names)
        self.requests_in_flight: IntArray = np.zeros(n, dtype=np.int64)
        self._floats: FloatArray = np.zeros((FLOAT_ROWS, n), dtype=np.float64)
        self.dispatched_total: IntArray = np.zeros(n, dtype=np.int64)
        self.released_total: IntArray = np.zeros(n, dtype=np.int64)
        self.prefill_pending_uncached_tokens: FloatArray = np.zeros(n, dtype=np.float64)
        self._bind_rows()
        self._in_flight = 0

    def _bind_rows(self) -> None:
        # The float counters are rows of one 2-D array, so a snapshot is one copy (see snapshot_arrays).
        self.input_tokens_in_flight: FloatArray = self._floats[INPUT_ROW]
        self.remaining_predicted_tokens: FloatArray = self._floats[REMAINING_ROW]
        self.generated_tokens_in_flight: FloatArray = self._floats[GENERATED_ROW]
        self.predicted_output_tokens_in_flight: FloatArray = self._floats[PREDICTED_ROW]
        self.workload: FloatArray = self._floats[WORKLOAD_ROW]
        self.prefill_pending_tokens: FloatArray = self._floats[PENDING_ROW]
        # The request path updates single counters through memoryviews of the same arrays: an item
        # read or write there is a plain Python int or float, about half the cost of indexing numpy
        # (the same float64 arithmetic). Rebound whenever an array is replaced (set_slot).
        self._rows = tuple(item_view(row) for row in self._floats)
        self._requests = item_view(self.requests_in_flight)
        self._dispatched = item_view(self.dispatched_total)
        self._released = item_view(self.released_total)
        self._uncached = item_view(self.prefill_pending_uncached_tokens)

    def set_slot(self, index: int, name: str) -> None:
        """Give slot ``index`` to backend ``name`` with empty accounting (live backend changes,
        :mod:`hetroute.backends.membership`). ``index`` is either one past the last slot (the arrays grow
        by one) or a slot with nothing in flight, whose totals restart at zero.

        Raises ValueError for any other index: a slot is never reused while a ticket may still release
        into it."""
        n = len(self.backend_names)
        if index == n:
            self.requests_in_flight = np.append(self.requests_in_flight, 0)
            self._floats = np.hstack([self._floats, np.zeros((FLOAT_ROWS, 1), dtype=np.float64)])
            self.dispatched_total = np.append(self.dispatched_total, 0)
            self.released_total = np.append(self.released_total, 0)
            self.prefill_pending_uncached_tokens = np.append(self.prefill_pending_uncached_tokens, 0.0)
            self._bind_rows()
            self.backend_names = (*self.backend_names, name)
            return
        if not 0 <= index < n or self.requests_in_flight[index] != 0:
            raise ValueError(f"ledger slot {index} is not free (in flight or out of range)")
        self._floats[:, index] = 0.0
        self.prefill_pending_uncached_tokens[index] = 0.0
        self.dispatched_total[index] = 0
        self.released_total[index] = 0
        names = list(self.backend_names)
        names[index] = name
        self.backend_names = tuple(names)

    def snapshot_arrays(self) -> tuple[IntArray, FloatArray]:
        """Read-only copies: ``requests_in_flight``, and a 6×n array whose rows are, in order,
        ``input_tokens_in_flight``, ``remaining_predicted_tokens``, ``generated_tokens_in_flight``,
        ``predicted_output_tokens_in_flight``, ``workload`` and ``prefill_pending_tokens``.

        Rows (views) of a read-only array are read-only, so one flag write covers all six.
        """
        requests = self.requests_in_flight.copy()
        requests.flags.writeable = False
        floats = self._floats.copy()
        floats.flags.writeable = False
        return requests, floats

    def dispatch(
        self,
        *,
        request_id: str,
        backend_index: int,
        input_tokens: int,
        predicted_output_tokens: int,
        workload_cost: float,
        now_s: float,
        policy: str = "",
        reason: str = "",
        prefill_tokens: int | None = None,
    ) -> Ticket:
        """Record a request sent to ``backend_index``; returns the ticket to release later.

        ``prefill_tokens`` (default ``input_tokens``) is the part of the prompt expected to need
        prefill (the rest is expected in the engine's prefix cache); it is recorded on the ticket."""
        i = backend_index
        prefill = input_tokens if prefill_tokens is None else max(0, min(prefill_tokens, input_tokens))
        uncached = self._uncached
        ahead = float(uncached[i])
        inp, rem, _, pred, work, pend = self._rows
        self._requests[i] += 1
        inp[i] += input_tokens
        rem[i] += predicted_output_tokens
        pred[i] += predicted_output_tokens
        work[i] += workload_cost
        pend[i] += input_tokens
        uncached[i] += prefill
        self._dispatched[i] += 1
        self._in_flight += 1
        return Ticket(
            request_id=request_id,
            backend_index=i,
            backend_name=self.backend_names[i],
            input_tokens=input_tokens,
            predicted_output_tokens=predicted_output_tokens,
            workload_cost=workload_cost,
            dispatched_at_s=now_s,
            policy=policy,
            reason=reason,
            pending_tokens_ahead=ahead,
            prefill_tokens=prefill,
        )

    def first_token(self, ticket: Ticket, now_s: float) -> None:
        """Mark the time of the first token (idempotent): its prompt is no longer pending prefill.

        Also records on the ticket the backend's load at that instant (requests in flight and their
        Σ I + generated), which the latency learner reads when the request completes.
        """
        if ticket.first_token_at_s is None and not ticket.released:
            i = ticket.backend_index
            ticket.first_token_at_s = now_s
            rows = self._rows
            rows[PENDING_ROW][i] -= ticket.input_tokens
            self._uncached[i] -= ticket.prefill_tokens
            ticket.in_flight_at_first = float(self._requests[i])
            ticket.context_at_first = float(rows[INPUT_ROW][i] + rows[GENERATED_ROW][i])

    def observe_generated(self, ticket: Ticket, generated_tokens: int) -> None:
        """Replace predicted tokens with observed ones: ``generated_tokens`` is cumulative.

        KV estimate per request = I + generated + max(Õ − generated, 0).
        """
        if ticket.released or generated_tokens <= ticket.generated_tokens:
            return
        i = ticket.backend_index
        old_remaining = max(ticket.predicted_output_tokens - ticket.generated_tokens, 0)
        new_remaining = max(ticket.predicted_output_tokens - generated_tokens, 0)
        rows = self._rows
        rows[GENERATED_ROW][i] += generated_tokens - ticket.generated_tokens
        rows[REMAINING_ROW][i] += new_remaining - old_remaining
        ticket.generated_tokens = generated_tokens

    def release(self, ticket: Ticket, now_s: float) -> bool:
        """Undo the ticket's dispatch. Effective exactly once; later calls return False."""
        if ticket.released:
            return False
        ticket.released = True
        ticket.released_at_s = now_s
        i = ticket.backend_index
        inp, rem, gen, pred, work, pend = self._rows
        requests = self._requests
        requests[i] -= 1
        inp[i] -= ticket.input_tokens
        rem[i] -= max(ticket.predicted_output_tokens - ticket.generated_tokens, 0)
        gen[i] -= ticket.generated_tokens
        pred[i] -= ticket.predicted_output_tokens
        work[i] -= ticket.workload_cost
        if ticket.first_token_at_s is None:
            pend[i] -= ticket.input_tokens
            self._uncached[i] -= ticket.prefill_tokens
        self._released[i] += 1
        self._in_flight -= 1
        if requests[i] == 0:
            # Token counters are integral sums and return to 0 exactly; the float load may
            # carry rounding error, so reset it when the backend is empty.
            work[i] = 0.0
        return True

    def in_flight(self) -> int:
        """Requests dispatched and not yet released, over all backends."""
        return self._in_flight

    def backend_load(self, index: int) -> dict[str, float]:
        """The accounting of one backend as plain numbers (for /admin/backends)."""
        return {
            "requests_in_flight": int(self.requests_in_flight[index]),
            "input_tokens_in_flight": float(self.input_tokens_in_flight[index]),
            "remaining_predicted_tokens": float(self.remaining_predicted_tokens[index]),
            "generated_tokens_in_flight": float(self.generated_tokens_in_flight[index]),
            "predicted_output_tokens_in_flight": float(self.predicted_output_tokens_in_flight[index]),
            "workload": float(self.workload[index]),
            "prefill_pending_tokens": float(self.prefill_pending_tokens[index]),
            "prefill_pending_uncached_tokens": float(self.prefill_pending_uncached_tokens[index]),
            "dispatched_total": int(self.dispatched_total[index]),
            "released_total": int(self.released_total[index]),
        }

    def is_zero(self) -> bool:
        """True when nothing is in flight and every counter is exactly zero."""
        return (
            self._in_flight == 0
            and not self.requests_in_flight.any()
            and not self.input_tokens_in_flight.any()
            and not self.remaining_predicted_tokens.any()
            and not self.generated_tokens_in_flight.any()
            and not self.predicted_output_tokens_in_flight.any()
            and not self.workload.any()
            and not self.prefill_pending_tokens.any()
            and not self.prefill_pending_uncached_tokens.any()
            and bool((self.dispatched_total == self.released_total).all())
        )
