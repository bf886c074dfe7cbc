"""Client API adapters: request body → validated :class:`ParsedRequest`, plus token estimates.

Owns the request-side knowledge of the OpenAI (``/v1/completions``, ``/v1/chat/completions``)
and TGI (``/generate``, ``/generate_stream``) APIs: which fields must be valid before anything
reaches a backend (a bad one raises :class:`ApiError` 400 naming the field), how long the
prompt is, and the body to send upstream. For an OpenAI stream whose client did not ask for
usage the upstream body gains ``stream_options.include_usage`` and the response tap strips
the extra chunk again, so completion tokens are always known. Otherwise the client's bytes
are forwarded unchanged. No routing logic, no I/O.

:class:`TokenEstimator` estimates prompt tokens without a tokenizer: characters divided by a
per-model chars-per-token ratio, learned online (EWMA) from backends' ``prompt_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from hetroute.proxy.api_errors import ApiError
from hetroute.types import Api

Kind = Literal["chat", "completions", "generate", "generate_stream", "compat"]


class ParsedRequest(NamedTuple):
    """A validated client request. ``model`` is None for TGI (its API has no model field)."""

    api: Api
    kind: Kind
    upstream_path: str
    model: str | None
    prompt_chars: int
    prompt_token_count: int | None
    max_tokens: int | None
    stream: bool
    strip_usage: bool
    body: bytes
    prefix_text: str = ""
    """The prompt as one text, for the router's prefix index: a completions prompt (strings joined),
    TGI's ``inputs``, or chat messages as ``role\x1fcontent\x1e`` each; "" for token-id prompts."""
    user: str = ""
    """The OpenAI ``user`` field when it is a string (a session key for affinity), else ""."""


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. 1,000 nested brackets: a client error, not a crash
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from exc
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _opt_int(obj: Mapping[str, Any], key: str, param: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"`{param}` must be a positive integer, got {value!r}", param=param)
    return value


def _opt_bool(obj: Mapping[str, Any], key: str, param: str) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"`{param}` must be a boolean, got {value!r}", param=param)
    return value


def _model(obj: Mapping[str, Any]) -> str | None:
    """The request's model; None when absent, null or empty (the gateway then picks the only one)."""
    model = obj.get("model")
    if model is None or model == "":
        return None
    if not isinstance(model, str):
        raise ApiError(400, "`model` must be a non-empty string", param="model")
    return model


def with_model(parsed: ParsedRequest, model: str) -> ParsedRequest:
    """``parsed`` for ``model``, the name written into the forwarded body (older engines need it)."""
    obj = json.loads(parsed.body)
    obj["model"] = model
    return parsed._replace(model=model, body=json.dumps(obj).encode())


def _content_text(content: Any, param: str) -> str:
    """A message's text (the ``text`` parts of a list joined); validates the shape."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ApiError(400, f"`{param}[{j}]` must be an object", param=f"{param}[{j}]")
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
        return "".join(texts)
    raise ApiError(400, f"`{param}` must be a string, a list of parts or null", param=param)


def _user(obj: Mapping[str, Any]) -> str:
    user = obj.get("user")
    return user if isinstance(user, str) else ""


def _stream_fields(obj: dict[str, Any]) -> tuple[bool, bool, bytes | None]:
    """(stream, strip_usage, rewritten body or None when the client's bytes are kept)."""
    stream = _opt_bool(obj, "stream", "stream")
    options = obj.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "`stream_options` must be an object", param="stream_options")
    wants_usage = _opt_bool(options or {}, "include_usage", "stream_options.include_usage")
    if not stream or wants_usage:
        return stream, False, None
    rewritten = dict(obj)
    rewritten["stream_options"] = {**(options or {}), "include_usage": True}
    return True, True, json.dumps(rewritten).encode()


def parse_chat(raw: bytes) -> ParsedRequest:
    obj = _decode(raw)
    model = _model(obj)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list", param="messages")
    chars = 0
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ApiError(400, f"`messages[{i}]` must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ApiError(400, f"`messages[{i}].role` must be a string", param=f"messages[{i}].role")
        text = _content_text(msg.get("content"), f"messages[{i}].content")
        chars += len(text)
        parts.append(f"{role}\x1f{text}\x1e")
    max_tokens = _opt_int(obj, "max_completion_tokens", "max_completion_tokens") or _opt_int(
        obj, "max_tokens", "max_tokens"
    )
    stream, strip, body = _stream_fields(obj)
    return ParsedRequest(
        "openai",
        "chat",
        "/v1/chat/completions",
        model,
        chars,
        None,
        max_tokens,
        stream,
        strip,
        body or raw,
        "".join(parts),
        _user(obj),
    )


def parse_completions(raw: bytes) -> ParsedRequest:
    obj = _decode(raw)
    model = _model(obj)
    prompt = obj.get("prompt")
    chars = 0
    token_count: int | None = None
    text = ""
    if isinstance(prompt, str):
        chars = len(prompt)
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        chars = sum(len(p) for p in prompt)
        text = prompt[0]  # a batch of prompts: the first decides locality
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        token_count = len(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        token_count = sum(len(p) for p in prompt)
    else:
        raise ApiError(
            400, "`prompt` must be a string, a list of strings or a list of token ids", param="prompt"
        )
    max_tokens = _opt_int(obj, "max_tokens", "max_tokens")
    stream, strip, body = _stream_fields(obj)
    return ParsedRequest(
        "openai",
        "completions",
        "/v1/completions",
        model,
        chars,
        token_count,
        max_tokens,
        stream,
        strip,
        body or raw,
        text,
        _user(obj),
    )


def parse_generate(raw: bytes, *, stream: bool | None) -> ParsedRequest:
    """TGI ``/generate`` (stream False), ``/generate_stream`` (True) or ``POST /`` (None: the
    body's ``stream`` flag decides, as TGI's compatibility route does)."""
    obj = _decode(raw)
    inputs = obj.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise ApiError(400, "`inputs` must be a non-empty string", param="inputs")
    params = obj.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, "`parameters` must be an object", param="parameters")
    max_new = _opt_int(params or {}, "max_new_tokens", "parameters.max_new_tokens")
    if stream is None:
        is_stream = _opt_bool(obj, "stream", "stream")
        return ParsedRequest(
            "tgi", "compat", "/", None, len(inputs), None, max_new, is_stream, False, raw, inputs
        )
    kind: Kind = "generate_stream" if stream else "generate"
    return ParsedRequest(
        "tgi", kind, f"/{kind}", None, len(inputs), None, max_new, stream, False, raw, inputs
    )


PARSERS = {
    "/v1/chat/completions": parse_chat,
    "/v1/completions": parse_completions,
}


class TokenEstimator:
    """Prompt tokens ≈ chars / cpt(model); cpt ← (1−α)·cpt + α·chars/prompt_tokens on each usage."""

    __slots__ = ("_initial", "_rate", "_cpt")

    def __init__(self, initial_chars_per_token: float = 4.0, learn_rate: float = 0.1) -> None:
        self._initial = initial_chars_per_token
        self._rate = learn_rate
        self._cpt: dict[str, float] = {}

    def chars_per_token(self, model: str) -> float:
        return self._cpt.get(model, self._initial)

    def estimate(self, model: str, req: ParsedRequest) -> int:
        if req.prompt_token_count is not None:
            return req.prompt_token_count
        return max(1, round(req.prompt_chars / self.chars_per_token(model)))

    def observe(self, model: str, prompt_chars: int, prompt_tokens: int | None) -> None:
        if prompt_tokens is None or prompt_tokens <= 0 or prompt_chars <= 0:
            return
        sample = prompt_chars / prompt_tokens
        old = self._cpt.get(model)
        self._cpt[model] = sample if old is None else (1 - self._rate) * old + self._rate * sample
