"""The workload a command line names: a length-only kind, a prefix-sharing family, or a trace.

``--workload`` takes one of ``WORKLOAD_KINDS`` (``sim/workload.py``: lengths only), one of
``PREFIX_WORKLOAD_KINDS`` (``sim/prefix_workloads.py``: prompts with shared prefixes), ``mooncake``
(with a trace path: ``sim/mooncake_trace.py``, the trace's block sharing kept) or the path of a trace
file (lengths only, ``load_trace``). A Mooncake file given as a path therefore replays its lengths only;
``mooncake`` with the same file replays its sharing too. Every choice gives the same requests at every
rate of one seed; only arrival times change.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Final, Literal

from hetroute.errors import ConfigError
from hetroute.sim.mooncake_trace import load_mooncake_trace
from hetroute.sim.prefix_workloads import MOONCAKE_KIND, PREFIX_WORKLOAD_KINDS, generate_prefix_workload
from hetroute.sim.workload import WORKLOAD_KINDS, Rate, SimRequest, generate_workload, load_trace

WorkloadSource = Literal["synthetic", "prefix", "mooncake", "trace"]

WORKLOAD_HELP: Final = (
    f"lengths only: one of {', '.join(WORKLOAD_KINDS)}, or a trace file (.csv or .jsonl); with prompt "
    f"prefixes shared as in real traffic: one of {', '.join(PREFIX_WORKLOAD_KINDS)}, or {MOONCAKE_KIND} "
    "with --trace (a Mooncake JSONL trace replayed with its block sharing; the same file given as "
    "--workload replays its lengths only). Default: sharegpt"
)


def workload_source(workload: str, trace: Path | None) -> WorkloadSource:
    """What ``workload`` names; ConfigError unless ``trace`` is given exactly for ``mooncake``."""
    if workload == MOONCAKE_KIND:
        if trace is None:
            raise ConfigError("--trace", f"--workload {MOONCAKE_KIND} needs --trace PATH (the trace file)")
        if not trace.is_file():
            raise ConfigError("--trace", f"not a file: {trace}")
        return "mooncake"
    if trace is not None:
        raise ConfigError("--trace", f"only --workload {MOONCAKE_KIND} takes a trace file")
    if workload in WORKLOAD_KINDS:
        return "synthetic"
    if workload in PREFIX_WORKLOAD_KINDS:
        return "prefix"
    if not Path(workload).is_file():
        kinds = ", ".join((*WORKLOAD_KINDS, *PREFIX_WORKLOAD_KINDS, MOONCAKE_KIND))
        raise ConfigError("--workload", f"not a workload kind ({kinds}) nor a file: {workload}")
    return "trace"


def build_named_workload(
    workload: str,
    trace: Path | None,
    *,
    n: int,
    rate: Rate,
    seed: int,
    max_model_len: int,
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
) -> list[SimRequest]:
    """``n`` requests of the named workload at ``rate`` (``"trace"``: a trace's own timestamps).

    A synthetic workload at rate ``"trace"`` arrives all at t = 0. ``arrival_cv`` does not apply to a
    trace file (``load_trace`` re-times with Poisson arrivals).
    """
    source = workload_source(workload, trace)
    if source == "trace":
        return load_trace(
            workload, n=n, rate=rate, seed=seed, max_model_len=max_model_len, send_max_tokens=send_max_tokens
        )
    if source == "mooncake" and trace is not None:  # workload_source checked that trace is given
        return load_mooncake_trace(
            trace,
            n=n,
            rate=rate,
            seed=seed,
            max_model_len=max_model_len,
            arrival_cv=arrival_cv,
            send_max_tokens=send_max_tokens,
        )
    numeric_rate = math.inf if rate == "trace" else rate
    if source == "prefix":
        return generate_prefix_workload(
            workload,
            n,
            numeric_rate,
            seed,
            max_model_len,
            arrival_cv=arrival_cv,
            send_max_tokens=send_max_tokens,
        )
    kind = next(k for k in WORKLOAD_KINDS if k == workload)
    return generate_workload(
        kind, n, numeric_rate, seed, max_model_len, arrival_cv=arrival_cv, send_max_tokens=send_max_tokens
    )
