"""Workloads with shared prompt prefixes (hetroute/sim/prefix_workloads.py, prefix_corpus.py,
mooncake_trace.py) and their `hetroute simulate` wiring."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from hetroute.commands import simulate as simulate_cmd
from hetroute.errors import ConfigError
from hetroute.prefix.hashing import segment_block_hashes
from hetroute.sim.mooncake_trace import load_mooncake_trace, mooncake_segments
from hetroute.sim.prefix_corpus import RagParams, rag_workload, system_prompt_workload
from hetroute.sim.prefix_segments import FAMILY_BASE, prefix_reuse_fraction
from hetroute.sim.prefix_workloads import (
    PREFIX_WORKLOAD_KINDS,
    ChatParams,
    chat_workload,
    generate_prefix_workload,
    no_sharing_workload,
)
from hetroute.sim.workload import SimRequest

BLOCK = 16


def _blocks(req: SimRequest) -> tuple[int, ...]:
    return segment_block_hashes(req.segments, BLOCK)


def _content(reqs: list[SimRequest]) -> dict[str, tuple[object, ...]]:
    return {r.request_id: (r.segments, r.input_tokens, r.output_tokens, r.session) for r in reqs}


@pytest.mark.parametrize("kind", PREFIX_WORKLOAD_KINDS)
def test_same_seed_same_workload_other_seed_differs(kind: str) -> None:
    a = generate_prefix_workload(kind, 300, 4.0, seed=5)
    assert a == generate_prefix_workload(kind, 300, 4.0, seed=5)
    assert [r.segments for r in a] != [r.segments for r in generate_prefix_workload(kind, 300, 4.0, seed=6)]


@pytest.mark.parametrize("kind", PREFIX_WORKLOAD_KINDS)
@pytest.mark.parametrize("max_model_len", [8192, 1200])
def test_invariants_and_same_content_at_every_rate(kind: str, max_model_len: int) -> None:
    runs = {rate: generate_prefix_workload(kind, 400, rate, 1, max_model_len) for rate in (math.inf, 3.0)}
    for rate, reqs in runs.items():
        assert len(reqs) == 400 and len({r.request_id for r in reqs}) == 400
        arrivals = [r.arrival_s for r in reqs]
        assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
        assert (max(arrivals) == 0.0) == math.isinf(rate)
        for r in reqs:
            assert r.segments and all(n >= 1 for _, n in r.segments)
            assert sum(n for _, n in r.segments) == r.input_tokens
            assert r.output_tokens >= 1 and r.input_tokens + r.output_tokens <= max_model_len
            base = FAMILY_BASE[kind]
            assert all(base <= s < base + (1 << 40) for s, _ in r.segments)
    assert _content(runs[math.inf]) == _content(runs[3.0])


def test_a_finite_rate_is_the_long_run_request_rate() -> None:
    reqs = chat_workload(4000, 10.0, seed=0)
    # Sessions start over ~n/rate seconds; the last sessions' later turns trail a little after.
    span_s = reqs[-1].arrival_s
    assert 400 < span_s < 400 * 1.25
    assert 9.0 < 3000 / reqs[3000].arrival_s < 11.0


def _sessions(reqs: list[SimRequest]) -> dict[str, list[SimRequest]]:
    out: dict[str, list[SimRequest]] = defaultdict(list)
    for r in reqs:
        out[r.session].append(r)
    return out


@pytest.mark.parametrize("rate", [math.inf, 2.0])
def test_chat_turns_resend_the_history_in_order(rate: float) -> None:
    reqs = chat_workload(600, rate, seed=2)
    sessions = _sessions(reqs)
    assert "" not in sessions and 1 < len(sessions) < 600
    assert max(len(turns) for turns in sessions.values()) >= 4
    for name, turns in sessions.items():
        assert [r.request_id for r in turns] == [f"{name}-t{k}" for k in range(len(turns))]
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.arrival_s >= prev.arrival_s
            k = len(prev.segments)
            # The next prompt is this prompt + this turn's answer (its true length) + a new message.
            assert nxt.segments[:k] == prev.segments
            assert nxt.segments[k][1] == prev.output_tokens and len(nxt.segments) == k + 2
            assert _blocks(nxt)[: len(_blocks(prev))] == _blocks(prev)
            assert len(_blocks(prev)) == prev.input_tokens // BLOCK
    if math.isinf(rate):  # turn-major issue order: every turn 0 before any turn 1, and so on
        turn_index = [int(r.request_id.rsplit("-t", 1)[1]) for r in reqs]
        assert turn_index == sorted(turn_index)
    # Sessions share their system prompt (a pool of 4), and nothing after it.
    firsts = Counter(turns[0].segments[0][0] for turns in sessions.values())
    assert len(firsts) == 4


def test_chat_sessions_end_at_max_model_len() -> None:
    long = chat_workload(1500, math.inf, seed=3, max_model_len=32768)
    capped = chat_workload(1500, math.inf, seed=3, max_model_len=3000)
    assert max(r.input_tokens + r.output_tokens for r in long) > 3000
    assert max(r.input_tokens + r.output_tokens for r in capped) <= 3000
    assert len(_sessions(capped)) > len(_sessions(long))  # sessions ended early, so more of them
    # The cap ends sessions; it never cuts a later turn (only a first turn is clipped to fit).
    for turns in _sessions(capped).values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.segments[: len(prev.segments)] == prev.segments


def test_chat_parameters_are_used_and_checked() -> None:
    one_turn = chat_workload(200, math.inf, seed=0, params=ChatParams(mean_turns=1.0))
    assert len(_sessions(one_turn)) == 200
    slow = chat_workload(400, 1.0, seed=0, params=ChatParams(think_time_s=60.0))
    fast = chat_workload(400, 1.0, seed=0, params=ChatParams(think_time_s=1.0))
    assert slow[-1].arrival_s > fast[-1].arrival_s
    with pytest.raises(ConfigError, match="think_time_s"):
        ChatParams(think_time_s=0.0)
    with pytest.raises(ConfigError, match="system_prompt_tokens"):
        ChatParams(system_prompt_tokens=(900, 100))


def test_system_prompts_share_their_blocks_and_nothing_else() -> None:
    reqs = system_prompt_workload(1000, math.inf, seed=4)
    by_prompt: dict[int, list[SimRequest]] = defaultdict(list)
    for r in reqs:
        assert len(r.segments) == 2 and r.session == ""
        by_prompt[r.segments[0][0]].append(r)
    assert 1 < len(by_prompt) <= 6
    counts = sorted((len(v) for v in by_prompt.values()), reverse=True)
    assert counts[0] > 2 * counts[-1]  # Zipf popularity
    for seg_id, group in by_prompt.items():
        shared = group[0].segments[0][1] // BLOCK
        heads = {_blocks(r)[:shared] for r in group}
        assert len(heads) == 1  # every user of one prompt shares all its full blocks
        for other_id, others in by_prompt.items():
            if other_id != seg_id:
                assert not set(_blocks(group[0])) & set(_blocks(others[0]))
    full_blocks = [_blocks(r) for r in reqs]
    beyond = [b[r.segments[0][1] // BLOCK + 1 :] for b, r in zip(full_blocks, reqs, strict=True)]
    assert len({h for tail in beyond for h in tail}) == sum(len(t) for t in beyond)  # questions unique


def test_rag_retrieves_popular_documents_after_shared_instructions() -> None:
    reqs = rag_workload(800, math.inf, seed=5)
    first_docs = Counter(r.segments[1][0] for r in reqs)
    assert all(r.segments[0] == (FAMILY_BASE["rag"], 200) for r in reqs)
    assert first_docs.most_common(1)[0][1] > 800 / 100 * 5  # Zipf: far above a uniform share
    for r in reqs:
        docs = [s for s, _ in r.segments[1:-1]]
        assert len(docs) == len(set(docs)) and 1 <= len(docs) <= 3
    three = [r for r in reqs if len(r.segments) == 5]
    a, b = next(
        (x, y)
        for x in three
        for y in three
        if x is not y and x.segments[:2] == y.segments[:2] and x.segments[2] != y.segments[2]
    )
    shared_tokens = 200 + a.segments[1][1]
    assert _blocks(a)[: shared_tokens // BLOCK] == _blocks(b)[: shared_tokens // BLOCK]
    assert _blocks(a)[shared_tokens // BLOCK + 1] != _blocks(b)[shared_tokens // BLOCK + 1]


def test_rag_drops_the_last_documents_to_fit() -> None:
    params = RagParams(documents=10, document_tokens=(1000, 1000), docs_per_request=3)
    reqs = rag_workload(200, math.inf, seed=0, max_model_len=2600, params=params)
    kept: Counter[int] = Counter()
    for r in reqs:
        docs = len(r.segments) - 2  # after the instructions, before the question
        rest = 200 + r.segments[-1][1] + r.output_tokens
        assert rest + 1000 * docs <= 2600 < rest + 1000 * (docs + 1)  # as many as fit, no more
        kept[docs] += 1
    assert {1, 2} <= set(kept) and 3 not in kept


def test_no_sharing_is_chat_with_nothing_shared() -> None:
    chat = chat_workload(500, 2.0, seed=7)
    control = no_sharing_workload(500, 2.0, seed=7)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in control] == [
        (r.arrival_s, r.input_tokens, r.output_tokens) for r in chat
    ]
    assert all(r.session == "" and len(r.segments) == 1 for r in control)
    assert prefix_reuse_fraction(control) == 0.0
    assert prefix_reuse_fraction(chat) > 0.6


def test_reuse_fraction_counts_tokens_in_blocks_seen_before() -> None:
    a = SimRequest("a", 0.0, 40, 1, segments=((1, 40),))
    b = SimRequest("b", 0.0, 40, 1, segments=((1, 20), (2, 20)))
    # b repeats a's first block (16 of its 40 tokens); a and b's 80 tokens hold 16 reused ones.
    assert prefix_reuse_fraction([a, b]) == pytest.approx(16 / 80)
    assert prefix_reuse_fraction([a, a]) == pytest.approx(32 / 80)
    assert prefix_reuse_fraction([]) == 0.0


def _write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    keys = ("timestamp", "input_length", "output_length", "hash_ids")
    lines = [json.dumps(dict(zip(keys, row, strict=True))) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


TRACE_ROWS = [
    (1000, 1500, 30, [0, 1, 2]),
    (1000, 2000, 40, [0, 1, 3, 4]),
    (2500, 700, 50, [0, 5]),
    (4000, 1024, 0, [0, 1]),
]


def test_mooncake_blocks_become_segments() -> None:
    base = FAMILY_BASE["mooncake"]
    assert mooncake_segments([7, 8, 9], 1500) == ((base + 7, 512), (base + 8, 512), (base + 9, 476))
    assert mooncake_segments([7, 8], 1024) == ((base + 7, 512), (base + 8, 512))
    with pytest.raises(ValueError, match="need 2 hash_ids"):
        mooncake_segments([7, 8, 9], 1000)


def test_mooncake_replay_shares_exactly_the_trace_blocks(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", TRACE_ROWS)
    reqs = load_mooncake_trace(trace)
    assert [r.arrival_s for r in reqs] == [0.0, 0.0, 1.5, 3.0]
    assert [r.input_tokens for r in reqs] == [1500, 2000, 700, 1024]
    assert [r.output_tokens for r in reqs] == [30, 40, 50, 1]
    per_block = 512 // BLOCK
    blocks = [_blocks(r) for r in reqs]
    for x in range(4):
        for y in range(x + 1, 4):
            ids_x, ids_y = TRACE_ROWS[x][3], TRACE_ROWS[y][3]
            lead = next((k for k, (p, q) in enumerate(zip(ids_x, ids_y, strict=False)) if p != q), None)
            lead = min(len(ids_x), len(ids_y)) if lead is None else lead
            common = next(
                (k for k, (p, q) in enumerate(zip(blocks[x], blocks[y], strict=False)) if p != q),
                min(len(blocks[x]), len(blocks[y])),
            )
            assert common == lead * per_block, (x, y)


def test_mooncake_cap_retiming_and_errors(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", TRACE_ROWS)
    first = load_mooncake_trace(trace, n=2, rate=math.inf)
    assert [r.request_id for r in first] == ["r0", "r1"] and {r.arrival_s for r in first} == {0.0}
    retimed = load_mooncake_trace(trace, rate=2.0, seed=1)
    assert retimed == load_mooncake_trace(trace, rate=2.0, seed=1)
    assert [r.segments for r in retimed] == [r.segments for r in load_mooncake_trace(trace)]
    capped = load_mooncake_trace(trace, max_model_len=1100)
    full = load_mooncake_trace(trace)
    for c, f in zip(capped, full, strict=True):
        assert c.input_tokens + c.output_tokens <= 1100
        assert _blocks(c) == _blocks(f)[: len(_blocks(c))]  # cut at the end: a prefix of the trace's
    bad = _write_trace(tmp_path / "bad.jsonl", [(0, 100, 5, [0]), (0, 600, 5, [0])])
    with pytest.raises(ConfigError) as err:
        load_mooncake_trace(bad)
    assert err.value.path.endswith("bad.jsonl:2")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    code: int = args.func(args)
    return code


def test_cli_runs_the_chat_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "chat.json"
    argv = ["--scenario", "paper-a", "--workload", "chat", "--requests", "200", "--rates", "8"]
    assert _cli([*argv, "--json", str(out_json)]) == 0
    assert "workload chat: 200 requests" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["workload"]["kind"] == "chat" and doc["workload"]["requests"] == 200
    assert all(run["completed"] == 200 for run in doc["runs"])


def test_cli_replays_a_mooncake_trace_and_checks_its_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", TRACE_ROWS)
    out_json = tmp_path / "m.json"
    argv = ["--scenario", "paper-a", "--policies", "round_robin", "--json", str(out_json)]
    assert _cli([*argv, "--workload", "mooncake", "--trace", str(trace)]) == 0
    doc = json.loads(out_json.read_text())
    assert [r["rate"] for r in doc["runs"]] == ["trace"] and doc["runs"][0]["completed"] == 4
    capsys.readouterr()
    assert _cli([*argv, "--workload", "mooncake"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert _cli([*argv, "--workload", "chat", "--trace", str(trace)]) == 2
    assert _cli([*argv, "--workload", "chat", "--rates", "trace"]) == 2
    assert _cli([*argv, "--workload", "nope"]) == 2
    assert "mooncake" in capsys.readouterr().err
