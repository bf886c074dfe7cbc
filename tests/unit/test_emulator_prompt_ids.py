"""The emulator's prompt token ids: deterministic, as many as the counted prompt tokens, and the block
hashes its prefix cache is keyed by."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from hetroute.prefix.hashing import token_block_hashes
from hetroute.sim.emulator_protocol import parse_openai, parse_tgi
from hetroute.sim.emulator_text import (
    CHAT_HEADER_START,
    VOCAB_SIZE,
    chat_token_ids,
    count_chat_tokens,
    count_text_tokens,
    filler_prompt,
    token_ids,
)

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "why?"}],
    [{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image_url"}]}],
    [{"role": "assistant", "content": None}, {"content": "no role"}, {"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_are_as_many_as_the_counted_tokens_and_stable(messages: list[dict[str, Any]]) -> None:
    ids = chat_token_ids(messages)
    assert len(ids) == count_chat_tokens(messages)
    assert ids == chat_token_ids([dict(m) for m in messages])
    assert ids[0] == CHAT_HEADER_START  # every message opens with its role header


def test_role_headers_differ_by_role_and_content_follows_them() -> None:
    user = chat_token_ids([{"role": "user", "content": "same text"}])
    system = chat_token_ids([{"role": "system", "content": "same text"}])
    assert user[1] != system[1] and user[2:] == system[2:]
    assert user[4:7] == token_ids("same text")


@pytest.mark.parametrize("text", ["abcdefgh", "héllo wörld ça va", "x" * 1001, "\ud800abc", ""])
def test_text_ids_follow_the_documented_rule(text: str) -> None:
    want = [
        zlib.crc32(text[i : i + 4].encode("utf-8", "surrogatepass")) % VOCAB_SIZE
        for i in range(0, len(text), 4)
    ] or [0]
    assert token_ids(text) == want and len(want) == count_text_tokens(text)


def test_requests_carry_their_prompt_ids_and_block_hashes() -> None:
    ids = list(range(100, 140))
    for prompt in (ids, [ids]):
        req = parse_openai({"prompt": prompt}, "completions", "m", "vllm")
        assert list(req.prompt_token_ids()) == ids and req.prompt_tokens == 40
        assert req.block_hashes(16) == token_block_hashes(ids, 16) and len(req.block_hashes(16)) == 2
    text = "a long shared instruction, " * 10
    first = parse_openai({"prompt": text}, "completions", "m", "vllm")
    again = parse_openai({"prompt": [text]}, "completions", "m", "vllm")
    assert first.block_hashes(16) == again.block_hashes(16) == token_block_hashes(token_ids(text), 16)
    other = parse_openai({"prompt": "A" + text[1:]}, "completions", "m", "vllm")
    assert not set(other.block_hashes(16)) & set(first.block_hashes(16))  # chained: one change, all differ
    chat = parse_openai({"messages": CHATS[1]}, "chat", "m", "vllm")
    assert list(chat.prompt_token_ids()) == chat_token_ids(CHATS[1])
    tgi = parse_tgi({"inputs": text}, stream=False)
    assert tgi.block_hashes(16) == first.block_hashes(16)


def test_filler_prompts_have_the_exact_length_and_share_no_block() -> None:
    for tokens in (1, 15, 16, 17, 1000):
        assert count_text_tokens(filler_prompt(tokens, "r12")) == tokens
    a, b = (token_block_hashes(token_ids(filler_prompt(500, tag)), 16) for tag in ("r1", "r2"))
    assert len(a) == 31 and not set(a) & set(b)
