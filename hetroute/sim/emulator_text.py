"""Deterministic stand-ins for a tokenizer and a sampler, used by the emulator.

Rules (documented for operators and tests; no real tokenizer is involved):
- **Text → tokens**: one token per 4 characters, rounded up, minimum 1
  (``count_text_tokens("hello world") == 3``). A prompt given as a list of token ids counts its length.
- **Chat → tokens**: Σ over messages of (tokens of its text content + 4 per message) + 3 for the
  assistant header that ``add_generation_prompt`` appends. Content given as OpenAI parts counts the
  ``text`` parts only.
- **Token ids** (``/tokenize``): each 4-character piece maps to ``crc32(piece) % 32000``; stable across runs.
- **Output text**: token k of a request is a word drawn from a fixed vocabulary by a seeded RNG, each
  with a leading space, so the text has exactly one "word" per emitted token.
- **Output length**: ``ignore_eos`` (or ``min_tokens ≥ max_tokens``) forces exactly ``max_tokens``;
  otherwise a seeded ShareGPT-like draw (log-normal, median 150 tokens, σ = 0.9; mean ≈ 225) raised to
  ``min_tokens`` and capped at ``max_tokens``. The finish reason is ``length`` when capped, else ``stop``.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_GENERATION_PROMPT_TOKENS = 3
VOCAB_SIZE = 32000
OUTPUT_MEDIAN_TOKENS = 150.0
OUTPUT_SIGMA = 0.9

_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "can",
    "been",
    "has",
    "more",
    "if",
    "will",
    "would",
    "so",
    "when",
    "what",
    "who",
    "up",
    "out",
    "about",
    "into",
    "time",
    "only",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
)


def count_text_tokens(text: str) -> int:
    """Tokens of a text: ceil(chars / 4), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string or a list of parts); '' when absent."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def count_chat_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """Tokens of a chat prompt (see module docstring)."""
    total = CHAT_GENERATION_PROMPT_TOKENS
    for message in messages:
        text = message_text(message.get("content"))
        total += (count_text_tokens(text) if text else 0) + CHAT_TOKENS_PER_MESSAGE
    return total


def token_ids(text: str) -> list[int]:
    """Stable pseudo token ids for ``text``: one per 4-character piece."""
    if not text:
        return [0]
    return [
        zlib.crc32(text[i : i + CHARS_PER_TOKEN].encode("utf-8")) % VOCAB_SIZE
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def pseudo_token_ids(text: str, count: int) -> list[int]:
    """``count`` stable ids for a prompt whose text is ``text`` (the ids repeat cyclically)."""
    base = token_ids(text)
    return [base[i % len(base)] for i in range(count)]


def draw_output_tokens(
    rng: random.Random, max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False
) -> int:
    """Output length of one request (see module docstring); always in [1, max_tokens]."""
    if ignore_eos or min_tokens >= max_tokens:
        return max_tokens
    draw = int(round(rng.lognormvariate(math.log(OUTPUT_MEDIAN_TOKENS), OUTPUT_SIGMA)))
    return max(1, min(max_tokens, max(min_tokens, draw)))


class TextSource:
    """Seeded output words and token ids for one request."""

    __slots__ = ("_rng",)

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def next_token(self) -> tuple[int, str]:
        """(token id, text with a leading space) of the next output token."""
        index = self._rng.randrange(len(_WORDS))
        return 1000 + index, " " + _WORDS[index]
