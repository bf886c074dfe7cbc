"""JSON bodies of the emulated engines' metadata endpoints: ``/tokenize``, ``/v1/models`` and TGI's ``/info``.

Pure functions of the engine's limits and the request body; shapes follow anchors.md §9 and real-engines.md
(vLLM ``/tokenize`` → ``{count, max_model_len, tokens}``; TGI ``/tokenize`` → ``[{id, text, start, stop}]``).
Token counts use the rules of :mod:`emulator_text`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetroute.latency import EMULATOR_MARK
from hetroute.sim.emulator_protocol import EngineApiError, EngineKind
from hetroute.sim.emulator_text import CHARS_PER_TOKEN, chat_token_ids, token_ids
from hetroute.sim.engine_model import EngineModel

TGI_VERSION = "2.4.0"


def tokenize_body(kind: EngineKind, body: Mapping[str, Any], max_model_len: int) -> Any:
    """The ``/tokenize`` answer (EngineApiError 400 when neither prompt nor messages is given)."""
    if kind == "tgi":
        text = str(body.get("inputs", ""))
        step = CHARS_PER_TOKEN
        return [
            {
                "id": t,
                "text": text[i * step : (i + 1) * step],
                "start": i * step,
                "stop": min(len(text), (i + 1) * step),
            }
            for i, t in enumerate(token_ids(text))
        ]
    messages = body.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, Mapping) for m in messages):
        tokens = chat_token_ids(messages)  # the ids the prefix cache hashes, as for /v1/chat/completions
    elif isinstance(body.get("prompt"), str):
        tokens = token_ids(body["prompt"])
    else:
        raise EngineApiError(400, "prompt or messages is required", "BadRequestError")
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}


def models_body(
    kind: EngineKind, served_model: str, created_unix: int, max_model_len: int, root: str | None = None
) -> dict[str, Any]:
    """vLLM's ``/v1/models``: ``root`` is the weights the engine loaded (its ``--model``), which differs
    from ``id`` when ``--served-model-name`` gave the model another name."""
    card = {
        "id": served_model,
        "object": "model",
        "created": created_unix,
        "owned_by": kind,
        "root": root or served_model,
        "parent": None,
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [card]}


def tgi_info_body(engine: EngineModel, served_model: str, max_concurrent_requests: int) -> dict[str, Any]:
    """TGI's ``/info``: limits a router can discover (KV budget = ``max_batch_total_tokens``)."""
    return {
        "model_id": served_model,
        "model_sha": None,
        "model_dtype": "torch.float16",
        "model_device_type": "cuda",
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": max_concurrent_requests,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_input_tokens": engine.max_model_len - 1,
        "max_total_tokens": engine.max_model_len,
        "max_batch_total_tokens": engine.max_batch_total_tokens,
        "max_batch_prefill_tokens": engine.config.max_num_batched_tokens,
        "max_batch_size": engine.config.max_num_seqs,
        "waiting_served_ratio": 1.2,
        "max_waiting_tokens": 20,
        "validation_workers": 2,
        "max_client_batch_size": 4,
        "router": "text-generation-router",
        "version": TGI_VERSION,
        EMULATOR_MARK: True,
        "sha": None,
        "docker_label": None,
    }
