"""Token counts of a non-streaming answer, read without decoding the whole body.

Owns :func:`usage_of`. Pure: bytes in, counts out. Only the small ``usage`` (OpenAI) or ``details`` (TGI)
object is decoded, found by its key from the end of the body; a count that is absent, negative or not an
integer is None, never 0.
"""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(api: str, body: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a non-streaming answer, None where absent.

    Only the small ``usage`` (OpenAI) or ``details`` (TGI) object is decoded, not the whole answer.
    """
    key = b'"details"' if api == "tgi" else b'"usage"'
    at = body.rfind(key)
    if at < 0:
        return None, None
    start = body.find(b"{", at + len(key), at + len(key) + 8)
    if start < 0:
        return None, None
    try:
        obj, _ = _DECODER.raw_decode(body[start:].decode("utf-8", "replace"))
    except ValueError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    if api == "tgi":
        prefill = obj.get("prefill")
        return (len(prefill) if isinstance(prefill, list) and prefill else None), _int(
            obj.get("generated_tokens")
        )
    return _int(obj.get("prompt_tokens")), _int(obj.get("completion_tokens"))
