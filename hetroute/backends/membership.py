"""Live backend changes: add, remove and drain backends of a running gateway without a restart.

Every per-backend structure (the ledger's arrays, health records, scrapes, latency models, learned
models, prefix index, foreign load, telemetry) is indexed by *slot*. A slot's life:

- **member**: a backend of the cluster, routed to;
- **retired** (:meth:`Membership.remove`): no new request goes there from that instant, its probes and
  scrapes stop, and the requests already in flight run to their end; while some are, the slot is
  *draining*;
- **free**: retired with nothing in flight. The next :meth:`Membership.add` reuses the lowest free slot
  (every structure resets that slot) or, when there is none, appends a slot (every structure grows by
  one). Slots are never compacted, so an in-flight ticket's backend index stays valid; the number of
  slots is bounded by the largest number of members plus draining backends ever held at once.

A slot is reused only once nothing is in flight there (the ledger refuses otherwise), so a ticket
released late can never touch the accounting of the backend that took its slot.

Sources: the config file (reloaded on SIGHUP), the admin API and DNS discovery each own the backends
they added (``origin``); :meth:`Membership.reconcile` changes only the backends of one origin, so a
SIGHUP does not undo an admin change or a DNS answer, and the reverse.

The policy is rebuilt when a backend joins (its per-backend constants follow the new set; a policy's
round-robin position or random stream restarts then); a join the policy refuses (a per-backend weight
list of the old length) changes nothing. A retired slot is simply never a candidate again. Everything
here runs on the event loop between requests: a change is atomic with respect to routing decisions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetroute.backends.health import HealthTracker
from hetroute.backends.scrape import MetricsStore
from hetroute.clock import Sleeper
from hetroute.errors import ConfigError
from hetroute.learning.build import prior_of
from hetroute.learning.live import LiveModels, PriorModel
from hetroute.policies.backend_model import BackendModels
from hetroute.routing.router import Router
from hetroute.types import BackendSpec, Policy

log = logging.getLogger(__name__)

SIBLING_MIN_SAMPLES = 32
"""Requests a sibling's fit must rest on before a joining replica starts from it."""
DRAIN_POLL_S = 0.05
"""How often :meth:`Membership.drain` looks at the ledger."""

PolicyBuilder = Callable[[tuple[BackendSpec, ...], BackendModels], Policy]
SlotHook = Callable[[int, BackendSpec], None]


class MembershipError(ValueError):
    """A change that cannot be made as asked (duplicate name, unknown backend); the message says why."""


@dataclass(frozen=True, slots=True)
class Changes:
    """What :meth:`Membership.reconcile` did, by backend name."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.replaced)


class Membership:
    """The one place that changes the backend set of a running gateway (see module docstring)."""

    def __init__(
        self,
        *,
        router: Router,
        health: HealthTracker,
        metrics: MetricsStore,
        backend_models: BackendModels,
        build_policy: PolicyBuilder,
        learner: LiveModels | None = None,
        origin: str = "config",
    ) -> None:
        """Every backend the router starts with is a member owned by ``origin``."""
        self.router = router
        self.health = health
        self.metrics = metrics
        self.backend_models = backend_models
        self.learner = learner
        self._build_policy = build_policy
        self.origins: dict[int, str] = dict.fromkeys(router.members(), origin)
        self.on_join: list[SlotHook] = []
        """Called with (slot, spec) after a backend joined (the app starts its probe and scrape)."""
        self.on_leave: list[SlotHook] = []
        """Called with (slot, spec) after a backend was retired (the app stops its probe and scrape)."""

    # ------------------------------------------------------------------ queries

    def index_of(self, name: str) -> int | None:
        """The slot of member ``name``, or None."""
        backends = self.router.backends
        for i in self.router.members():
            if backends[i].name == name:
                return i
        return None

    def in_flight(self, index: int) -> int:
        return int(self.router.ledger.requests_in_flight[index])

    def state(self, index: int) -> str:
        """``member``, ``draining`` (retired, requests still in flight) or ``free``."""
        if index not in self.router.retired:
            return "member"
        return "draining" if self.in_flight(index) else "free"

    def members_of(self, origin: str) -> dict[str, int]:
        """Name → slot of the members ``origin`` added."""
        backends = self.router.backends
        return {backends[i].name: i for i in self.router.members() if self.origins.get(i) == origin}

    # ------------------------------------------------------------------ changes

    def add(self, spec: BackendSpec, origin: str = "admin") -> int:
        """Make ``spec`` a member, routed to from the next decision on; returns its slot.

        Raises :class:`MembershipError` when a member already has its name."""
        if self.index_of(spec.name) is not None:
            raise MembershipError(f"a backend named {spec.name!r} is already in the cluster")
        router = self.router
        free = [i for i in sorted(router.retired) if self.in_flight(i) == 0]
        i = free[0] if free else len(router.backends)
        # Everything that can fail runs first, on copies, so a refused change leaves all as it was: the
        # policy must accept the new set (a per-backend weight list of the old length does not).
        trial = list(router.backends)
        trial[i : i + 1] = [spec]
        models = self.backend_models.with_slot(i, spec)
        try:
            self._build_policy(tuple(trial), models)
        except ConfigError as exc:
            raise MembershipError(f"the policy cannot take backend {spec.name!r}: {exc}") from exc
        learned = self._starting_model(i, spec, models) if self.learner is not None else None
        router.set_slot(i, spec)
        self.health.set_slot(i, spec.name)
        self.metrics.set_slot(i)
        self.backend_models.adopt(models, i)  # resolved once, above
        if self.learner is not None and learned is not None:
            prior, start = learned
            self.learner.set_slot(
                i,
                spec.name,
                prior,
                float(self.backend_models.fallback_capacity_tokens[i]),
                float(self.backend_models.max_num_seqs[i]),
                start,
            )
        self.origins[i] = origin
        self._rebuild_policy()
        log.info("backend %s (%s) joined in slot %d (%s)", spec.name, spec.url, i, origin)
        for hook in self.on_join:
            hook(i, spec)
        return i

    def _starting_model(
        self, index: int, spec: BackendSpec, models: BackendModels
    ) -> tuple[PriorModel, tuple[float, ...]]:
        """Where the learner starts for ``spec`` joining in slot ``index`` (``models``: the static
        models with it): an identical replica's learned model, else its own prior (profile, roofline),
        else, when nothing is known, the median of the learned members, else the neutral default."""
        prior, start = prior_of(models.models[index])
        found = self._sibling_prior(index, spec)
        if found is None and prior.kind == "neutral":
            found = self._fleet_prior(index)
        return found if found is not None else (prior, start)

    def _sibling_prior(self, index: int, spec: BackendSpec) -> tuple[PriorModel, tuple[float, ...]] | None:
        """For a backend with no profile of its own: the model a *sibling* learned, a member identical
        but for its name and URL (same engine, models, GPU, TP, labels, limits: another replica, as a
        DNS answer or an autoscaler adds them), fitted on at least ``SIBLING_MIN_SAMPLES`` requests.
        Without it a replica would join on the neutral default while its siblings are learned, and
        the min-max policy would send it nearly nothing until exploration taught it."""
        learner = self.learner
        if learner is None or spec.profile is not None:
            return None
        backends = self.router.backends
        best: tuple[int, int] | None = None
        for j in self.router.members():
            if j == index or replace(backends[j], name=spec.name, url=spec.url) != spec:
                continue
            fit = learner.fit_of(j)
            samples = fit.samples if fit is not None else 0
            if samples >= SIBLING_MIN_SAMPLES and (best is None or samples > best[1]):
                best = (j, samples)
        if best is None:
            return None
        j, samples = best
        params = tuple(float(v) for v in learner.params[j])
        source = f"learned by its sibling {backends[j].name} ({samples} samples)"
        return PriorModel(params, source, "saved"), params

    def _fleet_prior(self, index: int) -> tuple[PriorModel, tuple[float, ...]] | None:
        """For a backend nothing is known about (no profile, no catalog prior, no sibling): the
        element-wise median of p1..p8 over the members fitted on at least ``SIBLING_MIN_SAMPLES``
        requests. Beside learned members the neutral default rates a newcomer far slower than they
        are (it is tuned for a fleet where nothing is known), so the min-max policy would send it only
        exploration probes and it would learn slowly; starting from a typical member, it takes a
        share at once and its own requests correct the model within a few refits."""
        learner = self.learner
        if learner is None:
            return None
        fitted = []
        for j in self.router.members():
            fit = learner.fit_of(j) if j != index else None
            if fit is not None and fit.samples >= SIBLING_MIN_SAMPLES:
                fitted.append(j)
        if not fitted:
            return None
        params = tuple(float(v) for v in np.median(learner.params[fitted], axis=0))
        return PriorModel(params, f"median of {len(fitted)} learned member(s)", "fleet"), params

    def remove(self, name: str) -> int:
        """Stop routing to member ``name`` at once; its in-flight requests finish. Returns its slot.

        Raises :class:`MembershipError` for a name that is not a member."""
        i = self.index_of(name)
        if i is None:
            raise MembershipError(f"no backend named {name!r} in the cluster")
        spec = self.router.backends[i]
        self.router.retire(i)
        self.health.retire(i)
        self.origins.pop(i, None)
        log.info("backend %s left (slot %d, %d request(s) still in flight)", name, i, self.in_flight(i))
        for hook in self.on_leave:
            hook(i, spec)
        return i

    def reconcile(self, specs: Sequence[BackendSpec], origin: str) -> Changes:
        """Make the members owned by ``origin`` exactly ``specs`` (by name): add the new ones, remove the
        missing ones, and replace (remove, then add) those whose spec changed. Members of other origins
        are left alone; a name another origin already uses raises :class:`MembershipError` before
        anything changes."""
        mine = self.members_of(origin)
        wanted = {s.name: s for s in specs}
        if len(wanted) != len(specs):
            raise MembershipError(f"duplicate backend names from {origin}")
        for name in wanted:
            if name not in mine and self.index_of(name) is not None:
                raise MembershipError(f"backend {name!r} from {origin} is already in the cluster")
        backends = self.router.backends
        removed = tuple(n for n in mine if n not in wanted)
        replaced = tuple(n for n, i in mine.items() if n in wanted and backends[i] != wanted[n])
        added = tuple(n for n in wanted if n not in mine)
        for name in removed + replaced:
            self.remove(name)
        for name in replaced + added:
            self.add(wanted[name], origin)
        return Changes(added, removed, replaced)

    async def drain(self, index: int, timeout_s: float, sleep: Sleeper = asyncio.sleep) -> bool:
        """Wait until nothing is in flight on retired slot ``index`` (True) or ``timeout_s`` passed
        (False), looking every ``DRAIN_POLL_S``."""
        clock = self.router.clock
        deadline = clock.now() + timeout_s
        while self.in_flight(index):
            if clock.now() >= deadline:
                return False
            await sleep(min(DRAIN_POLL_S, max(deadline - clock.now(), 0.0)))
        return True

    def _rebuild_policy(self) -> None:
        self.router.policy = self._build_policy(self.router.backends, self.backend_models)
