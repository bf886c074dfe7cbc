"""The admission queue in the simulator: the gateway's queue code in front of the real router.

Owns :class:`SimAdmission` (what ``run_simulation(admission=...)`` takes) and
:class:`AdmittedRun`, a simulation run whose arrivals go through the same
:class:`~hetroute.admission.queue.AdmissionQueue` and :class:`~hetroute.admission.full.Placer`
as the gateway's :class:`~hetroute.admission.gate.AdmissionGate`:

- an arrival is dispatched at once when nothing waits and a backend is not full, otherwise it
  is queued (or shed with ``queue_full``);
- every step end (completions free capacity; before the engine plans its next step), every
  scrape and a timer at the earliest wait deadline pump the queue: expired requests are shed
  (``wait_timeout``), then requests leave in priority / ageing / weighted-fair order while
  the policy's choice is not full, each placed by the policy at that moment (late binding).

A shed request never reaches an engine or the ledger; its TTFT and end-to-end time stay NaN
and it is counted in ``SimResult.extra["shed_<reason>"]``. Per request, ``queue_wait_s`` is the
time spent queued until dispatch or shed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetroute.admission.config import AdmissionConfig
from hetroute.admission.full import Placer
from hetroute.admission.queue import AdmissionQueue, Shed
from hetroute.clock import ManualClock
from hetroute.learning.live import LiveModels
from hetroute.routing.router import Router
from hetroute.sim.cluster_file import Fleet
from hetroute.sim.workload import SimRequest
from hetroute.simulation.run import WAKE, Run, Slowdown
from hetroute.types import OutputLengthPredictor

Events = list[tuple[float, int, int]]


@dataclass(frozen=True, slots=True)
class SimAdmission:
    """The queue's config, and each request's (class, tenant) by request id (default: the
    ``default_class`` and tenant ``default``)."""

    config: AdmissionConfig
    labels: Mapping[str, tuple[str, str]] = field(default_factory=dict)


class AdmittedRun(Run):
    """A :class:`Run` whose arrivals wait in the admission queue while every backend is full."""

    def __init__(
        self,
        fleet: Fleet,
        workload: Sequence[SimRequest],
        router: Router,
        predictor: OutputLengthPredictor,
        clock: ManualClock,
        scrape_interval_s: float,
        admission: SimAdmission,
        learner: LiveModels | None = None,
        slowdowns: Sequence[Slowdown] = (),
    ) -> None:
        super().__init__(fleet, workload, router, predictor, clock, scrape_interval_s, learner, slowdowns)
        cfg = admission.config
        self.queue: AdmissionQueue[int] = AdmissionQueue(cfg)
        self.placer = Placer(router, cfg.full)
        default = (cfg.default_class, "default")
        self.labels = [
            (cfg.class_index(c), t)
            for c, t in (admission.labels.get(r.request_id, default) for r in workload)
        ]
        self.queue_wait_s = np.zeros(len(workload))
        self.shed: Counter[str] = Counter()
        self.wake_at_s: float | None = None

    def on_arrival(self, k: int, now_s: float) -> Events:
        self.arrivals_left -= 1
        features = self.features_of(k)
        self._flush_generated()
        class_index, tenant = self.labels[k]
        self.placer.arrived(features, now_s)
        if not len(self.queue):
            ticket = self.placer.place(features, 1, self.queue.class_config(class_index))
            if ticket is not None:
                return self.submit(k, ticket, now_s)
        try:
            self.queue.offer(features, class_index, tenant, k, now_s)
        except Shed as shed:
            self.shed[shed.reason] += 1
            self.open_requests -= 1
            return []
        return self._pump(now_s)

    def refill(self, now_s: float) -> Events:
        return self._pump(now_s)

    def on_scrape(self, now_s: float) -> Events:
        return super().on_scrape(now_s) + self._pump(now_s)

    def on_wake(self, now_s: float) -> Events:
        self.wake_at_s = None
        return self._pump(now_s)

    def _pump(self, now_s: float) -> Events:
        queue = self.queue
        if not len(queue):
            return []
        for entry in queue.expire(now_s):
            self.queue_wait_s[entry.payload] = now_s - entry.enqueued_s
            self.shed["wait_timeout"] += 1
            self.open_requests -= 1
        self._flush_generated()
        result = queue.pump(now_s, self.placer.place)
        events: Events = []
        for entry, ticket in result.dispatched:
            self.queue_wait_s[entry.payload] = now_s - entry.enqueued_s
            self.submit(entry.payload, ticket, now_s, start=False)
        for e in {ticket.backend_index for _, ticket in result.dispatched}:
            if self.pending[e] is None and self.engines[e].has_work():
                events += self._start_step(e, now_s)
        for _, exc in result.failed:
            raise exc  # the simulator has no unavailable backends and checked the models
        deadline = queue.next_deadline_s()
        if deadline is not None and (self.wake_at_s is None or deadline < self.wake_at_s):
            self.wake_at_s = deadline
            events.append((deadline, WAKE, 0))
        return events

    def admission_result(self) -> dict[str, Any]:
        extra = {f"shed_{reason}": float(n) for reason, n in self.shed.items()}
        extra["queue_left"] = float(len(self.queue))
        return {"extra": extra, "queue_wait_s": self.queue_wait_s}
