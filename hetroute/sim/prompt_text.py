"""Prompt text for simulated requests: a :class:`~hetroute.sim.workload.SimRequest` as the body text of a
``/v1/completions`` (or ``/v1/chat/completions``) request whose tokens carry the request's prefix sharing.

The emulator's tokenizer (``sim/emulator_text.py``) reads one token per 4 characters and names each
4-character piece by ``crc32(piece)``. Rendering rules, which make that tokenizer see exactly the
segments' structure:

- Segment ``(s, n)`` renders to ``4·n`` characters; piece ``j`` (characters ``4j..4j+3``) is a space and
  three lowercase letters fixed by ``(s, j)`` alone (a 64-bit mix of the two). So the text of
  ``(s, m)`` with ``m <= n`` is the first ``4·m`` characters of ``(s, n)``'s, and token ``j`` of a
  segment has the same id wherever the segment appears.
- A completion prompt is its segments' texts concatenated: ``4 · input_tokens`` characters, so
  ``count_text_tokens(prompt) == input_tokens``; every segment boundary falls on a 4-character boundary,
  so two prompts' token ids (and the router's 256-character chunks, ``prefix.hashing``) agree exactly
  where their segments agree from the start.
- A request without segments renders to text of its own: one segment keyed by a hash of its
  ``request_id`` (BLAKE2b, stable across processes) in a domain apart from segment ids.
- :meth:`PromptRenderer.chat_messages` renders a ``chat``-shaped request (``sim/prefix_workloads.py``:
  system prompt, then user and assistant turns, ending with the user's) as chat messages whose
  contents are the segment texts; the emulator counts ``input_tokens + 4·messages + 3`` tokens for them
  (its chat template, ``count_chat_tokens``).

Segment ids are taken modulo 2**64. :class:`PromptRenderer` caches rendered segment text (segments
repeat: system prompts, documents, histories) in an LRU bounded by a number of characters; the
module-level functions are pure and uncached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Final

import numpy as np

from hetroute.prefix.hashing import CHARS_PER_TOKEN
from hetroute.sim.workload import SimRequest

_MASK64: Final = (1 << 64) - 1
_SEGMENT_DOMAIN: Final = 0x5E6D_E27A_0000_0001
_UNIQUE_DOMAIN: Final = 0x0A1C_E5ED_0000_0002
_LETTERS: Final = 26
DEFAULT_CACHE_CHARS: Final = 32 * 1024 * 1024


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer over a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return np.asarray(x ^ (x >> np.uint64(31)))


def _render(key: int, domain: int, tokens: int) -> str:
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    base = _splitmix64(np.array([(key ^ domain) & _MASK64], dtype=np.uint64))
    h = _splitmix64(base + np.arange(tokens, dtype=np.uint64))
    pieces = np.empty((tokens, CHARS_PER_TOKEN), dtype=np.uint8)
    pieces[:, 0] = ord(" ")
    for col, shift in ((1, 0), (2, 21), (3, 42)):
        pieces[:, col] = ord("a") + (h >> np.uint64(shift)) % np.uint64(_LETTERS)
    return pieces.tobytes().decode("ascii")


def segment_text(segment_id: int, tokens: int) -> str:
    """The ``4·tokens`` characters of segment ``(segment_id, tokens)`` (see the module docstring)."""
    return _render(segment_id, _SEGMENT_DOMAIN, tokens)


def unique_text(request_id: str, tokens: int) -> str:
    """``4·tokens`` characters of text of the request's own, fixed by ``request_id``."""
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return _render(int.from_bytes(digest, "little"), _UNIQUE_DOMAIN, tokens)


def _check_tokens(request: SimRequest) -> None:
    total = sum(n for _, n in request.segments)
    if request.segments and total != request.input_tokens:
        raise ValueError(
            f"{request.request_id}: segments hold {total} tokens but input_tokens is {request.input_tokens}"
        )


class PromptRenderer:
    """Renders requests to prompt text, keeping recent segment text in an LRU of ``cache_chars``."""

    __slots__ = ("_cache", "_cache_chars", "_held_chars")

    def __init__(self, cache_chars: int = DEFAULT_CACHE_CHARS) -> None:
        if cache_chars < 0:
            raise ValueError(f"cache_chars must be >= 0, got {cache_chars}")
        self._cache: OrderedDict[int, str] = OrderedDict()
        self._cache_chars = cache_chars
        self._held_chars = 0

    @property
    def cached_chars(self) -> int:
        """Characters of segment text held now (never more than ``cache_chars``)."""
        return self._held_chars

    def segment_text(self, segment_id: int, tokens: int) -> str:
        """:func:`segment_text`, from the cache when a segment at least this long was rendered."""
        want = CHARS_PER_TOKEN * tokens
        held = self._cache.get(segment_id)
        if held is not None and len(held) >= want:
            self._cache.move_to_end(segment_id)
            return held[:want]
        text = segment_text(segment_id, tokens)
        if held is not None:
            del self._cache[segment_id]
            self._held_chars -= len(held)
        if len(text) <= self._cache_chars:
            self._cache[segment_id] = text
            self._held_chars += len(text)
            while self._held_chars > self._cache_chars:
                _, old = self._cache.popitem(last=False)
                self._held_chars -= len(old)
        return text

    def completion_prompt(self, request: SimRequest) -> str:
        """The ``prompt`` of a ``/v1/completions`` body: ``input_tokens`` tokens to the emulator.

        ValueError when the segments do not sum to ``input_tokens``.
        """
        _check_tokens(request)
        if not request.segments:
            return unique_text(request.request_id, request.input_tokens)
        return "".join(self.segment_text(s, n) for s, n in request.segments)

    def chat_messages(self, request: SimRequest) -> list[dict[str, str]]:
        """The ``messages`` of a ``/v1/chat/completions`` body for a chat-shaped request.

        Segment 0 is the system message; the others alternate user and assistant and the last is the
        user's (so their count is odd). A request without segments is one user message. ValueError
        for any other shape, or when the segments do not sum to ``input_tokens``.
        """
        _check_tokens(request)
        if not request.segments:
            return [{"role": "user", "content": unique_text(request.request_id, request.input_tokens)}]
        turns = len(request.segments) - 1
        if turns % 2 == 0:
            raise ValueError(
                f"{request.request_id}: {len(request.segments)} segments are not system + "
                "alternating user/assistant turns ending with the user's"
            )
        roles = ["system", *("user" if k % 2 == 0 else "assistant" for k in range(turns))]
        return [
            {"role": role, "content": self.segment_text(s, n)}
            for role, (s, n) in zip(roles, request.segments, strict=True)
        ]
