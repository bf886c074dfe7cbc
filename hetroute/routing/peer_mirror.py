"""What the peers did since their last summary, assumed to mirror what this replica did meanwhile.

Owns :class:`OwnHistory`: this replica's own ledger arrays after each of its dispatches and releases
over the last ``follow_s``, and :meth:`OwnHistory.mirrored`, the load the current peers are assumed to
have added since their summaries.

Why: a peer's summary is up to one publishing interval (plus transit) old. A peer sends one within
``interval_s`` of any dispatch or release of its own, so whatever it did that this replica has not
seen happened within the last ``interval_s`` + transit, and after the summary. Behind a round-robin
Service every replica receives a like share of the traffic and decides on a like view, so its unseen
change is estimated as this replica's own net change over the same span: for peer ``p`` whose summary
arrived at ``r_p``, ``own(last) − own(max(r_p, now − follow_s))`` (requests in flight and the ledger's
six rows, as they stood after this replica's last dispatch or release and at that instant), with
``follow_s`` = max(2 × ``interval_s``, a heartbeat) (:func:`hetroute.peer_settings.mirror_follow_s`:
under a burst a busy event loop sends and reads summaries late). Summed over the current peers and
added to their summaries, clamped at zero. In steady state a replica's net change over a few ms is
near zero, so this adds little; in a burst (every replica dispatching at once, before any summary can
arrive) it counts the others' dispatches, which the summaries alone cannot (the simulator's rate-∞
cells: docs/replicas.md).

Every dispatch and release is marked (two array copies, about 1 µs), so ``own(t)`` is exact at every
instant; the generated-token growth of the requests in flight between them is not mirrored (a peer's
summary carries its own).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import cast

from hetroute.types import FloatArray, IntArray


class OwnHistory:
    """This replica's own ledger arrays after its recent dispatches and releases; see the module docstring."""

    __slots__ = ("follow_s", "_times", "_marks")

    def __init__(self, follow_s: float) -> None:
        if not follow_s > 0:
            raise ValueError(f"follow_s must be > 0, got {follow_s}")
        self.follow_s = follow_s
        self._times: deque[float] = deque()
        self._marks: deque[tuple[IntArray, FloatArray]] = deque()

    def mark(self, now_s: float, requests: IntArray, floats: FloatArray) -> None:
        """The own arrays (read-only snapshots, kept by reference) are these from ``now_s`` on (after a
        dispatch or release, and once at the start); a time not after the latest mark's replaces that
        mark's arrays, so the marks stay in time order. Marks no longer needed (older than ``follow_s``
        and not the latest such) are dropped."""
        times = self._times
        if times and now_s <= times[-1]:  # the same instant (or a caller's older clock reading)
            self._marks[-1] = (requests, floats)
        else:
            times.append(now_s)
            self._marks.append((requests, floats))
        cutoff = now_s - self.follow_s
        while len(times) >= 2 and times[1] <= cutoff:
            times.popleft()
            self._marks.popleft()

    def clear(self) -> None:
        """Drop every mark (the backend set changed: the arrays' shape with it)."""
        self._times.clear()
        self._marks.clear()

    def at(self, t_s: float) -> tuple[IntArray, FloatArray] | None:
        """The own arrays as they stood at ``t_s`` (the earliest mark when all are later); None when empty."""
        if not self._times:
            return None
        k = bisect_right(self._times, t_s) - 1
        return self._marks[max(k, 0)]

    def mirrored(self, now_s: float, received_at_s: Sequence[float]) -> tuple[FloatArray, FloatArray] | None:
        """The load the peers whose summaries arrived at ``received_at_s`` are assumed to have added since
        (their sum; negative where this replica released more than it dispatched); None without peers
        or marks, or when this replica has not changed since any of those instants."""
        times = self._times
        if not received_at_s or not times:
            return None
        window_start = now_s - self.follow_s
        last = len(times) - 1
        counts: dict[int, int] = {}
        for received in received_at_s:
            k = bisect_right(times, received if received > window_start else window_start) - 1
            k = k if k > 0 else 0
            if k != last:
                counts[k] = counts.get(k, 0) + 1
        if not counts:  # no own dispatch or release since any of them
            return None
        marks = self._marks
        last_requests, last_floats = marks[last]
        n = float(sum(counts.values()))
        requests = cast(FloatArray, n * last_requests)
        floats: FloatArray = n * last_floats
        for k, count in counts.items():
            base_requests, base_floats = marks[k]
            requests -= count * base_requests if count != 1 else base_requests
            floats -= count * base_floats if count != 1 else base_floats
        return requests, floats
