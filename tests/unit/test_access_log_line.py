"""The access log's hand-written JSON line equals the JSON encoder's, field for field, on any record."""

from __future__ import annotations

import json
import math
import random
from dataclasses import fields

from hetroute.access_log import AccessRecord, record_line

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def record_line_reference(r: AccessRecord) -> str:
    """The specification of :func:`record_line`: the encoder's line for the record's fields in
    declaration order, times rounded to the µs."""
    data = {f.name: getattr(r, f.name) for f in fields(AccessRecord)}
    for key in ("ttft_s", "itl_s", "duration_s"):
        if data[key] is not None:
            data[key] = round(data[key], 6)
    return _ENCODE(data)


TEXTS = ["", "plain", 'quote " and \\ backslash', "tab\tnewline\ncontrol\x01", "ünïcödé 日本 🚀", "\ud800"]
TIMES = [None, 0.0, 1e-7, 0.0052841234, 12345.6789012, 3.0, math.inf, -math.inf, math.nan, 1e300]
COUNTS = [None, 0, 1, 16, 10**12]


def _record(rng: random.Random) -> AccessRecord:
    def text() -> str:
        return rng.choice(TEXTS) + rng.choice(TEXTS)

    return AccessRecord(
        request_id=text(),
        api=rng.choice(["openai", "tgi"]),
        path=text(),
        model=rng.choice([None, text()]),
        backend=rng.choice([None, text()]),
        status=rng.choice([0, 200, 429, 499, 502]),
        attempts=rng.randrange(0, 4),
        stream=rng.random() < 0.5,
        ttft_s=rng.choice(TIMES),
        itl_s=rng.choice(TIMES),
        duration_s=rng.choice([t for t in TIMES if t is not None]),
        prompt_tokens=rng.choice(COUNTS),
        completion_tokens=rng.choice(COUNTS),
        policy=rng.choice([None, text()]),
        reason=rng.choice([None, text()]),
        error=rng.choice([None, text()]),
    )


def test_the_line_is_the_encoders_on_random_records() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        r = _record(rng)
        assert record_line(r) == record_line_reference(r)


def test_the_line_parses_back_with_times_rounded_to_the_microsecond() -> None:
    r = AccessRecord("id-1", "openai", "/v1/completions", "m", "b", 200, 1, True, 0.0052841234, None, 1.5)
    data = json.loads(record_line(r))
    assert data["ttft_s"] == 0.005284 and data["itl_s"] is None and data["duration_s"] == 1.5
    assert list(data) == [
        "request_id", "api", "path", "model", "backend", "status", "attempts", "stream", "ttft_s",
        "itl_s", "duration_s", "prompt_tokens", "completion_tokens", "policy", "reason", "error",
    ]  # fmt: skip
