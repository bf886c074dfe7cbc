"""The gateway side of the admission queue: classify, wait (async), shed, wake.

Owns the asyncio adapter around :class:`~hetroute.admission.queue.AdmissionQueue`:

- :meth:`AdmissionGate.classify` maps a request's headers to (priority class, tenant):
  a configured API key (``Authorization: Bearer <key>``) first, then the class and tenant
  headers, then ``default_class`` and the tenant ``default`` (an unknown class name falls back
  to ``default_class``; a configured key without a tenant is its own tenant);
- :meth:`AdmissionGate.acquire` returns a dispatched :class:`Ticket` at once when nothing
  waits and a backend is not full; otherwise the request waits on a future that the pump
  resolves (late binding: the backend is chosen when it is dispatched). Beyond the bounds it
  raises :class:`Shed` (429). A cancelled waiter (client gone) leaves the queue at once; if it
  had just been dispatched, its ticket is released, so the ledger ends at zero either way;
- :meth:`AdmissionGate.wake` pumps the queue. The forwarder calls it when a request releases
  its ticket (a completion frees capacity); while requests wait, one timer also pumps every
  ``recheck_s`` (new scrapes and health changes) and one fires at the earliest wait deadline.
  Nothing polls in a tight loop.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from hetroute.admission.config import AdmissionConfig
from hetroute.admission.full import Placer
from hetroute.admission.metrics import QueueMetrics
from hetroute.admission.queue import AdmissionQueue, Entry, Shed
from hetroute.errors import UnknownModel
from hetroute.routing.ledger import Ticket
from hetroute.routing.router import Router
from hetroute.types import Clock, RequestFeatures


def _key_tenant(key: str) -> str:
    """A stable, non-secret tenant name for an unconfigured API key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class AdmissionGate:
    """Holds requests in the router while every candidate backend is full."""

    def __init__(
        self,
        config: AdmissionConfig,
        router: Router,
        placer: Placer,
        clock: Clock,
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self.router = router
        self.placer = placer
        self.clock = clock
        self.queue: AdmissionQueue[asyncio.Future[Ticket]] = AdmissionQueue(config)
        self._names = tuple(c.name for c in config.classes)
        self.metrics = QueueMetrics(registry, self._names, self.queue.length)
        self._default = config.class_index(config.default_class)
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._recheck_timer: asyncio.TimerHandle | None = None

    def classify(self, headers: Mapping[str, str]) -> tuple[int, str]:
        """(class index, tenant) of a request with these headers (module docstring)."""
        cfg = self.config
        cls_name = headers.get(cfg.class_header)
        tenant = headers.get(cfg.tenant_header)
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and len(auth) > 7:
            key = auth[7:].strip()
            known = cfg.api_keys.get(key)
            if known is not None:
                cls_name = known.priority_class or cls_name
                tenant = known.tenant or tenant or _key_tenant(key)
            elif tenant is None:
                tenant = _key_tenant(key)
        index = self._names.index(cls_name) if cls_name in self._names else self._default
        return index, tenant or "default"

    async def acquire(self, features: RequestFeatures, headers: Mapping[str, str]) -> Ticket:
        """A dispatched ticket for ``features``; raises :class:`Shed`, ``UnknownModel`` or
        ``NoBackendAvailable``. The caller releases the ticket exactly once, as for ``route``."""
        if not self.router.serving(features.model, features.api):
            raise UnknownModel(features.model)  # never queue what no backend serves
        class_index, tenant = self.classify(headers)
        name = self._names[class_index]
        now = self.clock.now()
        self.placer.arrived(features, now)
        if not len(self.queue):
            ticket = self.placer.place(features, 1, self.queue.class_config(class_index))
            if ticket is not None:
                self.metrics.wait.labels(name, "dispatched").observe(0.0)
                return ticket
        try:
            future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
            entry = self.queue.offer(features, class_index, tenant, future, now)
        except Shed as shed:
            self.metrics.shed.labels(name, shed.reason).inc()
            self.metrics.wait.labels(name, "shed").observe(0.0)
            raise
        self.wake()
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(entry)
            raise

    def _abandon(self, entry: Entry[asyncio.Future[Ticket]]) -> None:
        """The waiter was cancelled (client gone): leave the queue, or undo a fresh dispatch."""
        future = entry.payload
        name = self._names[entry.class_index]
        if self.queue.remove(entry):
            self.metrics.disconnects.labels(name).inc()
            self.metrics.wait.labels(name, "disconnected").observe(self.clock.now() - entry.enqueued_s)
            future.cancel()
            self._arm_timers()
        elif future.done() and not future.cancelled() and future.exception() is None:
            self.router.release(future.result())
            self.wake()

    def wake(self) -> None:
        """Shed expired waiters, then dispatch as many as fit (synchronous, cheap when empty)."""
        if not len(self.queue):
            self._cancel_timers()
            return
        now = self.clock.now()
        for entry in self.queue.expire(now):
            cfg = self.queue.class_config(entry.class_index)
            self.metrics.shed.labels(cfg.name, "wait_timeout").inc()
            self.metrics.wait.labels(cfg.name, "shed").observe(now - entry.enqueued_s)
            if not entry.payload.done():
                entry.payload.set_exception(Shed("wait_timeout", cfg.name, cfg.retry_after))
        result = self.queue.pump(now, self.placer.place)
        for entry, ticket in result.dispatched:
            self.metrics.wait.labels(self._names[entry.class_index], "dispatched").observe(
                now - entry.enqueued_s
            )
            if entry.payload.done():  # cannot happen: a cancelled waiter left the queue first
                self.router.release(ticket)
            else:
                entry.payload.set_result(ticket)
        for entry, exc in result.failed:
            if not entry.payload.done():
                entry.payload.set_exception(exc)
        self._arm_timers()

    def _arm_timers(self) -> None:
        self._cancel_timers()
        deadline = self.queue.next_deadline_s()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        self._deadline_timer = loop.call_later(max(0.0, deadline - self.clock.now()), self.wake)
        self._recheck_timer = loop.call_later(self.config.recheck_s, self.wake)

    def _cancel_timers(self) -> None:
        for timer in (self._deadline_timer, self._recheck_timer):
            if timer is not None:
                timer.cancel()
        self._deadline_timer = self._recheck_timer = None

    def close(self) -> None:
        """Stop the timers (app shutdown); waiting handlers are cancelled by the server."""
        self._cancel_timers()
