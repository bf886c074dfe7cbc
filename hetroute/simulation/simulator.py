"""Discrete-event simulation of a cluster of engines driving the REAL routing code.

Owns :func:`run_simulation` and its results (:class:`SimResult`, :class:`InstanceResult`): it builds the
gateway's own :class:`Router`, policy, :class:`Ledger`, latency learner and output-length predictor
over a fleet of engine models, runs them with :class:`hetroute.simulation.run.Run` (the event loop;
:class:`hetroute.simulation.admission_run.AdmittedRun` with an admission queue) and sums up the run.

Throughput is (input + output tokens of completed requests) / makespan, where the makespan runs from
the first arrival to the last completion (method.md §8).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import predictors
from hetroute.clock import ManualClock
from hetroute.config import ScrapeConfig
from hetroute.errors import ConfigError
from hetroute.learning.build import build_live_models
from hetroute.learning.live import LiveModels
from hetroute.learning.settings import LearningConfig
from hetroute.peer_settings import mirror_follow_s
from hetroute.policies import PolicyContext, build_policy
from hetroute.policies.backend_model import BackendModels
from hetroute.prefix.settings import PrefixConfig
from hetroute.prefix.state import PrefixState
from hetroute.routing.foreign import DEFAULT_FOREIGN_MODE, ForeignMode
from hetroute.routing.ledger import Ledger
from hetroute.routing.peers import DEFAULT_STALE_INTERVALS, PeerView, peer_heartbeat_s
from hetroute.routing.router import Router
from hetroute.sim.cluster_file import Fleet, SimClusterSpec, build_fleet
from hetroute.sim.workload import SimRequest
from hetroute.simulation.admission_run import AdmittedRun, SimAdmission
from hetroute.simulation.run import Run, Slowdown
from hetroute.types import FloatArray, IntArray, Policy

DEFAULT_PREFIX = PrefixConfig()

GATEWAY_SCRAPE_INTERVAL_S = ScrapeConfig().interval_s
"""The gateway's default ``scrape.interval_s``: by default the simulated router sees metrics as stale as
the real one does."""


@dataclass(frozen=True, slots=True)
class InstanceResult:
    """Per-instance outcome: ``completion_time_s`` is when its last request finished (0 if none)."""

    name: str
    gpu: str
    tp: int
    requests: int
    input_tokens: int
    output_tokens: int
    completion_time_s: float
    busy_s: float
    steps: int
    preemptions: int
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated run. Arrays are per request in workload order; NaN where not completed."""

    policy: str
    predictor: str
    num_requests: int
    completed: int
    rejected: int
    makespan_s: float
    input_tokens: int
    output_tokens: int
    instances: tuple[InstanceResult, ...]
    ttft_s: FloatArray
    e2e_s: FloatArray
    backend_index: IntArray
    events: int
    wall_s: float
    ledger_zero: bool
    extra: Mapping[str, float] = field(default_factory=dict)
    learned: LiveModels | None = None
    """The live models at the end of the run (``learning`` on), for inspection."""
    queue_wait_s: FloatArray | None = None
    """Per request: seconds in the admission queue until dispatch or shed (None without a queue)."""

    @property
    def throughput_tokens_per_s(self) -> float:
        """(input + output tokens) / makespan."""
        return (self.input_tokens + self.output_tokens) / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def percentile(self, which: str, q: float) -> float:
        """The q-th percentile (0..100) of ``ttft_s`` or ``e2e_s`` over completed requests (NaN if none)."""
        values = self.ttft_s if which == "ttft" else self.e2e_s
        done = values[~np.isnan(values)]
        return float(np.percentile(done, q)) if done.size else math.nan


def run_simulation(
    cluster: SimClusterSpec | Fleet,
    workload: Sequence[SimRequest],
    policy_name: str | Policy,
    policy_params: Mapping[str, object] | None = None,
    *,
    predictor: str = predictors.DEFAULT_PREDICTOR,
    predictor_params: Mapping[str, object] | None = None,
    seed: int = 0,
    scrape_interval_s: float = GATEWAY_SCRAPE_INTERVAL_S,
    label: str | None = None,
    learning: LearningConfig | None = None,
    slowdowns: Sequence[Slowdown] = (),
    admission: SimAdmission | None = None,
    prefix: PrefixConfig | None = DEFAULT_PREFIX,
    replicas: int = 1,
    peer_hint: bool = False,
    foreign: ForeignMode = DEFAULT_FOREIGN_MODE,
    client_connections: int = 0,
    peer_interval_s: float = 0.0,
    peer_mirror: bool = True,
) -> SimResult:
    """Simulate ``workload`` (sorted by arrival) on ``cluster`` routed by ``policy_name``.

    ``cluster`` may be a :class:`SimClusterSpec` (catalogs are loaded) or a prepared :class:`Fleet`
    (``build_fleet``; reuse it across runs to skip catalog and profile loading). ``learning`` turns on the
    gateway's live latency learning (same code; the refit runs every ``refit_interval_s`` of modelled
    time) and ``slowdowns`` injects slow-down faults. ``policy_name`` is a
    registry name (built with ``policy_params`` by ``build_policy``) or a ready :class:`Policy`
    object (``policy_params`` ignored; it must be fresh, policies keep private state). The policy and
    predictor get ``seed``. ``label`` names the run in the result (default: the policy's name).
    ``admission`` puts the gateway's admission queue in front of the router (admission_run.py).
    ``prefix`` is the router's prefix-cache locality and session affinity (on by default, as in the
    gateway; None turns the router's index off, the engines still cache prefixes).
    ``replicas`` runs that many routers, each with its own ledger, policy, latency learner and prefix
    index, taking arrivals in turn (request k goes to replica k mod ``replicas``); they share the
    engines' scraped metrics and the output-length predictor. ``foreign`` is how each router counts the
    requests the others sent (``hetroute.routing.foreign``); with ``peer_interval_s`` > 0 the replicas
    also exchange summaries of their ledgers and completions that often (``hetroute.routing.peers``:
    each adds the others' in-flight load to its snapshots and learns from their completions), with no
    transit time, starting one interval before the first arrival (replicas are up before traffic);
    ``peer_mirror`` (as ``peers.mirror``) counts each replica's own change since a peer's summary as that
    peer's too (``hetroute.routing.peer_mirror``). ``client_connections`` > 0 models a
    client with that many connections: an arrival beyond them waits in the client until an answer or
    a refusal frees one (its times still count from its arrival); 0 sends every request on arrival.
    """
    _check_options(replicas, admission, policy_name, scrape_interval_s)
    if peer_interval_s < 0 or not math.isfinite(peer_interval_s):
        raise ConfigError("peer_interval_s", f"must be a finite number >= 0, got {peer_interval_s}")
    if client_connections < 0:
        raise ConfigError("client_connections", f"must be >= 0, got {client_connections}")
    fleet = cluster if isinstance(cluster, Fleet) else build_fleet(cluster)
    _check_workload(fleet, workload)
    start_s = workload[0].arrival_s if workload else 0.0
    if peer_interval_s > 0 and replicas > 1:
        start_s -= peer_interval_s  # the replicas' first summaries go out before the first arrival
    clock = ManualClock(start_s)
    models = BackendModels.from_specs(fleet.backends)
    for slow in slowdowns:
        if not 0 <= slow.backend_index < len(fleet.backends) or not slow.factor > 0:
            raise ConfigError("slowdowns", f"bad slow-down {slow}")
    pred = predictors.build_predictor(predictor, dict(predictor_params or {}), seed)
    holder: list[Run] = []

    def replica(r: int) -> Router:
        """Router replica r: its own policy (seed + r), ledger, learner and prefix index."""
        if isinstance(policy_name, str):
            ctx = PolicyContext(fleet.backends, seed + r, models)
            policy: Policy = build_policy(policy_name, dict(policy_params or {}), ctx)
        else:
            policy = policy_name
        hint = replicas if peer_hint else 1
        peers = None
        if peer_interval_s > 0 and replicas > 1:
            names = [b.name for b in fleet.backends]
            stale_s = DEFAULT_STALE_INTERVALS * peer_interval_s
            follow_s = mirror_follow_s(peer_interval_s, stale_s) if peer_mirror else 0.0
            peers = PeerView(f"replica-{r}", names, stale_s, follow_s)
        return _build_router(fleet, policy, models, clock, holder, learning, prefix, foreign, hint, peers)

    router = replica(0)
    policy = router.policy
    learner = router.learner
    if admission is None:
        others = [replica(r) for r in range(1, replicas)]
        run = Run(fleet, workload, router, pred, clock, scrape_interval_s, learner, slowdowns, others)
        run.peer_interval_s = peer_interval_s
        run.peer_heartbeat_s = peer_heartbeat_s(peer_interval_s * DEFAULT_STALE_INTERVALS)
    else:
        run = AdmittedRun(
            fleet, workload, router, pred, clock, scrape_interval_s, admission, learner, slowdowns
        )
    run.client_connections = client_connections
    holder.append(run)
    started = time.perf_counter()
    events = run.run()
    wall_s = time.perf_counter() - started
    return _result(run, label or policy.name, pred.name, events, wall_s)


def _check_options(
    replicas: int, admission: SimAdmission | None, policy_name: str | Policy, scrape_interval_s: float
) -> None:
    """Raise :class:`ConfigError` on a bad replica count, replica setup or scrape interval."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas", f"must be an integer >= 1, got {replicas!r}")
    if replicas > 1 and (admission is not None or not isinstance(policy_name, str)):
        raise ConfigError(
            "replicas", "several replicas need a policy name (one fresh policy each) and no admission queue"
        )
    if scrape_interval_s < 0 or not math.isfinite(scrape_interval_s):
        raise ConfigError("scrape_interval_s", f"must be a finite number >= 0, got {scrape_interval_s}")


def _check_workload(fleet: Fleet, workload: Sequence[SimRequest]) -> None:
    """Raise :class:`ConfigError` unless every request's model is served and arrivals are sorted."""
    served = set(fleet.models)
    for req in workload:
        if req.model and req.model not in served:
            raise ConfigError(
                "workload", f"request {req.request_id} asks for {req.model!r}, not served by the cluster"
            )
    if any(b.arrival_s < a.arrival_s for a, b in zip(workload, workload[1:], strict=False)):
        raise ConfigError("workload", "requests must be sorted by arrival_s")


def _build_router(
    fleet: Fleet,
    policy: Policy,
    models: BackendModels,
    clock: ManualClock,
    holder: list[Run],
    learning: LearningConfig | None,
    prefix: PrefixConfig | None,
    foreign: ForeignMode,
    replicas: int = 1,
    peers: PeerView | None = None,
) -> Router:
    """One router over ``fleet`` with its own ledger, learner and prefix index.

    It reads metrics from the run in ``holder`` (filled once the run exists, before any event runs).
    """
    return Router(
        fleet.backends,
        policy,
        Ledger([b.name for b in fleet.backends]),
        clock,
        latest_metrics=lambda i: holder[0].latest_metrics(i),
        learner=build_live_models(models, learning) if learning is not None and learning.enabled else None,
        prefix=PrefixState(len(fleet.backends), prefix) if prefix is not None and prefix.enabled else None,
        foreign=foreign,
        replicas=replicas,
        peers=peers,
    )


def _result(run: Run, label: str, predictor: str, events: int, wall_s: float) -> SimResult:
    workload = run.workload
    done = ~np.isnan(run.e2e_s)
    t0 = workload[0].arrival_s if workload else 0.0
    makespan = (
        float(np.nanmax(run.e2e_s + np.array([r.arrival_s for r in workload])) - t0) if done.any() else 0.0
    )
    inputs = np.array([r.input_tokens for r in workload], dtype=np.int64)
    outputs = np.array([r.output_tokens for r in workload], dtype=np.int64)
    instances = []
    for e, engine in enumerate(run.engines):
        mine = done & (run.backend_index == e)
        stats = engine.stats()
        spec = run.fleet.backends[e]
        instances.append(
            InstanceResult(
                name=spec.name,
                gpu=spec.gpu or "",
                tp=spec.tp or 1,
                requests=int(mine.sum()),
                input_tokens=int(inputs[mine].sum()),
                output_tokens=int(outputs[mine].sum()),
                completion_time_s=run.last_finish_s[e] - t0 if mine.any() else 0.0,
                busy_s=run.busy_s[e],
                steps=stats.steps_total,
                preemptions=stats.num_preemptions_total,
                kv_capacity_tokens=engine.kv_capacity_tokens,
            )
        )
    return SimResult(
        policy=label,
        predictor=predictor,
        num_requests=len(workload),
        completed=int(done.sum()),
        rejected=run.rejected,
        makespan_s=makespan,
        input_tokens=int(inputs[done].sum()),
        output_tokens=int(outputs[done].sum()),
        instances=tuple(instances),
        ttft_s=run.ttft_s,
        e2e_s=run.e2e_s,
        backend_index=run.backend_index,
        events=events,
        wall_s=wall_s,
        ledger_zero=all(router.ledger.is_zero() for router in run.routers),
        learned=run.learner,
        **_with_prefix_extra(run, run.admission_result()),
    )


def _with_prefix_extra(run: Run, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (the admission queue's result fields) with the prefix figures merged into ``extra``."""
    return {**fields, "extra": {**fields.get("extra", {}), **_prefix_extra(run)}}


def _prefix_extra(run: Run) -> dict[str, float]:
    """Prefix-cache figures of a run: the engines' hits and queries (tokens) and the router's index."""
    stats = [engine.stats() for engine in run.engines]
    out = {
        "prefix_cache_queries_tokens": float(sum(s.prefix_cache_queries_total for s in stats)),
        "prefix_cache_hits_tokens": float(sum(s.prefix_cache_hits_total for s in stats)),
    }
    states = [router.prefix for router in run.routers if router.prefix is not None]
    if states:
        out["prefix_expected_hit_ratio"] = sum(p.expected_hit_tokens_total for p in states) / max(
            sum(p.input_tokens_total for p in states), 1.0
        )
        out["prefix_index_bytes"] = float(sum(p.index.memory_bytes() for p in states))
        out["prefix_index_chunks"] = float(sum(p.index.total_chunks() for p in states))
    return out
