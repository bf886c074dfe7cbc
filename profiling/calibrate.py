"""Calibration probes run before a sweep: prompt words → tokens, and whether output length is exact.

Owns: two probe requests (40 and 200 filler words, 8 output tokens each) that measure how many tokens a
filler word costs on this engine's tokenizer and whether the engine honours ``min_tokens`` +
``ignore_eos``; and :class:`PromptMaker`, which turns a token target into a prompt. Every prompt starts
with the run id and a serial number, so no prefix cache can serve any part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from hetroute.types import Clock
from profiling.client import OutputControl, RequestFailed, RequestRecord, request_body, stream_request
from profiling.discover import EngineInfo

FILLER = " the"


@dataclass(frozen=True, slots=True)
class Calibration:
    """Result of the probes: prompt words → tokens, and how output length is controlled."""

    tokens_per_word: float
    offset_tokens: float
    control: OutputControl
    input_measured: bool
    notes: tuple[str, ...] = ()


class PromptMaker:
    """Prompts of ~N tokens: a unique head (run id, serial) then filler words, per the calibration."""

    def __init__(self, run_id: str, calibration: Calibration) -> None:
        self._run_id = run_id
        self._cal = calibration
        self._serial = 0

    def make(self, tokens: int) -> str:
        self._serial += 1
        words = round((tokens - self._cal.offset_tokens) / self._cal.tokens_per_word)
        return f"{self._run_id}-{self._serial}:" + FILLER * max(1, words)


async def _probe(
    session: aiohttp.ClientSession,
    base: str,
    info: EngineInfo,
    prompt: str,
    out: int,
    ctl: OutputControl,
    clock: Clock,
) -> RequestRecord:
    path, body = request_body(info.engine, info.model, prompt, out, ctl)
    return await stream_request(session, base, path, body, clock, clock.now())


async def calibrate(
    session: aiohttp.ClientSession, base: str, info: EngineInfo, run_id: str, clock: Clock
) -> Calibration:
    """Two probe requests: 40 and 200 filler words, 8 output tokens, exact control when offered."""
    notes: list[str] = []
    control: OutputControl = "max_tokens" if info.engine == "tgi" else "exact"
    short = f"{run_id}-p1:" + FILLER * 40
    try:
        a = await _probe(session, base, info, short, 8, control, clock)
    except RequestFailed as exc:
        if control != "exact" or exc.status not in (400, 422):
            raise
        notes.append(f"engine rejected min_tokens/ignore_eos ({exc}); output length is only bounded")
        control = "max_tokens"
        a = await _probe(session, base, info, short, 8, control, clock)
    got = a.completion_tokens if a.completion_tokens is not None else a.chunks
    if got != 8:
        notes.append(
            f"asked for exactly 8 output tokens, got {got}: output length NOT controlled; using measured"
        )
        control = "max_tokens"
    elif control == "exact":
        notes.append("output length controlled exactly (min_tokens + ignore_eos + max_tokens)")
    else:
        notes.append(
            f"{info.engine} has no min_tokens/ignore_eos; output bounded by max tokens, counts measured"
        )
    b = await _probe(session, base, info, f"{run_id}-p2:" + FILLER * 200, 8, control, clock)
    if a.prompt_tokens is None or b.prompt_tokens is None or b.prompt_tokens <= a.prompt_tokens:
        notes.append("engine did not report prompt token counts: input lengths assume 1 token per word")
        return Calibration(1.0, 0.0, control, False, tuple(notes))
    per_word = (b.prompt_tokens - a.prompt_tokens) / 160.0
    offset = a.prompt_tokens - 40 * per_word
    notes.append(f"prompt calibration: {per_word:.3f} tokens per filler word, {offset:.1f} tokens of head")
    return Calibration(per_word, offset, control, True, tuple(notes))
