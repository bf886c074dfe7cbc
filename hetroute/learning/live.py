"""The live latency models: per-backend observation windows and the learned p1..p8 they publish.

Owns, per backend, the last ``window`` successful requests (:class:`Observation`), the fit over them
(``fit.fit_backend``), the out-of-sample e2e error, drift detection and the exploration count.

Contract with the hot path. :meth:`LiveModels.observe` is O(1) apart from one scalar prediction (two
when a refit came between the request's dispatch and its end), and is the only thing a request does
here. :meth:`LiveModels.refit` runs off the request path (a periodic
task in the gateway, the scrape tick in the simulator) and publishes new read-only arrays by replacing
them whole, so a snapshot that holds the old arrays never sees a half update. Policies read
``params`` (n×8, p1..p8) and ``samples`` through the cluster snapshot.

Drift. Each observation's time per output token (its e2e when the first token was not seen) is
compared with what the published model predicted for it (before it was fitted on). When the median
log-ratio of the last ``DRIFT_WINDOW`` observations exceeds ``log(drift_ratio)`` in either direction,
the backend has drifted: the regime starts at the oldest of those observations, older rows keep
``stale_weight`` of their weight, the exploration count restarts and the backend is refitted at the
next refit.

Peers. What a backend publishes is its own fit (its prior before one) except among peers: backends
with equal informed priors publish the best-learned peer's model until they have 16 fitted requests
(:meth:`LiveModels._borrow_from_peers`); backends on the neutral default whose engines report equal
KV capacities and slot limits publish one pooled fit, each leaving the pool while its own fit differs
from the others' (:meth:`LiveModels._pool_nothing_known`). ``describe`` says which.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetroute.deferred import run_soon
from hetroute.latency import PARAM_NAMES
from hetroute.learning.fit import FitResult, FitSettings, RowCache, fit_backend, predict_e2e_s, predict_tpot_s
from hetroute.learning.observation import Observation
from hetroute.learning.settings import LearningConfig
from hetroute.types import FloatArray

log = logging.getLogger(__name__)

DRIFT_WINDOW = 32
"""Observations whose median residual decides a drift."""
ERROR_WINDOW = 256
"""Recent out-of-sample e2e errors kept per backend (``recent_e2e_errors``)."""
OBSERVE_BATCH = 64
"""Observations queued by :meth:`LiveModels.observe` before they are taken in at once."""
PEER_MIN_SAMPLES = 16
"""A backend with fewer fitted observations than this publishes the model of its best-learned peer
(:meth:`LiveModels.refit`), if it has one."""
POOL_CHECK = 16
"""Newest requests of a nothing-known peer on which its own fit and the other members' are compared."""
POOL_LEAVE_RATIO = 1.4
"""A nothing-known peer whose own fit predicts its requests more than 1.4× apart from the other members'
(median ratio, either way) leaves the pool (:meth:`LiveModels._pool_nothing_known`)."""
POOL_EXACT_OTHERS = 8
"""Up to this many fitted members, each is compared with the median of the *others'* fits; beyond, with
the median of all (one member hardly moves it)."""
POOL_NAMES_SHOWN = 8
"""``describe``'s ``published_from`` names at most this many members of a pool."""
PEER_KINDS = frozenset({"profile", "roofline"})
"""Prior kinds that say two backends are the same hardware when their priors are equal (a neutral
default says nothing about the hardware, so equal neutral priors alone do not make peers: see
:meth:`LiveModels._pool_nothing_known`)."""
PUBLISHED_KEPT = 256
"""Published models kept with their times, so that a request's out-of-sample error is judged against
the model published when it was dispatched (``recent_e2e_errors``)."""
_ERROR_EWMA = 0.05
_LIVE_REL_STDERR = 0.5


@dataclass(frozen=True, slots=True)
class PriorModel:
    """Where a backend's model starts: p1..p8, a description, and its kind.

    ``kind`` is ``profile`` (a measured profile file), ``saved`` (a live fit saved by an earlier run, or
    learned by an identical replica when the backend joined live), ``roofline`` (the catalog's roofline
    prior), ``fleet`` (joined live knowing nothing: the median of the learned members) or ``neutral``
    (nothing known).
    """

    params: tuple[float, ...]
    source: str
    kind: str


@dataclass(slots=True)
class _Backend:
    prior: PriorModel
    observations: deque[Observation]
    residuals: deque[tuple[float, float]]
    errors: deque[float]
    regime_start_s: float = -math.inf
    since_regime: int = 0
    dirty: bool = False
    fit: FitResult | None = None
    error_ewma: float = math.nan
    drifts: int = 0
    observed_total: int = 0
    drift_times_s: list[float] = field(default_factory=list)
    drift_pending: bool = False
    rows: RowCache = field(default_factory=RowCache)
    ordered_residuals: list[float] = field(default_factory=list)
    """The residuals' values, sorted (kept with ``residuals``: the drift check's median is two reads)."""

    def add_residual(self, finished_at_s: float, residual: float) -> None:
        """Append to ``residuals`` (the oldest drops out when it is full) and keep the sorted copy."""
        ordered, window = self.ordered_residuals, self.residuals
        if len(window) == window.maxlen:
            del ordered[bisect.bisect_left(ordered, window[0][1])]
        window.append((finished_at_s, residual))
        bisect.insort(ordered, residual)

    def clear_residuals(self) -> None:
        self.residuals.clear()
        self.ordered_residuals.clear()

    def median_residual(self) -> float:
        """``statistics.median`` of the residuals (the mean of the two middle ones for an even count)."""
        ordered = self.ordered_residuals
        n = len(ordered)
        half = n // 2
        return ordered[half] if n % 2 else (ordered[half - 1] + ordered[half]) / 2


@dataclass(frozen=True, slots=True)
class _Pool:
    """The pooled fit of one group of nothing-known peers (:meth:`LiveModels._pool_nothing_known`)."""

    group: tuple[int, ...]
    """Every backend of the group (same reported capacity and slot limit)."""
    members: tuple[int, ...]
    """The members whose requests it holds (the group but those that left)."""
    left: frozenset[int]
    """Members that publish their own fit (:meth:`LiveModels._differs`)."""
    fit: FitResult
    params: FloatArray
    rows: RowCache


_NO_FIT = FitResult((0.0,) * 8, (0.0,) * 8, 0, 0.0, math.nan, math.nan, math.nan)
"""A pool with fewer than two members fits nothing (:meth:`LiveModels._pool_nothing_known`)."""


class LiveModels:
    """Learned latency models of every backend (index = backend index)."""

    def __init__(
        self,
        names: Sequence[str],
        priors: Sequence[PriorModel],
        capacities_tokens: Sequence[float],
        max_num_seqs: Sequence[float],
        config: LearningConfig,
        initial_params: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """``initial_params`` (default: the priors) is what is published until a backend's first fit."""
        if not len(names) == len(priors) == len(capacities_tokens) == len(max_num_seqs):
            raise ValueError("one prior, capacity and max_num_seqs per backend")
        self.names = tuple(names)
        self.config = config
        self.fit_settings = FitSettings(half_life_s=config.half_life_s, prior_strength=config.prior_strength)
        self._b = [
            _Backend(p, deque(maxlen=config.window), deque(maxlen=DRIFT_WINDOW), deque(maxlen=ERROR_WINDOW))
            for p in priors
        ]
        self._fallback_caps = np.array(capacities_tokens, dtype=np.float64)
        self._caps = self._fallback_caps.copy()
        self._caps_reported = np.zeros(len(priors), dtype=np.bool_)
        self._max_seqs = np.array(max_num_seqs, dtype=np.float64)
        self._pools: dict[tuple[float, float], _Pool] = {}
        self._published_from: dict[int, str] = {}
        """Backends publishing another model than their own fit or prior, and whose (``describe``)."""
        start = initial_params if initial_params is not None else [p.params for p in priors]
        params = np.array(start, dtype=np.float64).reshape(len(priors), 8)
        self._start = [tuple(float(v) for v in row) for row in params]
        """What each backend published before its first fit (its own model until then)."""
        params.flags.writeable = False
        self.params: FloatArray = params
        self._published_at: list[float] = [-math.inf]
        self._published: list[FloatArray] = [params]
        """The last published models (at most ``2 * PUBLISHED_KEPT``) and when each was published."""
        self._queued: list[Observation] = []
        self._refit_cursor = 0
        self.samples: FloatArray = self._samples()

    def set_slot(
        self,
        i: int,
        name: str,
        prior: PriorModel,
        capacity_tokens: float,
        max_num_seqs: float,
        initial_params: Sequence[float] | None = None,
    ) -> None:
        """Slot ``i`` holds backend ``name``, learned from nothing but ``prior`` (one past the last: grow;
        live backend changes). Published arrays are replaced whole, as :meth:`refit` does."""
        self._take_queued()
        cfg = self.config
        fresh = _Backend(
            prior, deque(maxlen=cfg.window), deque(maxlen=DRIFT_WINDOW), deque(maxlen=ERROR_WINDOW)
        )
        row = np.array(initial_params if initial_params is not None else prior.params, dtype=np.float64)
        names = list(self.names)
        params = self.params.copy()
        if i == len(self._b):
            self._start.append(tuple(float(v) for v in row))
            self._b.append(fresh)
            names.append(name)
            self._fallback_caps = np.append(self._fallback_caps, capacity_tokens)
            self._caps = np.append(self._caps, capacity_tokens)
            self._caps_reported = np.append(self._caps_reported, False)
            self._max_seqs = np.append(self._max_seqs, max_num_seqs)
            params = np.vstack([params, row.reshape(1, 8)])
        else:
            self._start[i] = tuple(float(v) for v in row)
            self._b[i] = fresh
            names[i] = name
            self._fallback_caps[i] = self._caps[i] = capacity_tokens
            self._caps_reported[i] = False
            self._max_seqs[i] = max_num_seqs
            params[i] = row
        self.names = tuple(names)
        params.flags.writeable = False
        self.params = params
        self._published_at, self._published = [-math.inf], [params]  # another backend in the slot
        self.samples = self._samples()

    # ------------------------------------------------------------ the request path

    def observe(self, obs: Observation) -> None:
        """Record one successful request. It is queued, and taken in (its out-of-sample error, then the
        drift check) before anything reads or changes the models: at the next :meth:`refit`,
        :meth:`set_capacities` or :meth:`set_slot`, a read of the errors or counts, or once
        ``OBSERVE_BATCH`` are queued (after the current event-loop step, or at once without a running loop:
        :func:`~hetroute.deferred.run_soon`). The published parameters change only in those calls, so each
        observation is judged against the same model as if it were taken in at once; done in a batch,
        it costs the request path a fraction of the CPU (docs/performance.md)."""
        queued = self._queued
        queued.append(obs)
        if len(queued) == OBSERVE_BATCH:  # once per batch, after the current event-loop step
            run_soon(self._take_queued)

    def _take_queued(self) -> None:
        """Take in the queued observations, oldest first (the parameters, capacities and slot limits
        are read once per batch: they change only where the queue is taken in first)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        params, caps, seqs = self.params.tolist(), self._caps.tolist(), self._max_seqs.tolist()
        at, published = self._published_at, self._published
        as_lists: dict[int, list[list[float]]] = {len(published) - 1: params}  # the current one
        for obs in queued:
            i = obs.backend_index
            # the model published when the request was dispatched: what routing priced it with
            k = max(bisect.bisect_right(at, obs.finished_at_s - obs.e2e_s) - 1, 0)
            rows = as_lists.get(k)
            if rows is None:
                rows = as_lists[k] = published[k].tolist()
            self._take(obs, rows[i], params[i], caps[i], seqs[i])

    def _take(
        self, obs: Observation, dispatched: list[float], params: list[float], cap: float, seqs: float
    ) -> None:
        """One observation: its out-of-sample error under ``dispatched``, the model published when it
        was dispatched, then the drift check against ``params``, the model published now (plain
        floats)."""
        b = self._b[obs.backend_index]
        at_dispatch = predict_e2e_s(dispatched, obs, cap, seqs)
        if obs.e2e_s > 0 and at_dispatch > 0:
            err = abs(at_dispatch / obs.e2e_s - 1.0)
            b.errors.append(err)
            b.error_ewma = (
                err if math.isnan(b.error_ewma) else b.error_ewma + _ERROR_EWMA * (err - b.error_ewma)
            )
        predicted = at_dispatch if dispatched is params else predict_e2e_s(params, obs, cap, seqs)
        if obs.e2e_s > 0 and predicted > 0:
            # Drift is judged on the decode speed when it was seen (queueing does not blur it), else e2e,
            # and only against a model fitted on enough requests (not the prior while it is learned).
            decode_s = obs.decode_s
            judged = b.fit is not None and b.fit.samples >= 2 * DRIFT_WINDOW
            if judged:
                tpot = predict_tpot_s(params, obs, cap, seqs) if decode_s is not None else 0.0
                if decode_s is not None and obs.output_tokens >= 2 and decode_s > 0 and tpot > 0:
                    residual = math.log(decode_s / (obs.output_tokens - 1) / tpot)
                else:
                    residual = math.log(obs.e2e_s / predicted)
                b.add_residual(obs.finished_at_s, residual)
        b.observations.append(obs)
        b.observed_total += 1
        b.since_regime += 1
        b.dirty = True
        if (
            b.fit is not None
            and not b.drift_pending
            and b.fit.samples >= DRIFT_WINDOW
            and len(b.residuals) == DRIFT_WINDOW
        ):
            shift = b.median_residual()
            limit = math.log(self.config.drift_ratio)
            if abs(shift) > limit:
                # The new regime starts at the first of the recent requests already on the drift's side.
                b.regime_start_s = next(
                    t for t, r in b.residuals if r * math.copysign(1.0, shift) > 0.5 * limit
                )
                b.since_regime = DRIFT_WINDOW
                b.clear_residuals()
                b.drift_pending = True  # judged again only against a model refitted on the new regime
                b.drifts += 1
                b.drift_times_s.append(obs.finished_at_s)
                log.warning(
                    "backend %s drifted: requests take %.2fx the model's prediction; re-learning",
                    self.names[obs.backend_index],
                    math.exp(shift),
                )

    # ------------------------------------------------------------ off the request path

    def set_capacities(self, capacities_tokens: FloatArray) -> None:
        """The KV capacities to use (NaN: keep the fallback), e.g. from the latest snapshot. A finite
        value is a reported capacity (profile, engine metrics or configuration), which
        :meth:`_pool_nothing_known` compares."""
        self._take_queued()
        reported = np.isfinite(capacities_tokens)
        caps = np.where(reported, capacities_tokens, self._fallback_caps)
        self._caps = np.asarray(caps, dtype=np.float64)
        self._caps_reported = np.asarray(reported, dtype=np.bool_)

    def refit(self, now_s: float, limit: int | None = None) -> int:
        """Refit the backends with new observations, at most ``limit`` of them (None: all), and
        publish new arrays. Returns how many rows changed.

        With a ``limit`` the backends are taken in turn, starting after the last one a limited call
        fitted, so that every dirty backend is fitted within ``ceil(dirty / limit)`` calls; each fit
        takes a few milliseconds (about 2 ms for a full window on the development machine), so the
        gateway refits a large fleet a slice at a time (``lifecycle.learning_loop``)."""
        self._take_queued()
        changed = 0
        params = self.params.copy()
        n = len(self._b)
        start = self._refit_cursor if limit is not None else 0
        fitted = 0
        refitted: set[int] = set()
        for step in range(n):
            i = (start + step) % n
            b = self._b[i]
            if not b.dirty:
                continue
            if limit is not None and fitted >= limit:
                break
            fitted += 1
            if limit is not None:
                self._refit_cursor = (i + 1) % n
            b.dirty = False
            b.fit = fit_backend(
                list(b.observations),
                b.prior.params,
                now_s=now_s,
                capacity_tokens=float(self._caps[i]),
                max_num_seqs=float(self._max_seqs[i]),
                settings=self.fit_settings,
                regime_start_s=b.regime_start_s,
                cache=b.rows,
            )
            params[i] = b.fit.params
            refitted.add(i)
            if b.drift_pending:
                b.drift_pending = False
                b.clear_residuals()
            changed += 1
        self._published_from = {}
        changed += self._borrow_from_peers(params)
        changed += self._pool_nothing_known(params, now_s, refitted)
        if changed:
            params.flags.writeable = False
            self.params = params
            self._published_at.append(now_s)
            self._published.append(params)
            if len(self._published) > 2 * PUBLISHED_KEPT:
                del self._published_at[:-PUBLISHED_KEPT], self._published[:-PUBLISHED_KEPT]
        self.samples = self._samples()
        return changed

    def dirty_backends(self) -> int:
        """How many backends have observations their published model has not been fitted on."""
        self._take_queued()
        return sum(1 for b in self._b if b.dirty)

    def _borrow_from_peers(self, params: FloatArray) -> int:
        """Peers: backends whose informed priors (``PEER_KINDS``) are equal, i.e. the same GPU, TP, model
        and engine as far as the router was told. A peer with fewer than ``PEER_MIN_SAMPLES`` fitted
        observations publishes the model of the peer fitted on the most (at least that many) instead of
        its own prior or its own fit of a handful of requests, in ``params`` (modified in place);
        returns how many rows changed. While no peer has that many, the few-sample ones publish their
        common prior.

        Why: a prior wrong by the same factor on every peer (another clock, engine version, or an
        emulator sped up) is corrected first on the backend that happens to finish requests first; the
        others, still on the prior, then look slower, and every request goes to the learned one until
        its queue says otherwise. On four equal emulated A100s (system prompts, gateway, speedup 2)
        that herding held the first second's requests on one backend (p99 TTFT 0.67 s, 0.26 s with
        learning off). Each backend's own fit takes over once it has ``PEER_MIN_SAMPLES``
        observations, so a peer that really differs is still found, and exploration keeps sampling
        the ones with few."""
        groups: dict[tuple[float, ...], list[int]] = {}
        for i, b in enumerate(self._b):
            if b.prior.kind in PEER_KINDS:
                groups.setdefault(tuple(b.prior.params), []).append(i)
        changed = 0
        for members in groups.values():
            if len(members) < 2:
                continue
            samples = [self._fitted(i) for i in members]
            best = max(samples)
            if best >= PEER_MIN_SAMPLES:
                lender = members[samples.index(best)]
                source = params[lender].copy()
                origin = f"peer {self.names[lender]} ({best} fitted requests)"
            else:
                source = np.array(self._b[members[0]].prior.params, dtype=np.float64)
                origin = "the peers' common prior"
            for i, n in zip(members, samples, strict=True):
                if n < PEER_MIN_SAMPLES and (best >= PEER_MIN_SAMPLES or n > 0):
                    self._published_from[i] = origin
                if n < PEER_MIN_SAMPLES and not np.array_equal(params[i], source):
                    params[i] = source
                    changed += 1
        return changed

    def _pool_nothing_known(self, params: FloatArray, now_s: float, refitted: set[int]) -> int:
        """Nothing-known peers: backends on the neutral default (prior kind ``neutral``) whose reported
        KV capacity (:meth:`set_capacities`) and ``max_num_seqs`` are equal, i.e. the same engine on the
        same hardware as far as the engines themselves say. Each publishes, in ``params`` (modified in
        place), one fit over the group's pooled observations (from ``NEUTRAL_LEARNING_PRIOR``, as each
        member's own fit starts) unless it has left the pool: a member with at least
        ``PEER_MIN_SAMPLES`` fitted observations whose own fit predicts its newest ``POOL_CHECK``
        requests more than ``POOL_LEAVE_RATIO`` faster or slower than most other members' own fits do
        (:meth:`_differs`) publishes its own fit, and its requests leave the pool; it rejoins when it
        no longer differs. Returns how many rows changed. Who left is judged again, and the pooled fit
        recomputed, only when a member was refitted in this call (``refitted``) or the group changed.

        Why: until its first fit a backend is priced by ``NEUTRAL_PARAMS`` (0.2 ms per prompt token
        and no prefill-queue term), and the first backend to finish a request gets a fitted model that
        is usually faster (an A100 learned 0.11 ms per token from one request); beside peers still on
        the neutral default it then draws most requests until its own queue catches up (four equal
        A100s, `rag` at 1.2 load, nothing known, through the gateway: 12 of the next 16 requests, p99
        TTFT 2.41 s against `cache_aware`'s 1.52 s). Later, equal backends' own fits disagree on the
        decode curve's shape (fitted at the batch sizes each happened to run), and the one rated
        cheapest draws more requests (docs/learning.md, "Nothing-known peers pool their traffic").
        Peers by informed priors wait for one to have 16 requests (:meth:`_borrow_from_peers`), which a
        group on the neutral default cannot do beside lone backends that publish their first fit at
        once. A member that really differs (another GPU with the same memory, a throttled one) shows it
        on its own requests and leaves. A capacity the engine did not report (the fallback) makes no
        group: equal fallbacks say nothing about the hardware."""
        groups: dict[tuple[float, float], list[int]] = {}
        for i, b in enumerate(self._b):
            if b.prior.kind == "neutral" and self._caps_reported[i]:
                groups.setdefault((float(self._caps[i]), float(self._max_seqs[i])), []).append(i)
        for key in [k for k in self._pools if k not in groups]:
            del self._pools[key]
        changed = 0
        for key, members in groups.items():
            if len(members) < 2:
                self._pools.pop(key, None)
                continue
            old = self._pools.get(key)
            if old is not None and refitted.isdisjoint(members) and old.group == tuple(members):
                pool = old  # nothing new: the same pool and the same leavers
            else:
                pool = self._pool(key, tuple(members), old, now_s, refitted)
            self._pools[key] = pool
            pooling = len(pool.members) >= 2 and pool.fit.samples > 0
            shown = [self.names[j] for j in pool.members[:POOL_NAMES_SHOWN]]
            more = len(pool.members) - len(shown)
            names = ", ".join(shown) + (f" and {more} more" if more else "")
            origin = f"pooled fit of {names} ({pool.fit.samples} requests)"
            for i in members:
                if pooling and i not in pool.left:
                    self._published_from[i] = origin
                    source = pool.params
                else:  # its own: its fit, else what it started with
                    fit = self._b[i].fit
                    source = np.asarray(fit.params if fit is not None else self._start[i], dtype=np.float64)
                if not np.array_equal(params[i], source):
                    params[i] = source
                    changed += 1
        return changed

    def _pool(
        self,
        key: tuple[float, float],
        group: tuple[int, ...],
        old: _Pool | None,
        now_s: float,
        refitted: set[int],
    ) -> _Pool:
        """The group's pool: one fit over every member but those that left. Who leaves is judged again
        for the members refitted in this call (all of them when the group changed): a member leaves when
        its own fit predicts its own newest requests more than ``POOL_LEAVE_RATIO`` apart from the
        typical other member (:meth:`_differs`), and rejoins when it no longer does. At most one fit,
        and only when a staying member was refitted or who stays changed."""
        same_group = old is not None and old.group == group
        left = set(old.left) if old is not None and same_group else set()
        typical = self._typical(group)
        for i in group if not same_group else sorted(refitted.intersection(group)):
            if self._differs(i, key, typical.get(i)):
                left.add(i)
            else:
                left.discard(i)
        staying = tuple(i for i in group if i not in left)
        if len(staying) < 2:
            return _Pool(group, staying, frozenset(left), _NO_FIT, np.zeros(8), RowCache())
        if old is not None and old.members == staying and refitted.isdisjoint(staying):
            return _Pool(group, staying, frozenset(left), old.fit, old.params, old.rows)
        return self._pool_fit(key, group, staying, frozenset(left), now_s, old)

    def _typical(self, group: tuple[int, ...]) -> dict[int, list[list[float]]]:
        """Per member with its own fit on at least ``PEER_MIN_SAMPLES`` requests, the models it is judged
        against: every other such member's own fit, or, beyond ``POOL_EXACT_OTHERS`` of them, their
        element-wise median p1..p8 alone (absent without another such member)."""
        own = {
            i: list(fit.params)
            for i in group
            if (fit := self._b[i].fit) is not None and fit.samples >= PEER_MIN_SAMPLES
        }
        if len(own) < 2:
            return {}
        if len(own) > POOL_EXACT_OTHERS:  # one member hardly moves the median of many
            common = np.median(np.array(list(own.values()), dtype=np.float64), axis=0).tolist()
            return {i: [common] for i in own}
        return {i: [theirs for j, theirs in own.items() if j != i] for i in own}

    def _differs(self, i: int, key: tuple[float, float], others: list[list[float]] | None) -> bool:
        """Whether member ``i``'s own fit predicts its newest ``POOL_CHECK`` requests more than
        ``POOL_LEAVE_RATIO`` apart (median ratio, either way) from more than half of ``others``, the
        other members' models (no verdict, False, without them): two equal backends and one that is
        not, the odd one differs from both and the others from one each, so only the odd one leaves."""
        fit = self._b[i].fit
        if not others or fit is None or fit.samples < PEER_MIN_SAMPLES:
            return False
        window = self._b[i].observations
        recent = list(itertools.islice(window, max(0, len(window) - POOL_CHECK), None))
        own = list(fit.params)
        mine = [predict_e2e_s(own, obs, key[0], key[1]) for obs in recent]
        limit = math.log(POOL_LEAVE_RATIO)
        apart = 0
        for model in others:
            theirs = [predict_e2e_s(model, obs, key[0], key[1]) for obs in recent]
            ratios = [m / t for m, t in zip(mine, theirs, strict=True) if m > 0 and t > 0]
            if ratios and abs(math.log(statistics.median(ratios))) > limit:
                apart += 1
        return 2 * apart > len(others)

    def _pool_fit(
        self,
        key: tuple[float, float],
        group: tuple[int, ...],
        members: tuple[int, ...],
        left: frozenset[int],
        now_s: float,
        old: _Pool | None,
    ) -> _Pool:
        """One fit over the newest observations of ``members`` (same capacity and slot limit: ``key``),
        at most ``window // len(members)`` (at least 1) from each, so that a pool costs about one
        backend's fit however large the group."""
        rows = old.rows if old is not None else RowCache()
        share = max(1, self.config.window // len(members))
        observations: list[Observation] = []
        for i in members:
            window = self._b[i].observations
            observations.extend(itertools.islice(window, max(0, len(window) - share), None))
        fit = fit_backend(
            observations,
            self._b[members[0]].prior.params,
            now_s=now_s,
            capacity_tokens=key[0],
            max_num_seqs=key[1],
            settings=self.fit_settings,
            cache=rows,
        )
        pooled = np.array(fit.params, dtype=np.float64)
        pooled.flags.writeable = False
        return _Pool(group, members, left, fit, pooled, rows)

    def _fitted(self, i: int) -> int:
        """Observations backend ``i``'s latest fit used (0 before its first)."""
        fit = self._b[i].fit
        return fit.samples if fit is not None else 0

    def _samples(self) -> FloatArray:
        out: FloatArray = np.array([float(b.since_regime) for b in self._b], dtype=np.float64)
        out.flags.writeable = False
        return out

    # ------------------------------------------------------------ reading

    def fit_of(self, i: int) -> FitResult | None:
        """The latest fit of backend ``i`` (None before its first refit with data)."""
        return self._b[i].fit

    def prior_of(self, i: int) -> PriorModel:
        return self._b[i].prior

    def e2e_error(self, i: int) -> float:
        """EWMA of |predicted / observed e2e − 1| over requests the model had not yet seen (NaN: none)."""
        self._take_queued()
        return self._b[i].error_ewma

    def drifts(self, i: int) -> int:
        """Drifts detected on backend ``i`` since start."""
        self._take_queued()
        return self._b[i].drifts

    def drift_times_s(self, i: int) -> tuple[float, ...]:
        """When each drift of backend ``i`` was detected (clock seconds)."""
        self._take_queued()
        return tuple(self._b[i].drift_times_s)

    def recent_e2e_errors(self, i: int) -> tuple[float, ...]:
        """|predicted / observed e2e − 1| of backend ``i``'s last requests, each predicted by the model
        published when it was dispatched, which routing priced it with and which was not fitted on it
        (oldest first, at most ``ERROR_WINDOW``). A request older than the ``PUBLISHED_KEPT`` models
        kept is judged on the oldest kept."""
        self._take_queued()
        return tuple(self._b[i].errors)

    def hindsight_e2e_errors(self, i: int, last: int) -> tuple[float, ...]:
        """|predicted / observed e2e − 1| of backend ``i``'s last ``last`` observations under the same
        model form fitted to those observations themselves, in hindsight and with equal weights (no
        decay): the spread no model of this form predicts away, mostly the engine's own noise. A
        measurement's reference for :meth:`recent_e2e_errors` (docs/learning.md); never used to route."""
        params = self.hindsight_params(i, last)
        cap, seqs = float(self._caps[i]), float(self._max_seqs[i])
        judged = list(self._b[i].observations)[-last:]
        return tuple(
            abs(predict_e2e_s(params, obs, cap, seqs) / obs.e2e_s - 1.0) for obs in judged if obs.e2e_s > 0
        )

    def hindsight_shift(self, i: int, last: int, before: int | None = None) -> float:
        """Median of log(observed / predicted e2e) over backend ``i``'s observations before its last
        ``last`` (the ``before`` nearest of them, else all), predicted by the hindsight model of those
        last (:meth:`hindsight_params`): how much slower (> 0) or faster (< 0) the engine ran before
        them than while they ran (NaN: none before them). A measurement's check that the engine kept
        its speed; never used to route."""
        params = self.hindsight_params(i, last)
        cap, seqs = float(self._caps[i]), float(self._max_seqs[i])
        earlier = list(self._b[i].observations)[:-last]
        if before is not None:
            earlier = earlier[-before:] if before > 0 else []
        ratios = [
            math.log(obs.e2e_s / predicted)
            for obs in earlier
            if obs.e2e_s > 0 and (predicted := predict_e2e_s(params, obs, cap, seqs)) > 0
        ]
        return statistics.median(ratios) if ratios else math.nan

    def hindsight_params(self, i: int, last: int) -> list[float]:
        """p1..p8 of the model form fitted with equal weights to backend ``i``'s last ``last``
        observations (:meth:`hindsight_e2e_errors`); never used to route."""
        self._take_queued()
        b = self._b[i]
        fit = fit_backend(
            list(b.observations)[-last:],
            b.prior.params,
            now_s=0.0,
            capacity_tokens=float(self._caps[i]),
            max_num_seqs=float(self._max_seqs[i]),
            settings=FitSettings(half_life_s=math.inf),
        )
        return list(fit.params)

    def observed_total(self, i: int) -> int:
        self._take_queued()
        return self._b[i].observed_total

    def observations(self, i: int) -> tuple[Observation, ...]:
        """Backend ``i``'s observations in the learning window (oldest first), queued ones included."""
        self._take_queued()
        return tuple(self._b[i].observations)

    def describe(self, i: int) -> dict[str, object]:
        """The learned model of backend ``i`` as plain data (``/admin/backends``)."""
        self._take_queued()
        b = self._b[i]
        fit = b.fit
        params = [float(v) for v in self.params[i]]
        stderr = list(fit.stderr) if fit is not None else [math.nan] * 8
        kind = b.prior.kind
        out_params: dict[str, dict[str, object]] = {}
        for k, name in enumerate(PARAM_NAMES):
            live = (
                fit is not None
                and fit.samples >= DRIFT_WINDOW
                and math.isfinite(stderr[k])
                and stderr[k] <= _LIVE_REL_STDERR * max(abs(params[k]), 1e-12)
            )
            out_params[name] = {
                "value": params[k],
                "stderr": _finite(stderr[k]),
                "prior": b.prior.params[k],
                "source": "live" if live else kind,
            }
        return {
            "prior": {"source": b.prior.source, "kind": kind},
            "published_from": self._published_from.get(i),
            "samples": len(b.observations),
            "observed_total": b.observed_total,
            "effective_samples": _finite(fit.effective_samples) if fit is not None else 0.0,
            "since_drift": b.since_regime,
            "drifts": b.drifts,
            "e2e_error": _finite(b.error_ewma),
            "fit_mape": {
                "ttft": _finite(fit.ttft_mape) if fit is not None else None,
                "tpot": _finite(fit.tpot_mape) if fit is not None else None,
                "e2e": _finite(fit.e2e_mape) if fit is not None else None,
            },
            "params": out_params,
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
