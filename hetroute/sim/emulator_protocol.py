"""Request parsing and response shapes of the emulated vLLM (OpenAI) and TGI APIs.

Owns: validation of request bodies into :class:`GenRequest`, the JSON error bodies of each engine, and the
builders of non-stream responses and stream chunks. Pure functions over plain data; no I/O.

Shapes follow anchors.md §9 and real-engines.md: OpenAI errors are
``{"error": {"message", "type", "param", "code"}}``; TGI errors are ``{"error", "error_type"}``;
OpenAI stream chunks carry ``"usage": null`` when ``stream_options.include_usage`` is set, and the usage
arrives in a separate chunk with ``"choices": []`` just before ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hetroute.prefix.hashing import token_block_hashes
from hetroute.sim.emulator_text import chat_token_ids, count_chat_tokens, count_text_tokens, token_ids

EngineKind = Literal["vllm", "tgi"]
ApiKind = Literal["completions", "chat", "generate"]

OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
TGI_DEFAULT_MAX_NEW_TOKENS = 100


class EngineApiError(Exception):
    """An error answered to the client: HTTP status, message, OpenAI type and TGI error_type."""

    def __init__(self, status: int, message: str, openai_type: str, tgi_type: str = "validation") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.openai_type = openai_type
        self.tgi_type = tgi_type

    def body(self, engine: EngineKind) -> dict[str, Any]:
        if engine == "tgi":
            return {"error": self.message, "error_type": self.tgi_type}
        return {
            "error": {"message": self.message, "type": self.openai_type, "param": None, "code": self.status}
        }


def bad_request(message: str) -> EngineApiError:
    return EngineApiError(400, message, "BadRequestError")


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One validated generation request, whatever API it came through."""

    api: ApiKind
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_tokens: int | None  # None: up to max_model_len − prompt
    min_tokens: int
    ignore_eos: bool
    details: bool = True
    as_list: bool = False  # TGI's ``POST /`` answers a non-stream request with a one-element list
    prompt: str | tuple[int, ...] = ""  # the prompt text or token ids (completions, TGI)
    messages: tuple[Mapping[str, Any], ...] = ()  # the chat messages (chat)

    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt's token ids (:mod:`emulator_text` rules); ``prompt_tokens`` of them."""
        if self.messages:
            return chat_token_ids(self.messages)
        return token_ids(self.prompt) if isinstance(self.prompt, str) else self.prompt

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        """Chained hashes of the prompt's full blocks: what the engine's prefix cache is keyed by.

        Computed on demand (one crc32 per 4 characters, one hash per block), so a server with prefix
        caching off pays nothing; the same prompt always gives the same hashes."""
        return token_block_hashes(self.prompt_token_ids(), block_size)


def decode_json(raw: bytes) -> Mapping[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from exc
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    return body


def _opt_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_request(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    """The completions ``prompt``: a text or token ids (a batch of one is unwrapped)."""
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt(prompt[0])
    raise bad_request("prompt must be a string or a list of token ids (batched prompts are not emulated)")


def parse_openai(body: Mapping[str, Any], api: ApiKind, served_model: str, engine: EngineKind) -> GenRequest:
    """Validate an OpenAI completions/chat body (EngineApiError 400/404 like vLLM)."""
    model = body.get("model")
    if engine == "vllm" and model is not None and model != served_model:
        raise EngineApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str | tuple[int, ...] = ""
    if api == "chat":
        raw_messages = body.get("messages")
        if (
            not isinstance(raw_messages, list)
            or not raw_messages
            or not all(isinstance(m, Mapping) for m in raw_messages)
        ):
            raise bad_request("messages must be a non-empty list of message objects")
        messages = tuple(raw_messages)
        prompt_tokens = count_chat_tokens(messages)
        max_tokens = _opt_int(body, "max_completion_tokens", 1) or _opt_int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise bad_request("prompt is required")
        prompt = _prompt(body["prompt"])
        prompt_tokens = count_text_tokens(prompt) if isinstance(prompt, str) else len(prompt)
        max_tokens = _opt_int(body, "max_tokens", 1)
        if "max_tokens" not in body:
            max_tokens = OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS
    n = _opt_int(body, "n", 1)
    if n is not None and n > 1:
        raise bad_request("n > 1 is not supported by the emulator")
    options = body.get("stream_options")
    include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
    return GenRequest(
        api=api,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        # vLLM extensions; TGI's OpenAI routes have no way to force the output length
        min_tokens=(_opt_int(body, "min_tokens", 0) or 0) if engine == "vllm" else 0,
        ignore_eos=bool(body.get("ignore_eos", False)) and engine == "vllm",
        prompt=prompt,
        messages=messages,
    )


def parse_tgi(body: Mapping[str, Any], stream: bool) -> GenRequest:
    """Validate a TGI ``/generate`` body (EngineApiError 422 ``validation`` like TGI)."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise EngineApiError(422, "Input validation error: `inputs` cannot be empty", "BadRequestError")
    params = body.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise EngineApiError(422, "Input validation error: `parameters` must be an object", "BadRequestError")
    max_new = params.get("max_new_tokens", TGI_DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:
        max_new = TGI_DEFAULT_MAX_NEW_TOKENS
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise EngineApiError(
            422, "Input validation error: `max_new_tokens` must be strictly positive", "BadRequestError"
        )
    return GenRequest(
        api="generate",
        stream=stream,
        include_usage=False,
        prompt_tokens=count_text_tokens(inputs),
        max_tokens=max_new,
        min_tokens=0,
        ignore_eos=False,
        details=bool(params.get("details", True)),
        prompt=inputs,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_response(
    req: GenRequest, rid: str, created: int, model: str, text: str, finish: str, completion_tokens: int
) -> dict[str, Any]:
    """The non-stream completions or chat response."""
    if req.api == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(req.prompt_tokens, completion_tokens),
    }


def openai_chunk(
    req: GenRequest,
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish: str | None,
    *,
    role: bool = False,
) -> dict[str, Any]:
    """One stream chunk; ``role`` makes the first chat chunk (``delta.role``)."""
    if req.api == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text or "",
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "text_completion"
    chunk: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def openai_usage_chunk(
    req: GenRequest, rid: str, created: int, model: str, completion_tokens: int
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.api == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(req.prompt_tokens, completion_tokens),
    }


def tgi_token(token_id: int, text: str) -> dict[str, Any]:
    return {"id": token_id, "text": text, "logprob": -0.5, "special": False}


def tgi_response(
    req: GenRequest, text: str, finish: str, tokens: list[dict[str, Any]], seed: int | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"generated_text": text}
    if req.details:
        out["details"] = {
            "finish_reason": finish,
            "generated_tokens": len(tokens),
            "seed": seed,
            "prefill": [],
            "tokens": tokens,
            "top_tokens": None,
            "best_of_sequences": None,
        }
    return out


def tgi_stream_event(
    index: int,
    token: dict[str, Any],
    final_text: str | None,
    finish: str | None,
    generated: int,
    input_length: int,
) -> dict[str, Any]:
    details = None
    if finish is not None:
        details = {
            "finish_reason": finish,
            "generated_tokens": generated,
            "input_length": input_length,
            "seed": None,
        }
    return {
        "index": index,
        "token": token,
        "top_tokens": None,
        "generated_text": final_text,
        "details": details,
    }
