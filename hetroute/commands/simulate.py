"""``hetroute simulate``: run a (policy × rate) matrix through the discrete-event simulator.

Parses the command line, resolves the cluster (built-in scenario or cluster file), builds one
workload per rate (same lengths at every rate for one seed), runs every policy on it with
:func:`hetroute.simulation.simulator.run_simulation`, prints a table and writes JSON/PNG on request.

Policy syntax: :mod:`hetroute.commands.policy_specs`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetroute.commands.policy_specs import PolicySpec, parse_policy_list, parse_policy_spec
from hetroute.errors import ConfigError
from hetroute.routing.foreign import DEFAULT_FOREIGN_MODE, FOREIGN_MODES

if TYPE_CHECKING:
    from hetroute.sim.cluster_file import Fleet, SimClusterSpec
    from hetroute.sim.workload import Rate
    from hetroute.simulation.admission_run import SimAdmission
    from hetroute.simulation.report import MatrixRun


def add_parser(subparsers: Any) -> None:
    from hetroute.sim.named_workloads import WORKLOAD_HELP
    from hetroute.sim.prefix_workloads import MOONCAKE_KIND

    p = subparsers.add_parser(
        "simulate",
        help="simulate routing policies on a cluster of engines in virtual time",
        description=(
            "Discrete-event simulation of a heterogeneous cluster driving the real router, policies, "
            "ledger and predictor. Prints a table; --json/--plot write the results (docs/simulate.md)."
        ),
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scenario", help="a built-in cluster (see --list-scenarios)")
    where.add_argument("--cluster", type=Path, help="a cluster file (YAML; see config/simulate/)")
    p.add_argument("--list-scenarios", action="store_true", help="list the built-in clusters and exit")
    p.add_argument("--workload", default="sharegpt", help=WORKLOAD_HELP)
    p.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help=f"the Mooncake trace file (.jsonl with hash_ids) for --workload {MOONCAKE_KIND}",
    )
    p.add_argument(
        "--policies", default="round_robin,weighted_round_robin,default", help="comma-separated policy specs"
    )
    p.add_argument(
        "--policy", action="append", default=[], metavar="SPEC", help="one more policy spec (repeatable)"
    )
    p.add_argument("--theta", type=float, help="θ for every listed policy that takes it (method.md §5)")
    p.add_argument("--predictor", default="default", help="output-length predictor NAME[:KEY=VALUE...]")
    p.add_argument(
        "--rates", default=None, help="comma-separated req/s, 'inf' or 'trace' (default 8,16,24,inf)"
    )
    p.add_argument("--requests", type=int, default=4000, help="requests per run (a trace's first N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arrival-cv", type=float, default=1.0, help="coefficient of variation of inter-arrival gaps"
    )
    p.add_argument(
        "--max-model-len", type=int, help="clip prompt+output to this (default: the engines' limit)"
    )
    p.add_argument(
        "--send-max-tokens", action="store_true", help="requests carry max_tokens = their true length"
    )
    _add_router_args(p)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG plot of throughput and TTFT p99 against rate")
    p.set_defaults(func=run)


def _add_router_args(p: argparse.ArgumentParser) -> None:
    """The options that set up the simulated router (scrapes, learning, admission, replicas)."""
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        help="seconds between engine-metric scrapes (default: gateway's scrape.interval_s; 0: live)",
    )
    p.add_argument(
        "--learning",
        choices=("on", "off"),
        default="on",
        help=(
            "live latency learning as the gateway runs it (default on, like `hetroute serve`); "
            "off: the policies use only the profile, roofline prior or neutral default"
        ),
    )
    p.add_argument(
        "--blind",
        action="store_true",
        help=(
            "the router knows nothing of the engines (no GPU/TP labels, no profile, no catalog "
            "model: the neutral default), as in front of engines serving a house model name"
        ),
    )
    p.add_argument(
        "--admission",
        help="put the gateway's admission queue in front of the router: 'on' (its defaults) or a YAML "
        "file whose `admission:` section configures it (a router config works; every request is in "
        "the default class and tenant)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="run K router replicas, each with its own ledger, policy, learner and prefix index, taking "
        "arrivals in turn (request k to replica k mod K), as behind a round-robin Service (docs/replicas.md)",
    )
    p.add_argument(
        "--foreign-load",
        choices=FOREIGN_MODES,
        default=DEFAULT_FOREIGN_MODE,
        help="how each replica counts the requests the engines hold that it did not send "
        f"(scrape.foreign_load; default {DEFAULT_FOREIGN_MODE})",
    )
    p.add_argument(
        "--peer-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="with --replicas > 1: the replicas exchange summaries of their requests in flight and their "
        "completions every S seconds of modelled time, as with the gateway's peers section "
        "(docs/replicas.md; 0, the default: no exchange)",
    )
    p.add_argument(
        "--no-peer-mirror",
        action="store_true",
        help="with --peer-interval: the replicas do not count their own change since a peer's summary as "
        "that peer's too (peers.mirror: false; docs/replicas.md)",
    )


def _with_theta(
    specs: Sequence[PolicySpec], theta: float | None, backends: Any, seed: int
) -> list[PolicySpec]:
    """Add θ where the policy accepts it; build each policy once so bad params fail before the matrix."""
    from hetroute.policies import PolicyContext, build_policy

    out: list[PolicySpec] = []
    for spec in specs:
        params = dict(spec.params)
        if theta is not None and "theta" not in params:
            try:
                build_policy(spec.name, {**params, "theta": theta}, PolicyContext(backends, seed))
                params["theta"] = theta
            except ConfigError as exc:
                if exc.path != "policy.params.theta":
                    raise
        try:
            build_policy(spec.name, params, PolicyContext(backends, seed))
        except ConfigError as exc:
            raise ConfigError(
                f"policies[{spec.label}].{exc.path.removeprefix('policy.')}", exc.message
            ) from None
        out.append(PolicySpec(spec.label, spec.name, params))
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ConfigError("policies", f"a policy is listed twice: {', '.join(labels)}")
    return out


def _list_scenarios() -> int:
    from hetroute.sim.cluster_file import build_fleet
    from hetroute.sim.scenarios import SCENARIOS

    for name, scenario in SCENARIOS.items():
        fleet = build_fleet(scenario.cluster())
        print(f"{name}: {scenario.description}")
        for b in fleet.backends:
            print(
                f"    {b.name:<12} {b.gpu} TP{b.tp}  {b.models[0]}  "
                f"KV {b.kv_capacity_tokens} tokens  weight {b.weight:g}"
            )
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"hetroute simulate: error: {exc}", file=sys.stderr)
        return 2


def _admission(source: str | None) -> SimAdmission | None:
    """``--admission``: None, ``on`` (the defaults) or a YAML file with an ``admission:`` section."""
    from hetroute.admission.config import AdmissionConfig, parse_admission
    from hetroute.fields import file_errors, load_yaml
    from hetroute.simulation.admission_run import SimAdmission

    if source is None:
        return None
    if source == "on":
        return SimAdmission(AdmissionConfig(enabled=True))
    with file_errors(f"--admission {source}"):
        data = load_yaml(source)
        if not isinstance(data, dict) or "admission" not in data:
            raise ConfigError("admission", "missing (the file has no `admission:` section)")
        return SimAdmission(parse_admission(data["admission"]))


def _run(args: argparse.Namespace) -> int:
    from hetroute.simulation.simulator import GATEWAY_SCRAPE_INTERVAL_S

    if args.list_scenarios:
        return _list_scenarios()
    if args.scenario is None and args.cluster is None:
        raise ConfigError(
            "--scenario/--cluster", "give a built-in scenario or a cluster file (--list-scenarios)"
        )
    if args.requests < 1:
        raise ConfigError("--requests", f"must be >= 1, got {args.requests}")
    if args.replicas < 1:
        raise ConfigError("--replicas", f"must be >= 1, got {args.replicas}")
    if not 0 <= args.peer_interval < math.inf:
        raise ConfigError("--peer-interval", f"must be a finite number >= 0, got {args.peer_interval}")
    cluster, fleet = _cluster_and_fleet(args)
    rates = _rates(args)
    specs = parse_policy_list(args.policies) + [parse_policy_spec(s) for s in args.policy]
    if not specs:
        raise ConfigError("--policies", "no policy given")
    specs = _with_theta(specs, args.theta, fleet.backends, args.seed)
    pred = parse_policy_spec(args.predictor)
    max_len = args.max_model_len or fleet.max_model_len()
    scrape_s = GATEWAY_SCRAPE_INTERVAL_S if args.scrape_interval is None else args.scrape_interval
    admission = _admission(args.admission)

    started = time.perf_counter()
    runs, summary = _run_matrix(args, fleet, rates, specs, pred, max_len, scrape_s, admission)
    elapsed = time.perf_counter() - started
    _report(args, cluster, fleet, rates, runs, summary, pred, max_len, scrape_s, elapsed)
    return 0


def _cluster_and_fleet(args: argparse.Namespace) -> tuple[SimClusterSpec, Fleet]:
    """The cluster named by ``--scenario``/``--cluster`` and its fleet (made blind with ``--blind``)."""
    from hetroute.sim.cluster_file import blind_fleet, build_fleet, load_cluster_file
    from hetroute.sim.scenarios import get_scenario

    cluster = get_scenario(args.scenario).cluster() if args.scenario else load_cluster_file(args.cluster)
    fleet = build_fleet(cluster)
    if args.blind:
        fleet = blind_fleet(fleet)
    return cluster, fleet


def _rates(args: argparse.Namespace) -> list[Rate]:
    """``--rates`` parsed (default: ``trace`` for a trace workload, else 8,16,24,inf); ConfigError if bad."""
    from hetroute.sim.named_workloads import workload_source
    from hetroute.sim.workload import parse_rate

    is_trace = workload_source(args.workload, args.trace) in ("trace", "mooncake")
    rates = [
        parse_rate(r)
        for r in (args.rates or ("trace" if is_trace else "8,16,24,inf")).split(",")
        if r.strip()
    ]
    if not rates:
        raise ConfigError("--rates", "no rate given")
    if not is_trace and "trace" in rates:
        raise ConfigError("--rates", "'trace' needs a trace file as --workload or --workload mooncake")
    return rates


def _run_matrix(
    args: argparse.Namespace,
    fleet: Fleet,
    rates: Sequence[Rate],
    specs: Sequence[PolicySpec],
    pred: PolicySpec,
    max_len: int,
    scrape_s: float,
    admission: SimAdmission | None,
) -> tuple[list[MatrixRun], dict[str, Any]]:
    """Run every policy in ``specs`` at every rate; returns the runs and the last workload's summary."""
    from hetroute.learning.settings import LearningConfig
    from hetroute.policies import resolve_policy_name
    from hetroute.sim.named_workloads import build_named_workload
    from hetroute.sim.workload import rate_label
    from hetroute.simulation.report import MatrixRun, workload_summary
    from hetroute.simulation.simulator import run_simulation

    runs: list[MatrixRun] = []
    summary: dict[str, Any] = {}
    for rate in rates:
        workload = build_named_workload(
            args.workload,
            args.trace,
            n=args.requests,
            rate=rate,
            seed=args.seed,
            max_model_len=max_len,
            arrival_cv=args.arrival_cv,
            send_max_tokens=args.send_max_tokens,
        )
        summary = workload_summary(args.workload, workload)
        for spec in specs:
            result = run_simulation(
                fleet,
                workload,
                spec.name,
                spec.params,
                predictor=pred.name,
                predictor_params=pred.params,
                seed=args.seed,
                scrape_interval_s=scrape_s,
                label=spec.label,
                learning=LearningConfig() if args.learning == "on" else None,
                admission=admission,
                replicas=args.replicas,
                foreign=args.foreign_load,
                peer_interval_s=args.peer_interval,
                peer_mirror=not args.no_peer_mirror,
            )
            runs.append(MatrixRun(rate_label(rate), resolve_policy_name(spec.name), spec.params, result))
    return runs, summary


def _report(
    args: argparse.Namespace,
    cluster: SimClusterSpec,
    fleet: Fleet,
    rates: Sequence[Rate],
    runs: list[MatrixRun],
    summary: dict[str, Any],
    pred: PolicySpec,
    max_len: int,
    scrape_s: float,
    elapsed_s: float,
) -> None:
    """Print the table and write ``--json``/``--plot`` when asked (``summary`` is extended in place)."""
    from hetroute.sim.workload import rate_label
    from hetroute.simulation.report import build_document, format_table, write_json, write_plot

    summary.update(
        {
            "seed": args.seed,
            "max_model_len": max_len,
            "arrival_cv": args.arrival_cv,
            "send_max_tokens": args.send_max_tokens,
            "rates": [rate_label(r) for r in rates],
        }
    )
    print(f"cluster {cluster.name}: {', '.join(f'{b.name} ({b.gpu} TP{b.tp})' for b in fleet.backends)}")
    print(f"workload {args.workload}: {args.requests} requests, seed {args.seed}; predictor {pred.label}")
    if args.replicas > 1:
        exchange = f"; summaries every {args.peer_interval:g} s" if args.peer_interval > 0 else ""
        if args.peer_interval > 0 and args.no_peer_mirror:
            exchange += " (no mirror)"
        mode = args.foreign_load
        print(f"{args.replicas} router replicas taking arrivals in turn; foreign load {mode}{exchange}")
    print(format_table(runs))
    print(f"{len(runs)} runs in {elapsed_s:.1f} s")
    if args.json is not None:
        doc = build_document(
            fleet, summary, runs, seed=args.seed, scrape_interval_s=scrape_s, elapsed_s=elapsed_s
        )
        write_json(doc, args.json)
    if args.plot is not None:
        write_plot(runs, args.plot, title=f"{cluster.name} · {args.workload} · {args.requests} requests")
