"""The ``mooncake`` workload: replay of a Mooncake trace that keeps the trace's prefix sharing.

A Mooncake trace (FAST'25; e.g. ``mooncake_conversation_trace.jsonl``, never bundled: the path is given
by the user) is JSON lines, one request each: ``timestamp`` (ms from the trace start), ``input_length``
and ``output_length`` (tokens) and ``hash_ids``, the ids of the prompt's consecutive 512-token blocks
(two rows share a block id exactly when they share those 512 tokens and everything before them). Figures
of the conversation trace (docs/calibration.md, "Workloads"): 12,031 requests over ~59 min, input mean
12,035 (p50 6,909), output mean 343, 36.6 % of 512-token blocks repeated.

Conversion: row ``hash_ids = [h0, ..., hm]`` becomes the segments ``(B + h0, 512), ..., (B + hm, r)``
with ``B = FAMILY_BASE["mooncake"]`` and ``r = input_length - 512·m`` (1..512), so the segments sum to
``input_length`` and two rows share exactly the 512-token blocks their leading ``hash_ids`` share. A row
must have ``len(hash_ids) == ceil(input_length / 512)`` (every row of the published trace does).

Timing: ``rate="trace"`` keeps the trace's timestamps (shifted so the first is 0); a number or ``inf``
re-times the rows with seeded Poisson (or gamma, ``arrival_cv``) arrivals in trace order. ``n`` takes the
first ``n`` rows. With ``max_model_len`` a prompt is cut at its end (then the output) so that prompt +
output fit, as ``load_trace`` does: the kept prompt is a prefix of the trace's, so it keeps the sharing
of its blocks. Request ``k`` (trace order) is ``r{k}``; ``session`` is ``""`` (the trace names none).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from hetroute.errors import ConfigError
from hetroute.prefix.hashing import Segment
from hetroute.sim.prefix_segments import (
    FAMILY_BASE,
    content_and_timing_streams,
    fit_to_model_len,
    make_request,
)
from hetroute.sim.workload import Rate, SimRequest, arrival_times

MOONCAKE_BLOCK_TOKENS: Final = 512


def mooncake_segments(hash_ids: Sequence[int], input_length: int) -> tuple[Segment, ...]:
    """The segments of one trace row (see the module docstring); ValueError when they do not match."""
    if input_length < 1:
        raise ValueError(f"input_length must be >= 1, got {input_length}")
    blocks = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise ValueError(
            f"{input_length} tokens need {blocks} hash_ids of {MOONCAKE_BLOCK_TOKENS} tokens, "
            f"got {len(hash_ids)}"
        )
    base = FAMILY_BASE["mooncake"]
    last = input_length - MOONCAKE_BLOCK_TOKENS * (blocks - 1)
    return tuple(
        (base + int(h), last if k == blocks - 1 else MOONCAKE_BLOCK_TOKENS) for k, h in enumerate(hash_ids)
    )


def _read_rows(path: Path, n: int | None) -> list[tuple[float, tuple[Segment, ...], int]]:
    """(timestamp_s, segments, output_tokens) of the first ``n`` rows; errors name the line."""
    rows: list[tuple[float, tuple[Segment, ...], int]] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for lineno, line in enumerate(lines, start=1):
                if n is not None and len(rows) >= n:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    segments = mooncake_segments(list(row["hash_ids"]), int(row["input_length"]))
                    rows.append(
                        (float(row["timestamp"]) / 1000.0, segments, max(1, int(row["output_length"])))
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    raise ConfigError(
                        f"{path}:{lineno}",
                        f"expected a Mooncake row (timestamp, input_length, output_length, hash_ids): {exc}",
                    ) from None
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read trace: {exc.strerror or exc}") from exc
    return rows


def load_mooncake_trace(
    path: str | Path,
    *,
    n: int | None = None,
    rate: Rate = "trace",
    seed: int = 0,
    max_model_len: int | None = None,
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """The first ``n`` rows of a Mooncake trace with their block sharing, sorted by arrival."""
    if n is not None and n < 0:
        raise ConfigError("requests", f"must be >= 0, got {n}")
    if max_model_len is not None and max_model_len < 2:
        raise ConfigError("max_model_len", f"must be >= 2, got {max_model_len}")
    rows = _read_rows(Path(path), n)
    if rate == "trace":
        t0 = min((t for t, _, _ in rows), default=0.0)
        arrivals = [t - t0 for t, _, _ in rows]
    else:
        _, timing = content_and_timing_streams(seed)
        arrivals = arrival_times(len(rows), rate, timing, arrival_cv=arrival_cv).tolist()
    out: list[SimRequest] = []
    for k, ((_, prompt, output), t) in enumerate(zip(rows, arrivals, strict=True)):
        segments, output_tokens = fit_to_model_len(prompt, output, max_model_len)
        out.append(
            make_request(
                f"r{k}", float(t), segments, output_tokens, send_max_tokens=send_max_tokens, model=model
            )
        )
    out.sort(key=lambda r: r.arrival_s)
    return out
