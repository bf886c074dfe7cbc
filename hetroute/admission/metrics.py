"""The ``hetroute_queue_*`` Prometheus metrics of the admission queue, on the app's registry.

Owns: ``hetroute_queue_length{class}`` (gauge, computed on scrape),
``hetroute_queue_wait_seconds{class,outcome}`` (histogram of the time spent waiting; outcome
``dispatched``, ``shed`` or ``disconnected``; requests dispatched without waiting observe 0),
``hetroute_queue_shed_total{class,reason}`` (429s: ``queue_full``, ``wait_timeout``) and
``hetroute_queue_disconnects_total{class}`` (clients gone while queued). Registered on the
injected registry only (house style §15), never the global one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_WAIT_BUCKETS_S = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class QueueMetrics:
    """The queue's metrics; ``length_of(class_index)`` is read at scrape time."""

    def __init__(
        self, registry: CollectorRegistry, classes: Sequence[str], length_of: Callable[[int], int]
    ) -> None:
        self.length = Gauge(
            "hetroute_queue_length", "Requests waiting in the admission queue.", ["class"], registry=registry
        )
        self.wait = Histogram(
            "hetroute_queue_wait_seconds", "Time spent in the admission queue.", ["class", "outcome"],
            buckets=_WAIT_BUCKETS_S, registry=registry,
        )  # fmt: skip
        self.shed = Counter(
            "hetroute_queue_shed", "Requests refused with 429 by the admission queue.", ["class", "reason"],
            registry=registry,
        )  # fmt: skip
        self.disconnects = Counter(
            "hetroute_queue_disconnects", "Clients that went away while queued.", ["class"], registry=registry
        )
        for i, name in enumerate(classes):

            def _len(i: int = i) -> float:
                return float(length_of(i))

            self.length.labels(name).set_function(_len)
