"""The router: the one per-request orchestrator of a routing decision.

``Router.route`` (1) finds the backends that serve the request's model and API,
(2) drops those that are unavailable or excluded (already tried), (3) builds an immutable
:class:`~hetroute.types.ClusterSnapshot`, (4) asks the policy, and (5) records the dispatch
in the ledger. It holds no per-request state of its own: the returned
:class:`~hetroute.routing.ledger.Ticket` must be released with :meth:`Router.release`
exactly once, in a ``finally``.

The same class serves the gateway (real clock, health and scraped metrics) and the
simulator (``ManualClock``, engine state as metrics), so the simulator predicts what the
gateway does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from hetroute.errors import NoBackendAvailable, UnknownModel
from hetroute.routing.ledger import Ledger, Ticket
from hetroute.types import (
    Api,
    BackendSpec,
    Clock,
    ClusterSnapshot,
    EngineMetrics,
    FloatArray,
    IntArray,
    Policy,
    RequestFeatures,
    engine_speaks,
)

AvailabilityFn = Callable[[int], bool]
MetricsFn = Callable[[int], "EngineMetrics | None"]
DecisionObserver = Callable[[str, str, float], None]


def _always(_: int) -> bool:
    return True


def _no_metrics(_: int) -> EngineMetrics | None:
    return None


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class Router:
    """Chooses a backend per request with a pluggable policy and records it in the ledger."""

    def __init__(
        self,
        backends: Sequence[BackendSpec],
        policy: Policy,
        ledger: Ledger,
        clock: Clock,
        *,
        is_available: AvailabilityFn | None = None,
        latest_metrics: MetricsFn | None = None,
        on_decision: DecisionObserver | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not backends:
            raise ValueError("a router needs at least one backend")
        if ledger.backend_names != tuple(b.name for b in backends):
            raise ValueError("the ledger's backends differ from the router's")
        self.backends: tuple[BackendSpec, ...] = tuple(backends)
        self.policy = policy
        self.ledger = ledger
        self.clock = clock
        self._is_available = is_available or _always
        self._latest_metrics = latest_metrics or _no_metrics
        self._on_decision = on_decision
        self._timer = timer
        self._serving: dict[tuple[str, Api], tuple[int, ...]] = {}
        self._profile_caps: FloatArray = np.array(
            [
                float(b.profile.kv_capacity_tokens) if b.profile is not None else math.nan
                for b in self.backends
            ],
            dtype=np.float64,
        )
        self._config_caps: FloatArray = np.array(
            [
                float(b.kv_capacity_tokens) if b.kv_capacity_tokens is not None else math.nan
                for b in self.backends
            ],
            dtype=np.float64,
        )

    def serving(self, model: str, api: Api) -> tuple[int, ...]:
        """Indices of the backends that serve ``model`` through ``api`` (cached)."""
        key = (model, api)
        found = self._serving.get(key)
        if found is None:
            found = tuple(i for i, b in enumerate(self.backends) if b.serves(model, api))
            self._serving[key] = found
        return found

    def models(self, api: Api | None = None) -> tuple[str, ...]:
        """Every model some backend serves (through ``api`` when given), in config order."""
        seen: dict[str, None] = {}
        for b in self.backends:
            if api is None or engine_speaks(b.engine, api):
                for m in b.models:
                    seen.setdefault(m, None)
        return tuple(seen)

    def snapshot(self) -> ClusterSnapshot:
        """An immutable copy of the cluster state now (ledger, health, engine metrics)."""
        n = len(self.backends)
        metrics = tuple(self._latest_metrics(i) for i in range(n))
        # KV capacity: the profile, then the engine's own report, then the config (types.py).
        caps = self._profile_caps.copy()
        for i, m in enumerate(metrics):
            if math.isnan(caps[i]):
                if m is not None and m.kv_capacity_tokens is not None:
                    caps[i] = float(m.kv_capacity_tokens)
                else:
                    caps[i] = self._config_caps[i]
        led = self.ledger
        return ClusterSnapshot(
            now_s=self.clock.now(),
            backends=self.backends,
            metrics=metrics,
            requests_in_flight=_readonly(led.requests_in_flight.copy()),
            input_tokens_in_flight=_readonly(led.input_tokens_in_flight.copy()),
            remaining_predicted_tokens=_readonly(led.remaining_predicted_tokens.copy()),
            generated_tokens_in_flight=_readonly(led.generated_tokens_in_flight.copy()),
            predicted_output_tokens_in_flight=_readonly(led.predicted_output_tokens_in_flight.copy()),
            workload=_readonly(led.workload.copy()),
            prefill_pending_tokens=_readonly(led.prefill_pending_tokens.copy()),
            available=_readonly(np.array([self._is_available(i) for i in range(n)], dtype=np.bool_)),
            kv_capacity_tokens=_readonly(caps),
        )

    def route(self, features: RequestFeatures, exclude: Collection[int] = ()) -> Ticket:
        """Choose a backend for ``features`` and record the dispatch.

        Raises :class:`UnknownModel` when no backend serves the model through the API and
        :class:`NoBackendAvailable` when every serving backend is unavailable or excluded.
        """
        serving = self.serving(features.model, features.api)
        if not serving:
            raise UnknownModel(features.model)
        started = self._timer()
        snap = self.snapshot()
        cand_list = [i for i in serving if snap.available[i] and i not in exclude]
        if not cand_list:
            raise NoBackendAvailable(features.model)
        candidates: IntArray = np.array(cand_list, dtype=np.int64)
        decision = self.policy.choose(features, snap, candidates)
        if decision.index not in cand_list:
            raise RuntimeError(
                f"policy {self.policy.name!r} chose backend index {decision.index}, "
                f"not a candidate {cand_list}"
            )
        ticket = self.ledger.dispatch(
            request_id=features.request_id,
            backend_index=decision.index,
            input_tokens=features.input_tokens,
            predicted_output_tokens=features.predicted_output_tokens,
            workload_cost=decision.workload_cost,
            now_s=snap.now_s,
            policy=self.policy.name,
            reason=decision.reason,
        )
        if self._on_decision is not None:
            self._on_decision(self.policy.name, self.backends[decision.index].name, self._timer() - started)
        return ticket

    def release(self, ticket: Ticket) -> bool:
        """Release a ticket's accounting; effective exactly once."""
        return self.ledger.release(ticket, self.clock.now())
