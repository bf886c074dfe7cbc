"""Wall time of the full paper-a simulation matrix (4,000 requests × 4 rates × 4 policies).

The issue's target: under a minute on a 2-core machine. Run:

    python benchmarks/simulate_speed.py                 # prints per-run and total seconds
    python benchmarks/simulate_speed.py --profile 20    # plus the top cProfile entries of one run

The four policies are round_robin, weighted_round_robin (4:1, the paper's WRR), the router's
default and the paper's scheduler (workload_minmax, θ = 2) when it is registered, else random.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import platform
import pstats
import time
from pathlib import Path

from hetroute.policies import POLICIES
from hetroute.sim.cluster_file import build_fleet
from hetroute.sim.scenarios import get_scenario
from hetroute.sim.workload import generate_workload, rate_label
from hetroute.simulation.simulator import run_simulation

RATES = (8.0, 16.0, 24.0, math.inf)


def policies() -> list[tuple[str, str, dict[str, object]]]:
    out: list[tuple[str, str, dict[str, object]]] = [
        ("round_robin", "round_robin", {}),
        ("weighted_round_robin:weights=4:1", "weighted_round_robin", {"weights": [4, 1]}),
        ("default", "default", {}),
    ]
    if "workload_minmax" in POLICIES:
        out.append(("workload_minmax:theta=2", "workload_minmax", {"theta": 2.0}))
    else:
        out.append(("random", "random", {}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one run, print top N")
    parser.add_argument("--out", type=Path, help="write the timings as JSON")
    args = parser.parse_args()

    started = time.perf_counter()
    fleet = build_fleet(get_scenario("paper-a").cluster())
    rows = []
    for rate in RATES:
        work = generate_workload("sharegpt", args.requests, rate, args.seed, fleet.max_model_len())
        for label, name, params in policies():
            res = run_simulation(fleet, work, name, params, seed=args.seed, label=label)
            rows.append(
                {
                    "rate": rate_label(rate),
                    "policy": label,
                    "wall_s": round(res.wall_s, 3),
                    "events": res.events,
                    "throughput_tokens_per_s": round(res.throughput_tokens_per_s, 1),
                }
            )
            print(
                f"{rate_label(rate):>4} {label:<34} {res.wall_s:6.2f} s  {res.events:7d} events  "
                f"{res.throughput_tokens_per_s:8.0f} tok/s"
            )
    total = time.perf_counter() - started
    print(
        f"total {total:.1f} s for {len(rows)} runs of {args.requests} requests "
        f"({platform.processor() or platform.machine()}, python {platform.python_version()})"
    )
    if args.profile:
        work = generate_workload("sharegpt", args.requests, 24.0, args.seed, fleet.max_model_len())
        prof = cProfile.Profile()
        prof.runcall(run_simulation, fleet, work, policies()[-1][1], policies()[-1][2])
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    if args.out is not None:
        args.out.write_text(json.dumps({"total_s": round(total, 2), "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
