"""Seeded workloads for the simulator: synthetic length distributions, arrival processes, traces.

A workload is a sequence of :class:`SimRequest` sorted by ``arrival_s`` (virtual seconds from 0).
Invariants:

- Every generator is a pure function of its arguments: the same ``seed`` gives the same requests.
  Lengths and arrival gaps come from two independent streams of ``numpy.random.SeedSequence(seed)``, so
  the same seed gives the *same lengths* at every rate (only the arrival times change).
- ``input_tokens >= 1``, ``output_tokens >= 1`` and, when ``max_model_len`` is given,
  ``input_tokens + output_tokens <= max_model_len`` (the prompt is clipped first to leave room for one
  output token, then the output is clipped).
- Rate ``inf`` puts every arrival at t = 0; a finite rate draws Poisson arrivals (exponential gaps) or,
  with ``arrival_cv != 1``, gamma gaps with that coefficient of variation (bursty traces such as Azure
  code have CV ≈ 13).

Length models (docs/calibration.md, "Workloads"):

- ``sharegpt``: vLLM-benchmark-style ShareGPT. Input log-normal (median 125, σ 1.15, clipped to 4..1024:
  mean ≈ 216), output normal (mean 200, sd 125, ≥ 4; median ≈ 200), a Gaussian copula with ρ = 0.2 for
  the weak positive correlation, and prompt + output ≤ 2048.
- ``azure-conv`` / ``azure-code``: inverse-CDF sampling through the quantiles of the Azure LLM inference
  2023 traces (Azure/AzurePublicDataset, CC-BY-4.0): piecewise-linear between the knots below, so the
  medians and tails match the published statistics (conv: input mean ≈ 1155, p50 1020, p90 2734;
  output mean ≈ 211, p50 129, p90 424).

Traces (``load_trace``) are read from a path given by the user; nothing is bundled.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Literal

import numpy as np

from hetroute.errors import ConfigError
from hetroute.prefix.hashing import Segment

WorkloadKind = Literal["sharegpt", "azure-conv", "azure-code"]
WORKLOAD_KINDS: Final[tuple[WorkloadKind, ...]] = ("sharegpt", "azure-conv", "azure-code")

Rate = float | Literal["trace"]
"""Requests per second (``math.inf`` = all at t=0) or ``"trace"`` (keep a trace's own timestamps)."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload. ``output_tokens`` is the TRUE output length the engine will produce.

    ``max_tokens`` is what the client would send (None = not sent); predictors clamp to it. ``model`` is
    empty when the workload does not name one (the simulator then uses the cluster's single model).

    ``segments`` describes the prompt's content for prefix caching (``hetroute.prefix.hashing``): when
    given, their tokens sum to ``input_tokens`` and two requests share cached KV blocks exactly where
    their segments agree; empty means content shared with no other request. ``session`` names the
    conversation or user the request belongs to ("" = none): the session-affinity hint. ``stream``
    False models a non-streaming client: the router sees no first token and no generated tokens
    before the whole answer (the engine works the same).
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    max_tokens: int | None = None
    model: str = ""
    segments: tuple[Segment, ...] = ()
    session: str = ""
    stream: bool = True


# Quantile knots (probability, tokens) of the Azure LLM inference 2023 traces.
_AZURE_KNOTS: Final[dict[str, tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]]] = {
    "azure-conv": (
        (
            (0.0, 2),
            (0.01, 29),
            (0.05, 181),
            (0.10, 207),
            (0.25, 396),
            (0.50, 1020),
            (0.75, 1189),
            (0.90, 2734),
            (0.95, 4083),
            (0.99, 4142),
            (0.999, 6179),
            (1.0, 14050),
        ),
        (
            (0.0, 7),
            (0.01, 16),
            (0.05, 41),
            (0.10, 54),
            (0.25, 85),
            (0.50, 129),
            (0.75, 395),
            (0.90, 424),
            (0.95, 451),
            (0.99, 601),
            (0.999, 954),
            (1.0, 1000),
        ),
    ),
    "azure-code": (
        (
            (0.0, 3),
            (0.01, 17),
            (0.05, 75),
            (0.10, 147),
            (0.25, 578),
            (0.50, 1469),
            (0.75, 2744),
            (0.90, 5188),
            (0.95, 7303),
            (0.99, 7436),
            (1.0, 7437),
        ),
        (
            (0.0, 6),
            (0.10, 7),
            (0.25, 9),
            (0.50, 13),
            (0.75, 24),
            (0.90, 55),
            (0.95, 90),
            (0.97, 128),
            (0.98, 171),
            (0.99, 251),
            (0.995, 359),
            (0.998, 670),
            (0.999, 825),
            (1.0, 1899),
        ),
    ),
}

_SHAREGPT_INPUT_MEDIAN: Final = 125.0
_SHAREGPT_INPUT_SIGMA: Final = 1.15
_SHAREGPT_OUTPUT_MEAN: Final = 200.0
_SHAREGPT_OUTPUT_SD: Final = 125.0
_SHAREGPT_CORRELATION: Final = 0.2
_SHAREGPT_MAX_TOTAL: Final = 2048


def parse_rate(text: str) -> Rate:
    """``"8"`` → 8.0, ``"inf"`` → math.inf, ``"trace"`` → "trace" (ConfigError for anything else)."""
    t = text.strip().lower()
    if t == "trace":
        return "trace"
    try:
        value = float(t)
    except ValueError:
        raise ConfigError("rates", f"expected a number, 'inf' or 'trace', got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise ConfigError("rates", f"a rate must be > 0 requests/s, got {text!r}")
    return value


def rate_label(rate: Rate) -> str:
    """The rate as written on the command line and in JSON keys (``8``, ``12.5``, ``inf``, ``trace``)."""
    if rate == "trace":
        return "trace"
    if math.isinf(rate):
        return "inf"
    return f"{rate:g}"


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    lengths, arrivals = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(lengths), np.random.default_rng(arrivals)


def _sharegpt_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    z = rng.standard_normal((n, 2))
    z_out = _SHAREGPT_CORRELATION * z[:, 0] + math.sqrt(1.0 - _SHAREGPT_CORRELATION**2) * z[:, 1]
    inputs = np.clip(np.round(_SHAREGPT_INPUT_MEDIAN * np.exp(_SHAREGPT_INPUT_SIGMA * z[:, 0])), 4, 1024)
    outputs = np.clip(np.round(_SHAREGPT_OUTPUT_MEAN + _SHAREGPT_OUTPUT_SD * z_out), 4, None)
    outputs = np.minimum(outputs, _SHAREGPT_MAX_TOTAL - inputs)
    return inputs.astype(np.int64), outputs.astype(np.int64)


def _quantile_sample(rng: np.random.Generator, knots: Sequence[tuple[float, float]], n: int) -> np.ndarray:
    probs = np.array([p for p, _ in knots])
    values = np.array([v for _, v in knots], dtype=np.float64)
    return np.maximum(np.round(np.interp(rng.random(n), probs, values)), 1).astype(np.int64)


def arrival_times(n: int, rate: float, rng: np.random.Generator, *, arrival_cv: float = 1.0) -> np.ndarray:
    """``n`` arrival times from t=0: all zero for ``inf``, else cumulative gaps with mean ``1/rate``.

    The first request arrives at t = 0. Gaps are exponential (Poisson process) when ``arrival_cv == 1``,
    gamma with shape ``1/cv²`` otherwise.
    """
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if arrival_cv <= 0:
        raise ConfigError("arrival_cv", f"must be > 0, got {arrival_cv}")
    mean_gap_s = 1.0 / rate
    if arrival_cv == 1.0:
        gaps = rng.exponential(mean_gap_s, n - 1)
    else:
        shape = 1.0 / (arrival_cv * arrival_cv)
        gaps = rng.gamma(shape, mean_gap_s / shape, n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def clip_to_model_len(input_tokens: int, output_tokens: int, max_model_len: int) -> tuple[int, int]:
    """Clip so that input + output ≤ max_model_len: the prompt first (leaving one output token)."""
    i = max(1, min(input_tokens, max_model_len - 1))
    o = max(1, min(output_tokens, max_model_len - i))
    return i, o


def _assemble(
    inputs: Sequence[int],
    outputs: Sequence[int],
    arrivals: Sequence[float],
    *,
    max_model_len: int | None,
    send_max_tokens: bool,
    model: str,
) -> list[SimRequest]:
    out: list[SimRequest] = []
    for k, (i_raw, o_raw, t) in enumerate(zip(inputs, outputs, arrivals, strict=True)):
        i, o = int(i_raw), int(o_raw)
        if max_model_len is not None:
            i, o = clip_to_model_len(i, o, max_model_len)
        out.append(
            SimRequest(
                request_id=f"r{k}",
                arrival_s=float(t),
                input_tokens=i,
                output_tokens=o,
                max_tokens=o if send_max_tokens else None,
                model=model,
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return out


def generate_workload(
    kind: WorkloadKind,
    n: int,
    rate: float,
    seed: int,
    max_model_len: int | None = None,
    *,
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """``n`` synthetic requests of ``kind`` arriving at ``rate`` req/s (``math.inf``: all at t=0).

    ``send_max_tokens`` sets ``max_tokens`` to the true output length, as a benchmark client that asks
    for exactly that many tokens (``ignore_eos``) does.
    """
    if n < 0:
        raise ConfigError("requests", f"must be >= 0, got {n}")
    if max_model_len is not None and max_model_len < 2:
        raise ConfigError("max_model_len", f"must be >= 2, got {max_model_len}")
    len_rng, arr_rng = _streams(seed)
    if kind == "sharegpt":
        inputs, outputs = _sharegpt_lengths(len_rng, n)
    elif kind in _AZURE_KNOTS:
        in_knots, out_knots = _AZURE_KNOTS[kind]
        inputs = _quantile_sample(len_rng, in_knots, n)
        outputs = _quantile_sample(len_rng, out_knots, n)
    else:
        raise ConfigError(
            "workload", f"expected one of {', '.join(WORKLOAD_KINDS)} or a trace path, got {kind!r}"
        )
    arrivals = arrival_times(n, rate, arr_rng, arrival_cv=arrival_cv)
    return _assemble(
        inputs.tolist(),
        outputs.tolist(),
        arrivals.tolist(),
        max_model_len=max_model_len,
        send_max_tokens=send_max_tokens,
        model=model,
    )


def _read_rows(path: Path) -> tuple[list[float | None], list[int], list[int]]:
    """(timestamps_s or None, inputs, outputs) from a CSV or JSONL trace; errors name the line."""
    times: list[float | None] = []
    inputs: list[int] = []
    outputs: list[int] = []
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, f"cannot read trace: {exc.strerror or exc}") from exc
    if path.suffix.lower() in (".jsonl", ".json"):
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                inputs.append(int(row["input_length"]))
                outputs.append(int(row["output_length"]))
                times.append(float(row["timestamp"]) / 1000.0 if "timestamp" in row else None)
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"{source}:{lineno}", f"expected timestamp(ms)/input_length/output_length: {exc}"
                ) from None
        return times, inputs, outputs
    reader = csv.DictReader(text.splitlines())
    fields = set(reader.fieldnames or ())
    if not {"num_prefill_tokens", "num_decode_tokens"} <= fields:
        raise ConfigError(source, "a CSV trace needs num_prefill_tokens and num_decode_tokens columns")
    for lineno, row in enumerate(reader, start=2):
        try:
            inputs.append(int(float(row["num_prefill_tokens"])))
            outputs.append(int(float(row["num_decode_tokens"])))
            times.append(float(row["arrived_at"]) if row.get("arrived_at") not in (None, "") else None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}:{lineno}", f"bad number: {exc}") from None
    return times, inputs, outputs


def load_trace(
    path: str | Path,
    *,
    n: int | None = None,
    rate: Rate = "trace",
    seed: int = 0,
    max_model_len: int | None = None,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """The first ``n`` requests of a trace file, re-timed by ``rate``.

    CSV: ``arrived_at`` (s, optional), ``num_prefill_tokens``, ``num_decode_tokens`` (vidur/splitwise
    layout). JSONL: ``timestamp`` (ms), ``input_length``, ``output_length`` (Mooncake layout).
    ``rate="trace"`` keeps the trace's timestamps (shifted so the first is 0); a number or ``inf``
    replaces them with seeded Poisson arrivals. Lengths of 0 become 1.
    """
    times, inputs, outputs = _read_rows(Path(path))
    if n is not None:
        times, inputs, outputs = times[:n], inputs[:n], outputs[:n]
    if rate == "trace":
        if any(t is None for t in times):
            raise ConfigError(str(path), "rate 'trace' needs arrival times, and this trace has none")
        stamps = [t for t in times if t is not None]
        t0 = min(stamps, default=0.0)
        arrivals = [t - t0 for t in stamps]
    else:
        _, arr_rng = _streams(seed)
        arrivals = arrival_times(len(inputs), rate, arr_rng).tolist()
    return _assemble(
        [max(1, i) for i in inputs],
        [max(1, o) for o in outputs],
        arrivals,
        max_model_len=max_model_len,
        send_max_tokens=send_max_tokens,
        model=model,
    )


def retime(requests: Sequence[SimRequest], rate: float, seed: int) -> list[SimRequest]:
    """The same requests with fresh seeded arrivals at ``rate`` (order and ids kept)."""
    _, arr_rng = _streams(seed)
    arrivals = arrival_times(len(requests), rate, arr_rng)
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, arrivals, strict=True)]
