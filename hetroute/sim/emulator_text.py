"""Deterministic stand-ins for a tokenizer and a sampler, used by the emulator.

Rules (documented for operators and tests; no real tokenizer is involved):
- **Text → tokens**: one token per 4 characters, rounded up, minimum 1
  (``count_text_tokens("hello world") == 3``). A prompt given as a list of token ids counts its length.
- **Chat → tokens**: Σ over messages of (tokens of its text content + 4 per message) + 3 for the
  assistant header that ``add_generation_prompt`` appends. Content given as OpenAI parts counts the
  ``text`` parts only.
- **Token ids** (``/tokenize``, and the prompt blocks the engine's prefix cache hashes): each 4-character
  piece of a text maps to ``crc32(piece) % 32000``, stable across runs. A chat prompt's ids are, per
  message, 4 role-header ids (``CHAT_HEADER_START``, ``crc32(role) % 32000``, ``CHAT_HEADER_END``,
  ``CHAT_TURN_END``: fixed for a role, ids ≥ 32000 play the template's special tokens) followed by its
  content's ids, then the 3 generation-prompt ids (the assistant header without its turn end); so
  ``len(chat_token_ids(m)) == count_chat_tokens(m)`` and the same messages always give the same ids.
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
CHAT_HEADER_START = VOCAB_SIZE
CHAT_HEADER_END = VOCAB_SIZE + 1
CHAT_TURN_END = VOCAB_SIZE + 2
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
    """Stable pseudo token ids for ``text``: one per 4-character piece (``[0]`` for an empty text)."""
    if not text:
        return [0]
    crc, step = zlib.crc32, CHARS_PER_TOKEN
    raw = text.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates
    if len(raw) == len(text):  # ASCII: a 4-character piece is 4 bytes, so slice the bytes once encoded
        return [crc(raw[i : i + step]) % VOCAB_SIZE for i in range(0, len(raw), step)]
    return [
        crc(text[i : i + step].encode("utf-8", "surrogatepass")) % VOCAB_SIZE
        for i in range(0, len(text), step)
    ]


def _role_header(role: str) -> tuple[int, ...]:
    """The CHAT_TOKENS_PER_MESSAGE (4) ids a message of ``role`` starts with."""
    role_id = zlib.crc32(role.encode("utf-8", "surrogatepass")) % VOCAB_SIZE
    return (CHAT_HEADER_START, role_id, CHAT_HEADER_END, CHAT_TURN_END)


def chat_token_ids(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of a chat prompt (see module docstring); as long as :func:`count_chat_tokens` says."""
    ids: list[int] = []
    for message in messages:
        ids.extend(_role_header(str(message.get("role", ""))))
        text = message_text(message.get("content"))
        if text:
            ids.extend(token_ids(text))
    ids.extend(_role_header("assistant")[:CHAT_GENERATION_PROMPT_TOKENS])
    return ids


def filler_prompt(tokens: int, tag: str) -> str:
    """A prompt of exactly ``tokens`` tokens that starts with ``tag``.

    Prompts with different tags (shorter than 63 characters) differ in their first 16-token block, so
    no prefix cache serves one from another: what a benchmark needs when its requests share no content.
    """
    chars = CHARS_PER_TOKEN * tokens
    return (f"{tag}|" + "x" * chars)[:chars]


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
