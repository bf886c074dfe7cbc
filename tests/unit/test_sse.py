"""SSE splitting and the stream taps that count tokens and handle usage."""

from __future__ import annotations

import json

from hetroute.proxy.sse import (
    OpenAIStreamTap,
    SseSplitter,
    TgiStreamTap,
    event_data,
    openai_error_event,
    tgi_error_event,
)


def _chunk(text: str) -> bytes:
    return (
        b"data: "
        + json.dumps({"id": "c1", "choices": [{"index": 0, "text": text}], "usage": None}).encode()
        + b"\n\n"
    )


USAGE = (
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_splitter_across_arbitrary_boundaries() -> None:
    stream = _chunk("a") + b": keep-alive\n\n" + _chunk("b") + DONE
    for cut in range(1, len(stream)):
        sp = SseSplitter()
        events = sp.feed(stream[:cut]) + sp.feed(stream[cut:])
        assert b"".join(events) == stream
        assert len(events) == 4 and sp.pending == b""


def test_splitter_crlf() -> None:
    sp = SseSplitter()
    events = sp.feed(b"data: x\r\n\r\ndata: y\r\n")
    assert events == [b"data: x\r\n\r\n"] and sp.pending == b"data: y\r\n"
    assert sp.feed(b"\r\n") == [b"data: y\r\n\r\n"]


def test_event_data_forms() -> None:
    assert event_data(b"data: hello\n\n") == b"hello"
    assert event_data(b"data:hello\n\n") == b"hello"
    assert event_data(b"event: x\ndata: a\ndata: b\n\n") == b"a\nb"
    assert event_data(b": comment\n\n") is None


def test_openai_tap_passes_bytes_unchanged_and_counts() -> None:
    tap = OpenAIStreamTap(strip_usage=False)
    chunks = [_chunk("a"), _chunk("b") + _chunk("c"), USAGE, DONE]
    out = b"".join(tap.feed(c) for c in chunks) + tap.flush()
    assert out == b"".join(chunks)
    assert tap.events == 3 and tap.done
    assert (tap.prompt_tokens, tap.completion_tokens) == (11, 3)


def test_openai_tap_strips_usage_chunk_it_asked_for() -> None:
    tap = OpenAIStreamTap(strip_usage=True)
    stream = _chunk("a") + _chunk("b") + USAGE + DONE
    out = b""
    for i in range(0, len(stream), 7):  # worst case: events split everywhere
        out += tap.feed(stream[i : i + 7])
    out += tap.flush()
    assert out == _chunk("a") + _chunk("b") + DONE
    assert tap.completion_tokens == 3 and tap.events == 2


def test_openai_tap_keeps_usage_on_a_choice_chunk() -> None:
    final = (
        b'data: {"choices":[{"index":0,"text":"z","finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
    )
    tap = OpenAIStreamTap(strip_usage=True)
    assert tap.feed(final + DONE) == final + DONE
    assert tap.completion_tokens == 1 and tap.events == 1


def test_openai_tap_sees_upstream_error_event() -> None:
    tap = OpenAIStreamTap(strip_usage=False)
    tap.feed(b'data: {"error": {"message": "boom", "type": "x"}}\n\n')
    assert tap.error and tap.events == 0


def test_tgi_tap_counts_tokens_and_reads_details() -> None:
    ev = [
        {
            "index": i,
            "token": {"id": i, "text": "t", "logprob": -0.1, "special": False},
            "generated_text": None,
            "details": None,
        }
        for i in range(1, 3)
    ]
    last = {
        "index": 3,
        "token": {"id": 3, "text": "!", "logprob": -0.1, "special": False},
        "generated_text": "tt!",
        "details": {"finish_reason": "length", "generated_tokens": 3, "input_length": 9, "seed": None},
    }
    tap = TgiStreamTap()
    stream = b"".join(b"data:" + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in [*ev, last])
    assert tap.feed(stream) == stream
    assert tap.events == 3 and tap.done and (tap.prompt_tokens, tap.completion_tokens) == (9, 3)


def test_tgi_tap_done_without_details() -> None:
    tap = TgiStreamTap()
    tap.feed(b'data:{"index":1,"token":{"id":1,"text":"a"},"generated_text":null,"details":null}\n\n')
    assert not tap.done
    tap.feed(b'data:{"index":2,"token":{"id":2,"text":"b"},"generated_text":"ab","details":null}\n\n')
    done: bool = tap.done  # a fresh read: mypy narrowed tap.done to False above
    assert done and tap.completion_tokens is None and tap.events == 2


def test_error_events_shapes() -> None:
    ev = openai_error_event("gone", code=502)
    first, second = ev.split(b"\n\n")[:2]
    assert json.loads(event_data(first + b"\n\n") or b"") == {
        "error": {"message": "gone", "type": "upstream_error", "param": None, "code": 502}
    }
    assert second == b"data: [DONE]"
    assert json.loads(event_data(tgi_error_event("gone")) or b"") == {
        "error": "gone",
        "error_type": "generation",
    }
