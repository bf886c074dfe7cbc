"""Choosing a deployment: the per-machine argmax, and an exact joint search under global constraints.

Owns: :class:`Option`, :class:`JointConstraints`, :class:`SearchResult`, :func:`choose_separable`,
:func:`joint_search`.

Without constraints cluster throughput is Σ over machines, so each machine takes its best option
(method.md §4). Constraints couple the machines:

- ``min_instances``: Σ instances ≥ N (e.g. for redundancy);
- ``max_cost_per_hour``: Σ price of the machines switched on ≤ B (a machine may then stay unused);
- an SLO at a target load: with requests spread in proportion to capacity, every instance runs at the same
  utilisation ρ = demand / Σ throughput; option o meets the latency bound up to ``rho_max(o)``. A deployment
  is valid iff ``demand / Σ thr ≤ min over its options of rho_max``.

The joint search is exact. For each threshold ρ* among the distinct ``rho_max`` values it keeps only the
options with ``rho_max ≥ ρ*`` and solves max Σ thr s.t. the instance and budget constraints, then accepts
the solution iff ``demand ≤ ρ*·Σ thr``; the best accepted solution is optimal (an optimum D has
min rho_max(D) = some ρ', and the ρ' sub-problem's optimum dominates D). Without a budget a sub-problem is
one DP over the machines on (instances capped at N) → best throughput, O(machines · options · N). With a
budget it groups identical machines into classes, runs a DP over (machines switched on, instances capped at
N) per class, and merges classes keeping only Pareto-optimal (cost ↓, instances ↑, throughput ↑) states.
``max_states`` bounds the work; beyond it the search stops with a clear error rather than running for ever.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


class SearchTooLarge(ValueError):
    """The exact joint search would exceed its state budget."""


@dataclass(frozen=True, slots=True)
class Option:
    """One way to run a machine: ``tp`` (None = unused), its instances and estimated throughput."""

    tp: int | None
    instances: int
    tokens_per_s: float
    rho_max: float = math.inf


OFF = Option(None, 0, 0.0, math.inf)


@dataclass(frozen=True, slots=True)
class JointConstraints:
    min_instances: int | None = None
    max_cost_per_hour: float | None = None
    demand_tokens_per_s: float | None = None  # SLO load; requires Option.rho_max


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The chosen option per machine (same order as the input) and the totals."""

    choice: tuple[Option, ...]
    total_tokens_per_s: float
    total_instances: int
    total_cost_per_hour: float
    joint: bool
    elapsed_s: float
    states: int
    infeasible_reason: str | None = None


def _totals(choice: Sequence[Option], prices: Sequence[float | None]) -> tuple[float, int, float]:
    thr = sum(o.tokens_per_s for o in choice)
    inst = sum(o.instances for o in choice)
    cost = sum((p or 0.0) for o, p in zip(choice, prices, strict=True) if o.tp is not None)
    return thr, inst, cost


def choose_separable(
    options: Sequence[Sequence[Option]],
    prices: Sequence[float | None],
    clock: Callable[[], float] = time.perf_counter,
) -> SearchResult:
    """Per machine, the option with the highest throughput (ties: fewer GPUs per instance)."""
    start = clock()
    choice = tuple(
        max(opts, key=lambda o: (o.tokens_per_s, -(o.tp or 0))) if opts else OFF for opts in options
    )
    thr, inst, cost = _totals(choice, prices)
    reason = None if any(o.tp is not None for o in choice) else "no machine has a feasible configuration"
    return SearchResult(choice, thr, inst, cost, False, clock() - start, len(choice), reason)


@dataclass(slots=True)
class _Class:
    """Machines searched together: ``options[k]`` are member k's options; all cost ``price`` when on."""

    members: list[int]
    options: list[list[Option]]
    price: float


def _add_option(best: np.ndarray, opt: Option, cap: int, dn: int) -> tuple[np.ndarray, np.ndarray]:
    """Add one machine running ``opt`` to every state of ``best`` (instances capped at ``cap``).

    Returns the new values and, for the capped column, the source instance index per row.
    """
    out = np.full_like(best, -np.inf)
    rows = best.shape[0]
    k = min(opt.instances, cap)
    body = best[: rows - dn, :]
    if cap - k > 0:
        out[dn:, k:cap] = body[:, : cap - k] + opt.tokens_per_s
    tail = body[:, cap - k :]
    src = np.zeros(rows, dtype=np.int64)
    src[dn:] = np.argmax(tail, axis=1) + (cap - k)
    out[dn:, cap] = tail.max(axis=1) + opt.tokens_per_s
    return out, src


@dataclass(slots=True)
class _ClassDP:
    """The class's DP: ``final[n_on, inst]`` = best throughput; per machine step the option picked per state
    (−1 = off) and, for the capped column, the source instance index per option."""

    final: np.ndarray
    picks: list[np.ndarray]
    cap_sources: list[list[np.ndarray]]


def _class_dp(cls: _Class, cap: int, allow_off: bool, track_on: bool) -> _ClassDP:
    """DP over the class's machines. Without ``track_on`` the n_on axis has length 1 (off is then allowed
    only for a machine without options: any option dominates an unused machine when cost does not matter)."""
    rows = len(cls.members) + 1 if track_on else 1
    dn = 1 if track_on else 0
    best = np.full((rows, cap + 1), -np.inf)
    best[0, 0] = 0.0
    picks: list[np.ndarray] = []
    sources: list[list[np.ndarray]] = []
    for options in cls.options:
        off = allow_off or not options
        new = best.copy() if off else np.full_like(best, -np.inf)
        pick = np.full(best.shape, -1, dtype=np.int8)
        step_src = []
        for j, opt in enumerate(options):
            cand, src = _add_option(best, opt, cap, dn)
            better = cand > new
            new[better] = cand[better]
            pick[better] = j
            step_src.append(src)
        picks.append(pick)
        sources.append(step_src)
        best = new
    return _ClassDP(best, picks, sources)


def _reconstruct(cls: _Class, dp: _ClassDP, n_on: int, inst: int, cap: int, track_on: bool) -> list[Option]:
    """The options of the class's machines (in member order) that reach ``dp.final[n_on, inst]``."""
    dn = 1 if track_on else 0
    chosen: list[Option] = []
    n, t = n_on, inst
    for step in range(len(cls.members) - 1, -1, -1):
        j = int(dp.picks[step][n, t])
        if j < 0:
            chosen.append(OFF)
            continue
        opt = cls.options[step][j]
        k = min(opt.instances, cap)
        t = t - k if t < cap else int(dp.cap_sources[step][j][n])
        n -= dn
        chosen.append(opt)
    chosen.reverse()
    return chosen


def _pareto(cost: np.ndarray, inst: np.ndarray, thr: np.ndarray, cap: int) -> np.ndarray:
    """Indices of the states not dominated in (cost ↓, instances ↑, throughput ↑)."""
    order = np.lexsort((-thr, -inst, cost))
    c_sorted, i_sorted, t_sorted = cost[order], inst[order], thr[order]
    keep = np.ones(order.size, dtype=bool)
    for level in range(cap, -1, -1):
        masked = np.where(i_sorted >= level, t_sorted, -np.inf)
        prev = np.concatenate(([-np.inf], np.maximum.accumulate(masked)[:-1]))
        keep &= ~((i_sorted == level) & (prev >= t_sorted))
    del c_sorted
    return np.asarray(order[keep])


def _solve(
    classes: list[_Class], cap: int, budget: float | None, allow_off: bool, max_states: int
) -> tuple[float, list[Option], int, list[int]] | None:
    """max Σ thr s.t. Σ inst ≥ cap and Σ cost ≤ budget over the classes; None when infeasible."""
    track_on = budget is not None
    cells = sum(len(c.members) * ((len(c.members) + 1) if track_on else 1) * (cap + 1) for c in classes)
    if cells > max_states // 4:
        raise SearchTooLarge(
            f"the exact joint search needs {cells:,} DP cells (limit {max_states // 4:,}); "
            "relax the constraints or search a smaller cluster"
        )
    per_class = [_class_dp(c, cap, allow_off, track_on) for c in classes]
    cost = np.zeros(1)
    inst = np.zeros(1, dtype=np.int64)
    thr = np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    states = 1
    for dp in per_class:
        final = dp.final
        n_idx, i_idx = np.nonzero(np.isfinite(final))
        c_cost = n_idx * classes[len(back)].price if track_on else np.zeros(n_idx.size)
        c_thr = final[n_idx, i_idx]
        work = cost.size * n_idx.size * (cap + 1)
        if work > max_states:
            raise SearchTooLarge(
                f"the exact joint search needs {work:,} state updates (limit {max_states:,}); "
                "relax the constraints or search a smaller cluster"
            )
        a = np.repeat(np.arange(cost.size), n_idx.size)
        b = np.tile(np.arange(n_idx.size), cost.size)
        new_cost = cost[a] + c_cost[b]
        new_inst = np.minimum(inst[a] + i_idx[b], cap)
        new_thr = thr[a] + c_thr[b]
        ok = new_cost <= budget + 1e-9 if budget is not None else np.ones(a.size, dtype=bool)
        a, b, new_cost, new_inst, new_thr = a[ok], b[ok], new_cost[ok], new_inst[ok], new_thr[ok]
        if a.size == 0:
            return None
        keep = _pareto(new_cost, new_inst, new_thr, cap)
        states += a.size
        back.append((a[keep], n_idx[b[keep]], i_idx[b[keep]]))
        cost, inst, thr = new_cost[keep], new_inst[keep], new_thr[keep]
    ok_idx = np.nonzero(inst >= cap)[0]
    if ok_idx.size == 0:
        return None
    best = int(ok_idx[np.argmax(thr[ok_idx])])
    choice: dict[int, Option] = {}
    idx = best
    for cls, dp, (prev_idx, n_on, i_on) in zip(
        reversed(classes), reversed(per_class), reversed(back), strict=True
    ):
        opts = _reconstruct(cls, dp, int(n_on[idx]), int(i_on[idx]), cap, track_on)
        for machine, opt in zip(cls.members, opts, strict=True):
            choice[machine] = opt
        idx = int(prev_idx[idx])
    order = sorted(choice)
    return float(thr[best]), [choice[k] for k in order], states, order


def joint_search(
    options: Sequence[Sequence[Option]],
    prices: Sequence[float | None],
    constraints: JointConstraints,
    *,
    max_states: int = 200_000_000,
    clock: Callable[[], float] = time.perf_counter,
) -> SearchResult:
    """The exact optimum of Σ throughput under ``constraints`` (see module docstring)."""
    start = clock()
    if constraints.max_cost_per_hour is not None and any(p is None for p in prices):
        missing = next(i for i, p in enumerate(prices) if p is None)
        raise ValueError(f"machines[{missing}] has no price_per_hour, but the budget constraint needs one")
    cap = constraints.min_instances or 0
    budget = constraints.max_cost_per_hour
    demand = constraints.demand_tokens_per_s
    allow_off = budget is not None or demand is not None
    thresholds = [0.0]
    if demand is not None:
        thresholds = sorted({o.rho_max for opts in options for o in opts if o.rho_max > 0}, reverse=True)
    best: tuple[float, list[Option]] | None = None
    states = 0
    for rho in thresholds:
        allowed = [[o for o in opts if o.rho_max >= rho] for opts in options]
        if budget is None:
            # cost does not matter: one DP over every machine (instances capped at the minimum)
            classes = [_Class(list(range(len(options))), allowed, 0.0)]
        else:
            groups: dict[tuple[tuple[Option, ...], float], list[int]] = {}
            for k, opts in enumerate(allowed):
                groups.setdefault((tuple(opts), prices[k] or 0.0), []).append(k)
            classes = [
                _Class(members, [list(o)] * len(members), price) for (o, price), members in groups.items()
            ]
        solved = _solve(classes, cap, budget, allow_off, max_states)
        if solved is None:
            continue
        thr, chosen, n_states, order = solved
        states += n_states
        if not any(o.tp is not None for o in chosen):
            continue  # an empty deployment serves nothing
        if demand is not None and (thr <= 0 or demand > rho * thr * (1 + 1e-12)):
            continue
        if best is None or thr > best[0]:
            full = [OFF] * len(options)
            for machine, opt in zip(order, chosen, strict=True):
                full[machine] = opt
            best = (thr, full)
    elapsed = clock() - start
    if best is None:
        return SearchResult(
            tuple(OFF for _ in options),
            0.0,
            0,
            0.0,
            True,
            elapsed,
            states,
            "no deployment satisfies the constraints",
        )
    thr, inst, cost = _totals(best[1], prices)
    return SearchResult(tuple(best[1]), thr, inst, cost, True, elapsed, states)
