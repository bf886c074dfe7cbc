"""One measured batch of the profiling sweep, and which measured batches are unusable.

Owns: :class:`BatchShape`, :class:`BatchRecord` (a batch's requests and its prefill/decode sample) and the
interference filters :func:`disturbed`, :func:`undecided` and :func:`burst_read`. They are pure functions
of the records; :mod:`profiling.collect` decides what to re-measure and drop.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from profiling.client import RequestRecord
from profiling.fit import BatchSample, DecodeSample, PrefillSample


@dataclass(frozen=True, slots=True)
class BatchShape:
    batch: int
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class BatchRecord:
    shape: BatchShape
    requests: tuple[RequestRecord, ...]

    @property
    def queued(self) -> bool:
        """True when some request ended before another got its first token: the engine did not run
        the batch as one (more requests than its max sequences, or preemption), so it is unusable."""
        return min(r.end_s for r in self.requests) < max(r.first_token_s for r in self.requests)

    @property
    def ran_together(self) -> int:
        """How many requests had their first token before the first one ended (the engine's concurrency)."""
        first_end = min(r.end_s for r in self.requests)
        return sum(1 for r in self.requests if r.first_token_s <= first_end)

    def to_sample(self) -> BatchSample:
        """Prefill = last first token; decode = last end − last first token over (max O − 1) steps."""
        first = max(r.first_token_s for r in self.requests)
        end = max(r.end_s for r in self.requests)
        prompts = [r.prompt_tokens for r in self.requests if r.prompt_tokens is not None]
        inp = max(prompts) if prompts else self.shape.input_tokens
        outs = [r.completion_tokens if r.completion_tokens is not None else r.chunks for r in self.requests]
        steps = max(outs) - 1
        b = len(self.requests)
        decode = DecodeSample(b, inp, steps, end - first) if steps >= 1 and end > first else None
        shape = (self.shape.batch, self.shape.input_tokens, self.shape.output_tokens)
        return BatchSample(prefill=PrefillSample(b, inp, first), decode=decode, shape=shape)


def _by_shape(batches: Sequence[BatchRecord]) -> dict[BatchShape, list[int]]:
    by_shape: dict[BatchShape, list[int]] = {}
    for idx, batch in enumerate(batches):
        by_shape.setdefault(batch.shape, []).append(idx)
    return by_shape


def undecided(batches: Sequence[BatchRecord], tolerance: float) -> list[BatchShape]:
    """Shapes measured exactly twice whose two batches disagree by more than ``tolerance``: one more
    batch lets :func:`disturbed` tell which one is off."""
    out = []
    for shape, (i, j) in ((k, v) for k, v in _by_shape(batches).items() if len(v) == 2):
        a, b = batches[i].to_sample(), batches[j].to_sample()
        da = a.decode.time_s if a.decode else 0.0
        db = b.decode.time_s if b.decode else 0.0
        pre_off = abs(a.prefill.time_s - b.prefill.time_s) > tolerance * min(
            a.prefill.time_s, b.prefill.time_s
        )
        if pre_off or abs(da - db) > tolerance * min(da, db):
            out.append(shape)
    return out


def _step_s(sample: BatchSample) -> float:
    return sample.decode.time_s / sample.decode.steps if sample.decode is not None else 0.0


def burst_read(batches: Sequence[BatchRecord], floor: float = 0.25) -> list[int]:
    """Indices of batches whose decode time per step is under ``floor`` × the median per-step time of all
    batches of the same width (needs ≥ 3 of them): their streams were read in one burst after a stall
    of the reader (the host's scheduler), so their decode time means nothing."""
    by_width: dict[int, list[int]] = {}
    for idx, batch in enumerate(batches):
        by_width.setdefault(batch.shape.batch, []).append(idx)
    out: list[int] = []
    for members in by_width.values():
        if len(members) >= 3:
            per_step = [_step_s(batches[i].to_sample()) for i in members]
            median = statistics.median(per_step)
            out += [i for i, v in zip(members, per_step, strict=True) if v < floor * median]
    return out


def disturbed(batches: Sequence[BatchRecord], tolerance: float) -> list[int]:
    """Indices of batches whose prefill or decode time is off the median of their shape's batches by more
    than ``tolerance`` (a fraction; needs at least 3 batches of a shape to tell which one is off), or
    that were read in a burst (:func:`burst_read`)."""
    out: list[int] = list(burst_read(batches))
    for members in _by_shape(batches).values():
        if len(members) < 3:
            continue
        samples = [batches[i].to_sample() for i in members]
        pre = statistics.median(s.prefill.time_s for s in samples)
        dec = statistics.median(s.decode.time_s if s.decode else 0.0 for s in samples)
        for idx, s in zip(members, samples, strict=True):
            d = s.decode.time_s if s.decode else 0.0
            if abs(s.prefill.time_s - pre) > tolerance * pre or abs(d - dec) > tolerance * dec:
                out.append(idx)
    return sorted(set(out))
