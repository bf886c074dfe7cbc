"""A request's output limit, and whether an output stopped at it.

A request can get at most its ``max_tokens`` and what the engine's context window (``max_model_len``:
prompt and output together) leaves after its prompt. The output-length prediction is clamped to that
limit (:func:`output_limit`), and an output that filled the window (:func:`output_cut`) is a lower
bound of what the model would have written, which the predictor must not take as the output's length
(``OutputLengthPredictor.observe``, ``cut``).
"""

from __future__ import annotations


def output_limit(max_tokens: int | None, context_tokens: int | None, input_tokens: int) -> int | None:
    """The most output tokens a request can get: its ``max_tokens`` and what the context window
    (``context_tokens``: prompt and output together) leaves after its ``input_tokens``, at least 1;
    None when neither is known."""
    if context_tokens is None:
        return max_tokens
    room = max(context_tokens - max(input_tokens, 0), 1)
    return room if max_tokens is None else min(max_tokens, room)


def output_cut(context_tokens: int | None, input_tokens: int, output_tokens: int) -> bool:
    """Whether an output stopped because the prompt and the output filled the context window: its
    length is then a lower bound of what the model would have written. An output that reached the
    request's ``max_tokens`` is not counted as cut: benchmark clients send ``max_tokens`` = the wanted
    length with ``ignore_eos`` (vLLM's ``finish_reason`` reads ``length`` then too), and a predictor
    that took every such output as a lower bound would only ever learn upwards."""
    return context_tokens is not None and input_tokens + output_tokens >= context_tokens
