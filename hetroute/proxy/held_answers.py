"""What finished answers teach the token estimator and the output-length predictor, held and taken in
batches (docs/performance.md, "held records").

Owns :class:`HeldAnswers`. Contract: every answer given to :meth:`HeldAnswers.add` reaches the
estimator (its prompt's characters against the engine's token count) and, when its output length is
known, the predictor, in the order the answers finished and exactly as if each were given at once:
once ``ANSWER_BATCH`` are held (after the current event-loop step, :func:`~hetroute.deferred.run_soon`),
and whenever :meth:`HeldAnswers.flush` is called (the app does every ``FLUSH_INTERVAL_S`` and at
shutdown). Until then, predictions and token estimates are those of the answers taken in so far: a
lag of at most ``ANSWER_BATCH`` answers or ``FLUSH_INTERVAL_S``, against a predictor window of
hundreds of answers.
"""

from __future__ import annotations

from typing import NamedTuple

from hetroute.deferred import run_soon
from hetroute.proxy.protocols import TokenEstimator
from hetroute.types import OutputLengthPredictor

ANSWER_BATCH = 64
"""Answers held before they are taken in together."""


class Answer(NamedTuple):
    """One successful answer: its model, its prompt's characters, the engine's prompt token count
    (None when it reported none), the prompt tokens the predictor is told (the engine's count, else
    the router's estimate), the output tokens (None when unknown) and whether the output stopped
    because the serving backend's context window was full (:func:`hetroute.output_limits.output_cut`)."""

    model: str
    prompt_chars: int
    engine_prompt_tokens: int | None
    prompt_tokens: int
    completion_tokens: int | None
    cut: bool = False


class HeldAnswers:
    """The answers finished since the estimator and the predictor last took them in."""

    __slots__ = ("_estimator", "_predictor", "_held")

    def __init__(self, estimator: TokenEstimator, predictor: OutputLengthPredictor) -> None:
        self._estimator = estimator
        self._predictor = predictor
        self._held: list[Answer] = []

    def __len__(self) -> int:
        return len(self._held)

    def add(self, answer: Answer) -> None:
        held = self._held
        held.append(answer)
        if len(held) == ANSWER_BATCH:  # once per batch, after the current event-loop step
            run_soon(self.flush)

    def flush(self) -> None:
        """Take in the held answers, oldest first."""
        if not self._held:
            return
        held, self._held = self._held, []
        observe_chars, observe_output = self._estimator.observe, self._predictor.observe
        for model, chars, engine_prompt, prompt, completion, cut in held:
            observe_chars(model, chars, engine_prompt)
            if completion is not None:
                observe_output(model, prompt, completion, cut)
