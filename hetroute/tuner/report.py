"""Presenting a :class:`TuneResult`: the ranked text table, the JSON document and a PNG chart.

Owns: :func:`result_to_json` (schema ``hetroute.tune-deploy/1``, documented in docs/tune-deploy.md),
:func:`render_table`, :func:`render_png`. Identical machines (same GPU type, count, model, price and chosen
TP) are shown as one group in the table and the chart, never hidden in the JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetroute.tuner.estimate import ConfigEstimate
from hetroute.tuner.tune import MachinePlan, TuneResult

SCHEMA = "hetroute.tune-deploy/1"


def usd_per_mtoken(price_per_hour: float | None, tokens_per_s: float) -> float | None:
    """Dollars per million tokens at ``tokens_per_s``: price / (tokens per hour / 1e6)."""
    if price_per_hour is None or tokens_per_s <= 0:
        return None
    return price_per_hour / (tokens_per_s * 3600.0 / 1e6)


def _num(x: float | None, digits: int = 1) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits)


def _option_json(e: ConfigEstimate, rank: int | None, price: float | None, estimator: str) -> dict[str, Any]:
    return {
        "tp": e.tp,
        "instances": e.instances,
        "rank": rank,
        "feasible": e.feasible,
        "reason": e.reason,
        "kv_capacity_tokens": e.kv_capacity_tokens,
        "kv_source": e.kv_source,
        "profile_source": e.profile_source,
        "profile_path": e.profile_path,
        "algorithm1_tokens_per_s": _num(e.algorithm1_tokens_per_s),
        "iteration_tokens_per_s": _num(e.iteration_tokens_per_s),
        "iteration_instance_tokens_per_s": _num(e.iteration_instance_tokens_per_s),
        "usd_per_mtoken": _num(usd_per_mtoken(price, e.tokens_per_s(estimator)), 4),
        "preemptions": e.preemptions,
        "mean_batch": _num(e.mean_batch),
        "slo_rho_max": _num(e.rho_max, 3),
        "warnings": list(e.warnings),
    }


def _ranks(plan: MachinePlan, estimator: str) -> dict[int, int]:
    feasible = [e for e in plan.options if e.feasible]
    ordered = sorted(feasible, key=lambda e: (-e.tokens_per_s(estimator), e.tp))
    return {e.tp: k + 1 for k, e in enumerate(ordered)}


def result_to_json(result: TuneResult) -> dict[str, Any]:
    """The whole result as plain data (see docs/tune-deploy.md for the schema)."""
    est = result.estimator
    machines = []
    gpus_used = 0
    for plan in result.plans:
        m = plan.machine
        ranks = _ranks(plan, est)
        chosen = plan.chosen
        if chosen is not None:
            gpus_used += chosen.tp * chosen.instances
        machines.append(
            {
                "name": m.name,
                "gpu": m.gpu.name,
                "gpus": m.gpus,
                "model": m.model_key,
                "price_per_hour": m.price_per_hour,
                "chosen_tp": chosen.tp if chosen else None,
                "chosen_tokens_per_s": _num(chosen.tokens_per_s(est)) if chosen else None,
                "options": [_option_json(e, ranks.get(e.tp), m.price_per_hour, est) for e in plan.options],
            }
        )
    s = result.search
    cons = result.cluster.constraints
    return {
        "schema": SCHEMA,
        "cluster": result.cluster.source,
        "estimator": est,
        "workload": {"kind": result.workload, "requests": result.requests},
        "timing": {
            "estimate_s": round(result.estimate_s, 4),
            "search_s": round(s.elapsed_s, 6),
            "total_s": round(result.elapsed_s, 4),
            "distinct_configs": result.distinct_configs,
        },
        "search": {
            "mode": "joint" if s.joint else "separable",
            "states": s.states,
            "infeasible_reason": s.infeasible_reason,
            "constraints": {
                "min_instances": cons.min_instances,
                "max_cost_per_hour": cons.max_cost_per_hour,
                "slo": None
                if cons.slo is None
                else {"rate_rps": cons.slo.rate_rps, "ttft_s": cons.slo.ttft_s, "tpot_s": cons.slo.tpot_s},
            },
        },
        "machines": machines,
        "total": {
            "tokens_per_s": _num(s.total_tokens_per_s),
            "instances": s.total_instances,
            "gpus_used": gpus_used,
            "machines_used": sum(1 for p in result.plans if p.chosen is not None),
            "cost_per_hour": _num(s.total_cost_per_hour, 2)
            if any(p.machine.price_per_hour for p in result.plans)
            else None,
            "usd_per_mtoken": _num(usd_per_mtoken(s.total_cost_per_hour or None, s.total_tokens_per_s), 4),
        },
    }


def _groups(result: TuneResult) -> list[tuple[list[MachinePlan], MachinePlan]]:
    groups: dict[tuple[object, ...], list[MachinePlan]] = {}
    for plan in result.plans:
        m = plan.machine
        key = (m.gpu.name, m.gpus, m.model_key, m.price_per_hour, plan.chosen.tp if plan.chosen else None)
        groups.setdefault(key, []).append(plan)
    return [(plans, plans[0]) for plans in groups.values()]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def render_table(result: TuneResult) -> str:
    """The ranked table per (group of identical) machine(s), the chosen deployment and the total."""
    est = result.estimator
    lines: list[str] = []
    for plans, plan in _groups(result):
        m = plan.machine
        names = (
            m.name
            if len(plans) == 1
            else f"{plans[0].machine.name} .. {plans[-1].machine.name} ({len(plans)} machines)"
        )
        price = f", ${m.price_per_hour:g}/h" if m.price_per_hour is not None else ""
        lines.append(f"{names}: {m.gpus}x {m.gpu.name}, model {m.model_key}{price}")
        lines.append(
            f"  {'rank':>4} {'TP':>3} {'inst':>4} {'KV tok/inst':>11} {'Alg.1 tok/s':>12} {'iter tok/s':>11} "
            f"{'$/Mtok':>7}  profile / why not"
        )
        ranks = _ranks(plan, est)
        for e in plan.options:
            mark = "*" if plan.chosen is not None and e.tp == plan.chosen.tp else " "
            cost = usd_per_mtoken(m.price_per_hour, e.tokens_per_s(est))
            note = (e.profile_source or "") if e.feasible else f"infeasible: {e.reason}"
            if e.feasible and result.cluster.constraints.slo is not None:
                note += f", SLO met up to utilisation {e.rho_max:.2f}"
            if e.warnings:
                note += f" ({'; '.join(e.warnings)})"
            lines.append(
                f" {mark}{ranks.get(e.tp, '-')!s:>4} {e.tp:>3} {e.instances:>4} "
                f"{_fmt(e.kv_capacity_tokens):>11} "
                f"{_fmt(e.algorithm1_tokens_per_s):>12} {_fmt(e.iteration_tokens_per_s):>11} "
                f"{'-' if cost is None else f'{cost:.3f}':>7}  {note}"
            )
        chosen = f"TP{plan.chosen.tp} x{plan.chosen.instances}" if plan.chosen else "unused"
        lines.append(f"  chosen: {chosen}")
        lines.append("")
    s = result.search
    doc = result_to_json(result)["total"]
    mode = (
        f"joint search ({s.states} states, {s.elapsed_s * 1e3:.1f} ms)" if s.joint else "per-machine argmax"
    )
    lines.append(
        f"estimator: {est}; choice: {mode}; estimates took {result.estimate_s:.2f} s "
        f"for {result.distinct_configs} distinct configurations"
    )
    if s.infeasible_reason:
        lines.append(f"NO DEPLOYMENT: {s.infeasible_reason}")
    cost_text = ""
    if doc["cost_per_hour"]:
        cost_text = f", ${doc['cost_per_hour']:g}/h, ${doc['usd_per_mtoken']}/Mtoken"
    lines.append(
        f"cluster total: {_fmt(s.total_tokens_per_s)} tokens/s from {s.total_instances} instances on "
        f"{doc['machines_used']} machine(s) ({doc['gpus_used']} GPUs){cost_text}"
    )
    return "\n".join(lines) + "\n"


def render_png(result: TuneResult, path: str | Path, max_groups: int = 12) -> None:
    """Grouped bars: both estimates per TP for each machine group; the chosen TP is outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(result)[:max_groups]
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups) + 1, 3.6), squeeze=False)
    for ax, (plans, plan) in zip(axes[0], groups, strict=False):
        opts: Sequence[ConfigEstimate] = sorted(plan.options, key=lambda e: e.tp)
        xs = list(range(len(opts)))
        a1 = [e.algorithm1_tokens_per_s or 0.0 for e in opts]
        it = [e.iteration_tokens_per_s or 0.0 for e in opts]
        ax.bar([x - 0.2 for x in xs], a1, width=0.4, label="Algorithm 1", color="#9ab")
        bars = ax.bar([x + 0.2 for x in xs], it, width=0.4, label="iteration-level", color="#36a")
        for bar, e in zip(bars, opts, strict=True):
            if plan.chosen is not None and e.tp == plan.chosen.tp:
                bar.set_edgecolor("#d62")
                bar.set_linewidth(2.5)
            if not e.feasible:
                ax.text(bar.get_x(), 0, "x", color="#c00", ha="center", va="bottom")
        ax.set_xticks(xs, [f"TP{e.tp}" for e in opts])
        title = f"{plan.machine.gpus}x{plan.machine.gpu.name}\n{plan.machine.model_key}"
        ax.set_title(title + (f" (x{len(plans)})" if len(plans) > 1 else ""), fontsize=8)
        ax.set_ylabel("tokens/s per machine", fontsize=8)
        ax.tick_params(labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=7, ncol=2, frameon=False)
    fig.suptitle(
        f"tune-deploy: {result.cluster.source} ({result.workload}, {result.requests} requests)", fontsize=9
    )
    fig.tight_layout(rect=(0.0, 0.06, 1.0, 1.0))
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
