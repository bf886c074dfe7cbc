"""Prompt text rendered from simulated requests (hetroute/sim/prompt_text.py) against the emulator's
tokenizer (hetroute/sim/emulator_text.py) and the router's text chunking (hetroute/prefix/hashing.py)."""

from __future__ import annotations

import math
import re

import pytest

from hetroute.prefix.hashing import text_chunk_hashes
from hetroute.sim.emulator_text import count_chat_tokens, count_text_tokens, token_ids
from hetroute.sim.prefix_corpus import system_prompt_workload
from hetroute.sim.prefix_workloads import PREFIX_WORKLOAD_KINDS, chat_workload, generate_prefix_workload
from hetroute.sim.prompt_text import PromptRenderer, segment_text, unique_text
from hetroute.sim.workload import SimRequest


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_a_segment_is_four_characters_per_token_fixed_by_id_and_offset() -> None:
    text = segment_text(42, 300)
    assert len(text) == 1200 and re.fullmatch(r"( [a-z]{3})+", text)
    assert segment_text(42, 300) == text
    assert segment_text(42, 120) == text[:480]  # a shorter use of a segment is a prefix of a longer one
    other = segment_text(43, 300)
    assert sum(a != b for a, b in zip(token_ids(text), token_ids(other), strict=True)) > 290
    assert len(set(token_ids(text))) > 280  # varied tokens, not a repeated piece
    assert segment_text(7, 0) == ""
    with pytest.raises(ValueError, match="tokens"):
        segment_text(7, -1)


@pytest.mark.parametrize("kind", PREFIX_WORKLOAD_KINDS)
def test_the_emulator_counts_exactly_input_tokens(kind: str) -> None:
    renderer = PromptRenderer()
    for req in generate_prefix_workload(kind, 60, math.inf, seed=1):
        prompt = renderer.completion_prompt(req)
        assert count_text_tokens(prompt) == req.input_tokens == len(token_ids(prompt))


def test_chat_turns_share_token_ids_over_the_whole_previous_prompt() -> None:
    renderer = PromptRenderer()
    reqs = chat_workload(300, math.inf, seed=2)
    by_id = {r.request_id: r for r in reqs}
    checked = 0
    for r in reqs:
        nxt = by_id.get(f"{r.session}-t{int(r.request_id.rsplit('-t', 1)[1]) + 1}")
        if nxt is None:
            continue
        ids_a = token_ids(renderer.completion_prompt(r))
        ids_b = token_ids(renderer.completion_prompt(nxt))
        assert ids_b[: len(ids_a)] == ids_a
        checked += 1
    assert checked > 100


def test_shared_segments_share_tokens_and_router_chunks_then_diverge() -> None:
    renderer = PromptRenderer()
    reqs = system_prompt_workload(200, math.inf, seed=3)
    long_questions = [r for r in reqs if r.segments[1][1] >= 128]  # a full 256-char chunk past the prompt
    a = long_questions[0]
    b = next(r for r in long_questions[1:] if r.segments[0] == a.segments[0])
    c = next(r for r in reqs[1:] if r.segments[0] != a.segments[0])
    system_tokens = a.segments[0][1]
    text_a, text_b, text_c = (renderer.completion_prompt(r) for r in (a, b, c))
    ids_a, ids_b, ids_c = token_ids(text_a), token_ids(text_b), token_ids(text_c)
    assert ids_a[:system_tokens] == ids_b[:system_tokens]
    # The questions are different text: the shared run of tokens ends within a few tokens of them.
    assert system_tokens <= _common_prefix(ids_a, ids_b) < system_tokens + 3
    assert _common_prefix(ids_a, ids_c) < 3
    # The router's 256-character chunks: equal over the system prompt's full chunks, then not.
    shared_chunks = system_tokens * 4 // 256
    chunks_a, chunks_b = list(text_chunk_hashes(text_a)), list(text_chunk_hashes(text_b))
    assert min(len(chunks_a), len(chunks_b)) > shared_chunks
    assert _common_prefix(chunks_a, chunks_b) == shared_chunks


def test_requests_without_segments_get_text_of_their_own() -> None:
    renderer = PromptRenderer()
    a, b = SimRequest("a", 0.0, 50, 1), SimRequest("b", 0.0, 50, 1)
    text_a = renderer.completion_prompt(a)
    assert count_text_tokens(text_a) == 50 and text_a == unique_text("a", 50)
    assert text_a == PromptRenderer().completion_prompt(SimRequest("a", 9.0, 50, 7))  # fixed by the id
    assert _common_prefix(token_ids(text_a), token_ids(renderer.completion_prompt(b))) < 3
    assert text_a not in segment_text(0, 200)


def test_segments_must_sum_to_input_tokens() -> None:
    bad = SimRequest("x", 0.0, 10, 1, segments=((1, 4), (2, 5)))
    with pytest.raises(ValueError, match="9 tokens"):
        PromptRenderer().completion_prompt(bad)


def test_the_cache_is_bounded_and_changes_nothing() -> None:
    small = PromptRenderer(cache_chars=10_000)
    plain = PromptRenderer(cache_chars=0)
    for req in chat_workload(200, math.inf, seed=4):
        text = small.completion_prompt(req)
        assert text == plain.completion_prompt(req) == "".join(segment_text(s, n) for s, n in req.segments)
        assert small.cached_chars <= 10_000
    assert small.cached_chars > 0 and plain.cached_chars == 0
    # A longer use of a cached segment re-renders it; a shorter one is a slice of the cached text.
    renderer = PromptRenderer()
    assert renderer.segment_text(5, 10) == segment_text(5, 10)
    assert renderer.segment_text(5, 30) == segment_text(5, 30) and renderer.cached_chars == 120
    assert renderer.segment_text(5, 3) == segment_text(5, 3) and renderer.cached_chars == 120


def test_chat_messages_follow_the_turns() -> None:
    renderer = PromptRenderer()
    reqs = chat_workload(100, math.inf, seed=5)
    third = next(r for r in reqs if r.request_id.endswith("-t2"))
    messages = renderer.chat_messages(third)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "".join(m["content"] for m in messages) == renderer.completion_prompt(third)
    assert count_chat_tokens(messages) == third.input_tokens + 4 * len(messages) + 3
    assert renderer.chat_messages(SimRequest("u", 0.0, 8, 1)) == [
        {"role": "user", "content": unique_text("u", 8)}
    ]
    with pytest.raises(ValueError, match="alternating"):
        renderer.chat_messages(SimRequest("y", 0.0, 8, 1, segments=((1, 4), (2, 2), (3, 2))))
