"""Chained hashes over fixed-size blocks of a prompt: the identity of a cached prefix.

vLLM's automatic prefix caching names every *full* KV block by a hash of its tokens chained with the
hash of the block before it, so two prompts share a cached block exactly when they share every token
up to the end of that block. The same construction serves three callers here:

- the engine model (``sim/engine_model.py``) over the emulator's token ids or the simulator's prompt
  segments, in blocks of the engine's ``block_size`` tokens;
- the router's prefix index in the simulator, over the same segments in chunks of
  :data:`ROUTER_CHUNK_TOKENS` tokens;
- the router's prefix index in the gateway, over the request's prompt text in chunks of
  :data:`ROUTER_CHUNK_CHARS` characters (no tokenizer), which is the same chunking as the simulator's
  for text of 4 characters per token (the emulator's tokenizer, ``sim/emulator_text.py``).

Only full blocks are hashed (a partial last block is never cached, as in vLLM). Hashes are Python's
``hash`` of a tuple ``(parent, content)`` of integers, which is the same in every process (``str``
hashes are salted per process, so text enters as the CRC-32 of its UTF-8 bytes): gateway workers,
router replicas and restarts name the same prompt head alike, which ``session_hash``'s ring needs.
``ROOT_HASH`` is the parent of the first block.

A *segment* is ``(segment_id, tokens)``: ``tokens`` consecutive prompt tokens whose content is fixed by
``segment_id`` (token ``j`` of segment ``s`` is "token (s, j)"). A simulated prompt is a tuple of
segments; two prompts share the tokens of every segment they share at the same offset.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Final

ROOT_HASH: Final = 0x5EED
ROUTER_CHUNK_TOKENS: Final = 64
"""Tokens per chunk of the router's prefix index in the simulator (= 4 vLLM blocks of 16)."""
CHARS_PER_TOKEN: Final = 4
ROUTER_CHUNK_CHARS: Final = ROUTER_CHUNK_TOKENS * CHARS_PER_TOKEN
"""Characters per chunk of the router's prefix index in the gateway (256)."""

Segment = tuple[int, int]
"""``(segment_id, tokens)``: a run of prompt tokens whose content is named by ``segment_id``."""


def token_block_hashes(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of every full block of ``block_tokens`` token ids (len = len(ids) // block)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be ≥ 1, got {block_tokens}")
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash((parent, tuple(token_ids[start : start + block_tokens])))
        out.append(parent)
    return tuple(out)


def segment_block_hashes(segments: Sequence[Segment], block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of every full block of ``block_tokens`` tokens of a segmented prompt.

    A block's content is the tuple of ``(segment_id, start, end)`` pieces it covers, so the result
    depends only on the token sequence the segments describe: consecutive pieces of one segment are
    merged, so block boundaries never change a block's identity.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be ≥ 1, got {block_tokens}")
    out: list[int] = []
    parent = ROOT_HASH
    pieces: list[tuple[int, int, int]] = []
    filled = 0
    for seg_id, tokens in segments:
        offset = 0
        while offset < tokens:
            take = min(tokens - offset, block_tokens - filled)
            if pieces and pieces[-1][0] == seg_id and pieces[-1][2] == offset:
                pieces[-1] = (seg_id, pieces[-1][1], offset + take)  # one piece per contiguous run
            else:
                pieces.append((seg_id, offset, offset + take))
            offset += take
            filled += take
            if filled == block_tokens:
                parent = hash((parent, tuple(pieces)))
                out.append(parent)
                pieces = []
                filled = 0
    return tuple(out)


def text_chunk_hashes(text: str, chunk_chars: int = ROUTER_CHUNK_CHARS) -> tuple[int, ...]:
    """Chained hashes of every full ``chunk_chars``-character chunk of ``text`` (no tokenizer).

    Stable across processes: a chunk enters as the CRC-32 of its UTF-8 bytes (lone surrogates, which
    JSON can carry, are encoded as they stand), chained with its parent through ``hash`` of integers.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be ≥ 1, got {chunk_chars}")
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        chunk = text[start : start + chunk_chars].encode("utf-8", "surrogatepass")
        parent = hash((parent, zlib.crc32(chunk)))
        out.append(parent)
    return tuple(out)
