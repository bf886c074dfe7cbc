"""Seeded workloads whose prompts share real prefixes: multi-turn chat, shared system prompts, RAG, and
the no-sharing control; :func:`generate_prefix_workload` builds any of them by name.

``chat`` and ``no-sharing`` live here; ``system-prompts`` and ``rag`` in ``sim/prefix_corpus.py``; the
Mooncake trace replay (``mooncake``), which keeps the trace's own block sharing, in
``sim/mooncake_trace.py``; segment-id families, length draws and the ideal-reuse measurement
(:func:`~hetroute.sim.prefix_segments.prefix_reuse_fraction`) in ``sim/prefix_segments.py``.

Every generator is a pure function of ``(n, rate, seed, max_model_len, params)`` and returns ``n``
:class:`~hetroute.sim.workload.SimRequest` sorted by ``arrival_s`` whose ``segments`` name the prompt's
content (``hetroute.prefix.hashing``: two prompts share cached KV blocks exactly where their segment
sequences agree from the start). Invariants:

- Every request has ≥ 1 segment, every segment ≥ 1 token, ``Σ tokens == input_tokens`` and
  ``input_tokens + output_tokens <= max_model_len``.
- Content (segments, lengths) comes from one stream of ``SeedSequence(seed)`` and timing from another,
  so one seed gives the same requests at every rate; only ``arrival_s`` changes. Rate ``inf`` puts
  every arrival at t = 0 and the list order is the order of issue; a finite rate draws Poisson gaps
  (gamma with ``arrival_cv != 1``), as ``sim/workload.py`` does.
- Segment ids are ``FAMILY_BASE[family] + local id``; bases are 2**40 apart, so two families never
  share an id. A segment id always names the same content: where a cap shortens a segment, the shorter
  one is a prefix of the longer (token j of segment s is the same token wherever it appears).
- ``session`` names the conversation for ``chat`` and is ``""`` for single-shot families.

Families, their parameters (defaults) and the source of each figure:

``chat`` (:class:`ChatParams`): sessions (users) of several turns. Turn k's
prompt = the session's system prompt + every earlier user message and answer + the new user message
(the history is re-sent; each answer is a segment of that turn's true output length). Sessions start
as a Poisson process at ``rate · sessions / n`` and a session's next turn arrives an exponential think
time (mean ``think_time_s`` = 8 s) after the previous one, so the long-run request rate is ``rate``
(the later turns of the last sessions trail after the others: a ramp-down of about a session's length);
at rate ``inf`` the turns are issued turn-major (every session's turn 0, then every turn 1, ...).
A session ends early when its next turn would not fit in ``max_model_len`` (default 8192).

- turns per session: geometric, mean 3.51 = ShareGPT's 330,239 turns over 94,145 conversations
  (ShareChat, arXiv:2512.17843, Table 1);
- user message: the ShareGPT first human turn as vLLM's serving benchmark samples it: log-normal,
  median 125 tokens, σ 1.15, clipped to 4..1024 (docs/calibration.md, "Workloads");
- answer: the ShareGPT reply length, normal mean 200, sd 125, ≥ 4 (docs/calibration.md);
- system prompt: one of a pool of 4, each uniform in 500..1500 tokens (an assumption: no public
  measurement; vLLM production-stack's multi-round QA benchmark uses a 1000-token shared system prompt);
- think time: exponential, mean 8 s (an assumption; it counts from the previous turn's *arrival*, since
  a workload cannot know the answer's latency).

``system-prompts`` (:class:`~hetroute.sim.prefix_corpus.SystemPromptParams`): a few long system
prompts shared by many users; each request = one of them + a unique question. 6 prompts, each uniform in
1000..2000 tokens, chosen with Zipf popularity (p_i ∝ (i+1)^-1); question and answer lengths as
``chat``'s user message and answer. The prompt count, lengths and Zipf exponent are assumptions (no
public measurement).

``rag`` (:class:`~hetroute.sim.prefix_corpus.RagParams`): a corpus of 100 documents, each uniform in
500..3000 tokens, with Zipf popularity (s = 1); a request = shared instructions (200 tokens) + 3
documents drawn without replacement by popularity, in retrieval order + a unique question; question and
answer as ``chat``. When the prompt would not fit in ``max_model_len`` the last retrieved documents are
dropped. All figures are assumptions (typical retrieval-augmented prompts), not calibrated.

``no-sharing``: the control where prefix routing cannot help: exactly ``chat``'s requests for the same
arguments (input and output lengths, arrival times) with every prompt one unique segment and no session.

``mooncake`` (:func:`~hetroute.sim.mooncake_trace.load_mooncake_trace`): a Mooncake trace file (path
given by the user, never bundled) whose rows' 512-token ``hash_ids`` become segments, so the replay
shares exactly the blocks the trace shares; rate ``trace`` keeps its timestamps. The conversation
trace: 12,031 requests, input mean 12,035 (p50 6,909), 36.6 % of blocks repeated (docs/calibration.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import numpy as np

from hetroute.errors import ConfigError
from hetroute.prefix.hashing import Segment
from hetroute.sim.prefix_corpus import rag_workload, system_prompt_workload
from hetroute.sim.prefix_segments import (
    DEFAULT_MAX_MODEL_LEN,
    FAMILY_BASE,
    answer_tokens,
    check,
    check_common,
    check_token_range,
    content_and_timing_streams,
    fit_to_model_len,
    make_request,
    prompt_tokens,
    user_tokens,
)
from hetroute.sim.workload import SimRequest, arrival_times

PrefixWorkloadKind = Literal["chat", "system-prompts", "rag", "no-sharing"]
PREFIX_WORKLOAD_KINDS: Final[tuple[PrefixWorkloadKind, ...]] = ("chat", "system-prompts", "rag", "no-sharing")
MOONCAKE_KIND: Final = "mooncake"
"""The trace-replay family: ``sim/mooncake_trace.py`` (it needs the trace file)."""

SHAREGPT_MEAN_TURNS: Final = 3.51
"""ShareGPT: 330,239 turns over 94,145 conversations (ShareChat, arXiv:2512.17843, Table 1)."""


@dataclass(frozen=True, slots=True)
class ChatParams:
    """``chat``: a pool of ``system_prompts`` prompts of ``system_prompt_tokens`` (uniform, inclusive);
    geometric turns per session with mean ``mean_turns``; exponential think time, mean ``think_time_s``."""

    system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (500, 1500)
    mean_turns: float = SHAREGPT_MEAN_TURNS
    think_time_s: float = 8.0

    def __post_init__(self) -> None:
        check(self.system_prompts >= 1, "chat.system_prompts", f"must be >= 1, got {self.system_prompts}")
        check_token_range("chat.system_prompt_tokens", self.system_prompt_tokens)
        check(self.mean_turns >= 1, "chat.mean_turns", f"must be >= 1, got {self.mean_turns}")
        check(self.think_time_s > 0, "chat.think_time_s", f"must be > 0, got {self.think_time_s}")


@dataclass(frozen=True, slots=True)
class _Turn:
    index: int  # in generation order (session by session): stable across rates
    session: int
    turn: int
    segments: tuple[Segment, ...]
    output_tokens: int


def _chat_sessions(
    rng: np.random.Generator, n: int, max_model_len: int, params: ChatParams
) -> list[list[_Turn]]:
    """Sessions in order, ``n`` turns in all (the last session cut short to make the count).

    Segment ids: local 0..system_prompts-1 are the pool; each turn then takes two fresh ids, its user
    message and its answer. Turn 0 is clipped to fit; a later turn that would not fit ends the session.
    """
    base = FAMILY_BASE["chat"]
    lo, hi = params.system_prompt_tokens
    system_lengths = rng.integers(lo, hi + 1, size=params.system_prompts)
    next_id = base + params.system_prompts
    sessions: list[list[_Turn]] = []
    total = 0
    while total < n:
        pick = int(rng.integers(params.system_prompts))
        wanted = min(int(rng.geometric(1.0 / params.mean_turns)), n - total)
        users, answers = user_tokens(rng, wanted), answer_tokens(rng, wanted)
        history: tuple[Segment, ...] = ((base + pick, int(system_lengths[pick])),)
        turns: list[_Turn] = []
        for k in range(wanted):
            prompt: tuple[Segment, ...] = (*history, (next_id, int(users[k])))
            answer = int(answers[k])
            if k == 0:
                prompt, answer = fit_to_model_len(prompt, answer, max_model_len)
            elif prompt_tokens(prompt) + answer > max_model_len:
                break
            turns.append(_Turn(total + k, len(sessions), k, prompt, answer))
            history = (*prompt, (next_id + 1, answer))
            next_id += 2
        sessions.append(turns)
        total += len(turns)
    return sessions


def _chat_arrivals(
    sessions: list[list[_Turn]],
    rate: float,
    timing: np.random.Generator,
    arrival_cv: float,
    think_time_s: float,
) -> list[list[float]]:
    """Arrival of every turn: session starts at ``rate · sessions / turns``, then think-time gaps."""
    if math.isinf(rate):
        return [[0.0] * len(turns) for turns in sessions]
    n = sum(len(turns) for turns in sessions)
    starts = arrival_times(len(sessions), rate * len(sessions) / n, timing, arrival_cv=arrival_cv)
    out: list[list[float]] = []
    for start, turns in zip(starts.tolist(), sessions, strict=True):
        gaps = timing.exponential(think_time_s, len(turns) - 1)
        out.append([start, *(start + np.cumsum(gaps)).tolist()])
    return out


def _timed_turns(
    n: int, rate: float, seed: int, max_model_len: int, params: ChatParams, arrival_cv: float
) -> list[tuple[float, _Turn]]:
    """Every turn with its arrival, sorted by (arrival, turn index, session index)."""
    check_common(n, max_model_len)
    rng, timing = content_and_timing_streams(seed)
    sessions = _chat_sessions(rng, n, max_model_len, params)
    times = _chat_arrivals(sessions, rate, timing, arrival_cv, params.think_time_s)
    timed = [
        (t, turn)
        for turns, stamps in zip(sessions, times, strict=True)
        for turn, t in zip(turns, stamps, strict=True)
    ]
    timed.sort(key=lambda item: (item[0], item[1].turn, item[1].session))
    return timed


def chat_workload(
    n: int,
    rate: float,
    seed: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    *,
    params: ChatParams = ChatParams(),
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """``n`` turns of multi-turn chat sessions (see the module docstring), sorted by arrival.

    Session ``i`` is ``s{i}`` and its turn ``k`` is request ``s{i}-t{k}``; turn ``k+1``'s prompt starts
    with turn ``k``'s whole prompt and arrives after it. Ties in time (rate ``inf``) are broken by turn
    index, then session index. ``arrival_cv`` shapes the gaps between session starts.
    """
    return [
        make_request(
            f"s{turn.session}-t{turn.turn}",
            t,
            turn.segments,
            turn.output_tokens,
            session=f"s{turn.session}",
            send_max_tokens=send_max_tokens,
            model=model,
        )
        for t, turn in _timed_turns(n, rate, seed, max_model_len, params, arrival_cv)
    ]


def no_sharing_workload(
    n: int,
    rate: float,
    seed: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    *,
    params: ChatParams = ChatParams(),
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """:func:`chat_workload`'s requests for the same arguments with content shared by none of them.

    Lengths, arrival times and order are ``chat``'s. The ``j``-th turn generated (session by session)
    is request ``r{j}`` with one segment of its own and no session, so no two prompts share a block.
    """
    base = FAMILY_BASE["no-sharing"]
    return [
        make_request(
            f"r{turn.index}",
            t,
            ((base + turn.index, prompt_tokens(turn.segments)),),
            turn.output_tokens,
            send_max_tokens=send_max_tokens,
            model=model,
        )
        for t, turn in _timed_turns(n, rate, seed, max_model_len, params, arrival_cv)
    ]


class PrefixWorkloadGenerator(Protocol):
    """The signature every synthetic prefix family shares (its params keep their defaults)."""

    def __call__(
        self,
        n: int,
        rate: float,
        seed: int,
        max_model_len: int = ...,
        *,
        arrival_cv: float = ...,
        send_max_tokens: bool = ...,
        model: str = ...,
    ) -> list[SimRequest]: ...


PREFIX_GENERATORS: Final[dict[str, PrefixWorkloadGenerator]] = {
    "chat": chat_workload,
    "system-prompts": system_prompt_workload,
    "rag": rag_workload,
    "no-sharing": no_sharing_workload,
}
"""The synthetic families by name, in the order of :data:`PREFIX_WORKLOAD_KINDS`."""


def generate_prefix_workload(
    kind: str,
    n: int,
    rate: float,
    seed: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    *,
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """``n`` requests of the family ``kind`` (one of :data:`PREFIX_WORKLOAD_KINDS`), default params."""
    generate = PREFIX_GENERATORS.get(kind)
    if generate is None:
        raise ConfigError("workload", f"expected one of {', '.join(PREFIX_WORKLOAD_KINDS)}, got {kind!r}")
    return generate(
        n, rate, seed, max_model_len, arrival_cv=arrival_cv, send_max_tokens=send_max_tokens, model=model
    )
