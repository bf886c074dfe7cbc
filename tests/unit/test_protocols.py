"""Request adapters (validation, usage injection) and the learned token estimate."""

from __future__ import annotations

import json

import pytest

from hetroute.proxy.api_errors import ApiError, error_body
from hetroute.proxy.protocols import TokenEstimator, parse_chat, parse_completions, parse_generate, with_model


def _raw(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_chat_non_stream_keeps_client_bytes() -> None:
    raw = _raw({"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 7})
    req = parse_chat(raw)
    assert (req.model, req.prompt_chars, req.max_tokens, req.stream, req.strip_usage) == (
        "m",
        11,
        7,
        False,
        False,
    )
    assert req.body is raw and req.upstream_path == "/v1/chat/completions"


def test_stream_without_usage_asks_backend_for_it() -> None:
    req = parse_chat(_raw({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}))
    assert req.stream and req.strip_usage
    assert json.loads(req.body)["stream_options"] == {"include_usage": True}


def test_stream_with_usage_is_untouched() -> None:
    raw = _raw({"model": "m", "prompt": "abc", "stream": True, "stream_options": {"include_usage": True}})
    req = parse_completions(raw)
    assert req.stream and not req.strip_usage and req.body is raw


def test_chat_content_parts_and_max_completion_tokens() -> None:
    parts = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": "x"}}]
    req = parse_chat(
        _raw({"model": "m", "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 5})
    )
    assert req.prompt_chars == 4 and req.max_tokens == 5


def test_completions_token_id_prompts_are_counted_exactly() -> None:
    assert parse_completions(_raw({"model": "m", "prompt": [1, 2, 3]})).prompt_token_count == 3
    assert parse_completions(_raw({"model": "m", "prompt": [[1, 2], [3]]})).prompt_token_count == 3
    assert parse_completions(_raw({"model": "m", "prompt": ["ab", "cde"]})).prompt_chars == 5


def test_openai_request_without_model_parses_and_takes_a_model_later() -> None:
    for body in (
        {"messages": [{"role": "user", "content": "x"}]},
        {"model": "", "messages": [{"role": "u"}]},
    ):
        req = parse_chat(_raw(body))
        assert req.model is None
        named = with_model(req, "served")
        assert named.model == "served"
        assert json.loads(named.body)["model"] == "served"
        assert json.loads(named.body)["messages"] == body["messages"]


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_chat, b"{not json", None),
        (parse_chat, b"[1, 2]", None),
        (parse_chat, _raw({"model": 5, "messages": []}), "model"),
        (parse_chat, _raw({"model": "m", "messages": "hi"}), "messages"),
        (parse_chat, _raw({"model": "m", "messages": [{"content": "x"}]}), "messages[0].role"),
        (
            parse_chat,
            _raw({"model": "m", "messages": [{"role": "user", "content": 3}]}),
            "messages[0].content",
        ),
        (parse_chat, _raw({"model": "m", "messages": [{"role": "u"}], "max_tokens": "10"}), "max_tokens"),
        (parse_chat, _raw({"model": "m", "messages": [{"role": "u"}], "max_tokens": 0}), "max_tokens"),
        (parse_chat, _raw({"model": "m", "messages": [{"role": "u"}], "stream": "yes"}), "stream"),
        (
            parse_chat,
            _raw({"model": "m", "messages": [{"role": "u"}], "stream_options": 1}),
            "stream_options",
        ),
        (parse_completions, _raw({"model": "m", "prompt": 12}), "prompt"),
        (parse_completions, _raw({"model": "m", "prompt": []}), "prompt"),
    ],
)
def test_bad_openai_input_is_400_naming_param(parse, body: bytes, param: str | None) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"\xff\xfe", None),
        (_raw({"parameters": {}}), "inputs"),
        (_raw({"inputs": "x", "parameters": []}), "parameters"),
        (_raw({"inputs": "x", "parameters": {"max_new_tokens": -1}}), "parameters.max_new_tokens"),
    ],
)
def test_bad_tgi_input_is_400(body: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_generate(body, stream=True)
    assert info.value.status == 400 and info.value.param == param


def test_tgi_request() -> None:
    req = parse_generate(_raw({"inputs": "hello", "parameters": {"max_new_tokens": 9}}), stream=True)
    assert (req.api, req.model, req.upstream_path, req.max_tokens, req.stream) == (
        "tgi",
        None,
        "/generate_stream",
        9,
        True,
    )


def test_error_shapes() -> None:
    assert json.loads(error_body("openai", 404, "nope", "model")) == {
        "error": {"message": "nope", "type": "not_found_error", "param": "model", "code": 404}
    }
    assert json.loads(error_body("tgi", 503, "down")) == {"error": "down", "error_type": "unhealthy"}


def test_token_estimator_learns_per_model() -> None:
    est = TokenEstimator(initial_chars_per_token=4.0, learn_rate=0.5)
    req = parse_completions(_raw({"model": "m", "prompt": "x" * 400}))
    assert est.estimate("m", req) == 100
    est.observe("m", 400, 200)  # first sample replaces the prior: 2 chars/token
    assert est.estimate("m", req) == 200
    est.observe("m", 400, 100)  # EWMA: 0.5·2 + 0.5·4 = 3
    assert est.chars_per_token("m") == pytest.approx(3.0)
    assert est.estimate("other", req) == 100  # per model
    est.observe("m", 400, None)
    assert est.chars_per_token("m") == pytest.approx(3.0)


def test_tgi_compat_route_follows_the_stream_flag() -> None:
    streamed = parse_generate(_raw({"inputs": "x", "stream": True}), stream=None)
    assert (streamed.upstream_path, streamed.stream, streamed.kind) == ("/", True, "compat")
    assert not parse_generate(_raw({"inputs": "x"}), stream=None).stream
    with pytest.raises(ApiError) as info:
        parse_generate(_raw({"inputs": "x", "stream": "no"}), stream=None)
    assert info.value.param == "stream"
