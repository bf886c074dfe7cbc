"""The ``system-prompts`` and ``rag`` workloads: single-shot requests over a shared corpus of long texts.

Both are pure functions of ``(n, rate, seed, max_model_len, params)`` with the invariants, parameters
and sources listed in ``sim/prefix_workloads.py``'s docstring. Request ``k`` (in arrival order) is
``r{k}``; ``session`` is ``""`` (no conversation). Segment ids (offset by ``FAMILY_BASE``): local id 0
is ``rag``'s instructions; shared texts (system prompts, documents) come next; each request's question
has an id of its own after them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetroute.prefix.hashing import Segment
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
    zipf_weights,
)
from hetroute.sim.workload import SimRequest, arrival_times


@dataclass(frozen=True, slots=True)
class SystemPromptParams:
    """``system-prompts``: ``prompts`` shared prompts of ``prompt_tokens`` (uniform, inclusive) tokens,
    picked with Zipf popularity of exponent ``zipf_s``."""

    prompts: int = 6
    prompt_tokens: tuple[int, int] = (1000, 2000)
    zipf_s: float = 1.0

    def __post_init__(self) -> None:
        check(self.prompts >= 1, "system-prompts.prompts", f"must be >= 1, got {self.prompts}")
        check_token_range("system-prompts.prompt_tokens", self.prompt_tokens)
        check(self.zipf_s >= 0, "system-prompts.zipf_s", f"must be >= 0, got {self.zipf_s}")


@dataclass(frozen=True, slots=True)
class RagParams:
    """``rag``: ``documents`` of ``document_tokens`` (uniform, inclusive) with Zipf popularity of exponent
    ``zipf_s``; ``docs_per_request`` retrieved after ``instruction_tokens`` of shared instructions."""

    documents: int = 100
    document_tokens: tuple[int, int] = (500, 3000)
    zipf_s: float = 1.0
    docs_per_request: int = 3
    instruction_tokens: int = 200

    def __post_init__(self) -> None:
        check(self.documents >= 1, "rag.documents", f"must be >= 1, got {self.documents}")
        check_token_range("rag.document_tokens", self.document_tokens)
        check(self.zipf_s >= 0, "rag.zipf_s", f"must be >= 0, got {self.zipf_s}")
        check(
            0 <= self.docs_per_request <= self.documents,
            "rag.docs_per_request",
            f"must be in 0..documents, got {self.docs_per_request}",
        )
        check(
            self.instruction_tokens >= 1,
            "rag.instruction_tokens",
            f"must be >= 1, got {self.instruction_tokens}",
        )


def system_prompt_workload(
    n: int,
    rate: float,
    seed: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    *,
    params: SystemPromptParams = SystemPromptParams(),
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """``n`` requests, each one shared system prompt (Zipf popularity) + a unique question."""
    check_common(n, max_model_len)
    rng, timing = content_and_timing_streams(seed)
    base = FAMILY_BASE["system-prompts"]
    lo, hi = params.prompt_tokens
    prompt_lengths = rng.integers(lo, hi + 1, size=params.prompts)
    picks = rng.choice(params.prompts, size=n, p=zipf_weights(params.prompts, params.zipf_s))
    questions, answers = user_tokens(rng, n), answer_tokens(rng, n)
    arrivals = arrival_times(n, rate, timing, arrival_cv=arrival_cv)
    out: list[SimRequest] = []
    for k in range(n):
        p = int(picks[k])
        prompt = ((base + p, int(prompt_lengths[p])), (base + params.prompts + k, int(questions[k])))
        segments, output = fit_to_model_len(prompt, int(answers[k]), max_model_len)
        out.append(
            make_request(
                f"r{k}", float(arrivals[k]), segments, output, send_max_tokens=send_max_tokens, model=model
            )
        )
    return out


def rag_workload(
    n: int,
    rate: float,
    seed: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    *,
    params: RagParams = RagParams(),
    arrival_cv: float = 1.0,
    send_max_tokens: bool = False,
    model: str = "",
) -> list[SimRequest]:
    """``n`` requests of shared instructions + retrieved documents (in retrieval order) + a question.

    Documents are drawn without replacement by popularity; the draw order is the retrieval order. When
    the prompt and answer would not fit in ``max_model_len`` the last retrieved documents are dropped
    (a context budget), then the prompt is cut at its end if it still does not fit.
    """
    check_common(n, max_model_len)
    rng, timing = content_and_timing_streams(seed)
    base = FAMILY_BASE["rag"]
    lo, hi = params.document_tokens
    doc_lengths = rng.integers(lo, hi + 1, size=params.documents)
    weights = zipf_weights(params.documents, params.zipf_s)
    arrivals = arrival_times(n, rate, timing, arrival_cv=arrival_cv)
    instructions: Segment = (base, params.instruction_tokens)
    out: list[SimRequest] = []
    for k in range(n):
        docs = rng.choice(params.documents, size=params.docs_per_request, replace=False, p=weights)
        question: Segment = (base + 1 + params.documents + k, int(user_tokens(rng, 1)[0]))
        answer = int(answer_tokens(rng, 1)[0])
        retrieved = [(base + 1 + int(d), int(doc_lengths[d])) for d in docs]
        while retrieved and prompt_tokens([instructions, *retrieved, question]) + answer > max_model_len:
            retrieved.pop()
        segments, output = fit_to_model_len((instructions, *retrieved, question), answer, max_model_len)
        out.append(
            make_request(
                f"r{k}", float(arrivals[k]), segments, output, send_max_tokens=send_max_tokens, model=model
            )
        )
    return out
