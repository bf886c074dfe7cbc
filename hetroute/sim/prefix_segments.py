"""Building blocks of the prefix-sharing workloads: segment-id families, ShareGPT length draws, the
``max_model_len`` cap on segmented prompts, and the ideal-reuse measurement.

A segmented prompt is a tuple of ``(segment_id, tokens)`` (``hetroute.prefix.hashing``). Every
function here is pure; randomness comes from a ``numpy.random.Generator`` passed in.

Segment ids are ``FAMILY_BASE[family] + local id`` with local ids below 2**40, so the families of
``sim/prefix_workloads.py``, ``sim/prefix_corpus.py`` and ``sim/mooncake_trace.py`` never share an id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np

from hetroute.errors import ConfigError
from hetroute.prefix.hashing import Segment, segment_block_hashes
from hetroute.sim.workload import SimRequest, clip_to_model_len

FAMILY_BASE: Final[dict[str, int]] = {
    "chat": 1 << 40,
    "system-prompts": 2 << 40,
    "rag": 3 << 40,
    "no-sharing": 4 << 40,
    "mooncake": 5 << 40,
}
"""Segment-id offset of each workload family (local ids stay below 2**40)."""

DEFAULT_MAX_MODEL_LEN: Final = 8192

# ShareGPT figures (docs/calibration.md, "Workloads"), the same as sim/workload.py's.
SHAREGPT_USER_MEDIAN_TOKENS: Final = 125.0
SHAREGPT_USER_SIGMA: Final = 1.15
SHAREGPT_USER_CLIP_TOKENS: Final = (4, 1024)
SHAREGPT_ANSWER_MEAN_TOKENS: Final = 200.0
SHAREGPT_ANSWER_SD_TOKENS: Final = 125.0
MIN_ANSWER_TOKENS: Final = 4


def check(ok: bool, path: str, message: str) -> None:
    """Raise ``ConfigError(path, message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(path, message)


def check_token_range(path: str, lo_hi: tuple[int, int]) -> None:
    """An inclusive ``(low, high)`` token range with ``1 <= low <= high``."""
    check(1 <= lo_hi[0] <= lo_hi[1], path, f"expected 1 <= low <= high, got {lo_hi}")


def check_common(n: int, max_model_len: int) -> None:
    """The arguments every generator takes: ``n >= 0`` requests, ``max_model_len >= 2``."""
    check(n >= 0, "requests", f"must be >= 0, got {n}")
    check(max_model_len >= 2, "max_model_len", f"must be >= 2, got {max_model_len}")


def content_and_timing_streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Two independent generators from ``SeedSequence(seed)``: content first, timing second."""
    content, timing = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(content), np.random.default_rng(timing)


def user_tokens(rng: np.random.Generator, size: int) -> np.ndarray:
    """``size`` ShareGPT user-message lengths (log-normal, median 125, σ 1.15, clipped to 4..1024)."""
    lo, hi = SHAREGPT_USER_CLIP_TOKENS
    draw = SHAREGPT_USER_MEDIAN_TOKENS * np.exp(SHAREGPT_USER_SIGMA * rng.standard_normal(size))
    return np.clip(np.round(draw), lo, hi).astype(np.int64)


def answer_tokens(rng: np.random.Generator, size: int) -> np.ndarray:
    """``size`` ShareGPT answer lengths (normal, mean 200, sd 125, at least 4)."""
    draw = SHAREGPT_ANSWER_MEAN_TOKENS + SHAREGPT_ANSWER_SD_TOKENS * rng.standard_normal(size)
    return np.maximum(np.round(draw), MIN_ANSWER_TOKENS).astype(np.int64)


def zipf_weights(count: int, s: float) -> np.ndarray:
    """Popularity of ``count`` items by rank: p_i ∝ (i+1)^-s (s = 0: uniform), summing to 1."""
    w = np.arange(1, count + 1, dtype=np.float64) ** -s
    return np.asarray(w / w.sum())


def prompt_tokens(segments: Sequence[Segment]) -> int:
    """Tokens of a segmented prompt."""
    return sum(tokens for _, tokens in segments)


def truncate_segments(segments: Sequence[Segment], tokens: int) -> tuple[Segment, ...]:
    """The first ``tokens`` tokens of a segmented prompt (the last kept segment shortened)."""
    out: list[Segment] = []
    left = tokens
    for seg_id, n in segments:
        if left <= 0:
            break
        out.append((seg_id, min(n, left)))
        left -= n
    return tuple(out)


def fit_to_model_len(
    segments: Sequence[Segment], output_tokens: int, max_model_len: int | None
) -> tuple[tuple[Segment, ...], int]:
    """Clip as :func:`~hetroute.sim.workload.clip_to_model_len` does, cutting the prompt at its end.

    The kept prompt is a prefix of the given one, so it shares with other prompts what it shared.
    """
    if max_model_len is None:
        return tuple(segments), output_tokens
    i, o = clip_to_model_len(prompt_tokens(segments), output_tokens, max_model_len)
    return truncate_segments(segments, i), o


def make_request(
    request_id: str,
    arrival_s: float,
    segments: tuple[Segment, ...],
    output_tokens: int,
    *,
    session: str = "",
    send_max_tokens: bool = False,
    model: str = "",
) -> SimRequest:
    """A :class:`SimRequest` whose ``input_tokens`` is the segments' total."""
    return SimRequest(
        request_id=request_id,
        arrival_s=arrival_s,
        input_tokens=prompt_tokens(segments),
        output_tokens=output_tokens,
        max_tokens=output_tokens if send_max_tokens else None,
        model=model,
        segments=segments,
        session=session,
    )


def prefix_reuse_fraction(requests: Sequence[SimRequest], block_tokens: int = 16) -> float:
    """The ideal prefix-cache hit rate: the fraction of prompt tokens in a full block already seen.

    Requests are taken in list order (arrival order) against one infinite cache: a block is a hit when
    an earlier request had a block with the same chained hash (the same tokens from the start of the
    prompt to the end of the block). Requests without segments are unique content. 0.0 when empty.
    """
    seen: set[int] = set()
    hit_tokens = total_tokens = 0
    for req in requests:
        total_tokens += req.input_tokens
        for block in segment_block_hashes(req.segments, block_tokens):
            if block in seen:
                hit_tokens += block_tokens
            else:
                seen.add(block)
    return hit_tokens / total_tokens if total_tokens else 0.0


def reuse_summary(requests: Sequence[SimRequest], block_tokens: int = 16) -> dict[str, float]:
    """Ideal hit fraction (:func:`prefix_reuse_fraction`) and input-token mean/p50/p99."""
    if not requests:
        return {"reuse_fraction": 0.0, "input_mean": math.nan, "input_p50": math.nan, "input_p99": math.nan}
    inputs = np.array([r.input_tokens for r in requests], dtype=np.float64)
    return {
        "reuse_fraction": prefix_reuse_fraction(requests, block_tokens),
        "input_mean": float(inputs.mean()),
        "input_p50": float(np.percentile(inputs, 50)),
        "input_p99": float(np.percentile(inputs, 99)),
    }
