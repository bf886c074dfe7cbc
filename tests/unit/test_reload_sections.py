"""What a SIGHUP reload reports as needing a restart (hetroute.commands.reload.changed_sections)."""

from __future__ import annotations

from typing import Any

from hetroute.commands.reload import changed_sections
from hetroute.config import config_from_dict


def _cfg(**extra: Any) -> Any:
    backends = [{"name": "a", "url": "http://127.0.0.1:9001", "engine": "vllm", "models": ["m"]}]
    return config_from_dict({"backends": backends + extra.pop("more", []), **extra}, env={})


def test_backend_changes_are_applied_other_sections_and_dns_entries_need_a_restart() -> None:
    base = _cfg()
    b = {"name": "b", "url": "http://127.0.0.1:9002", "engine": "vllm", "models": ["m"]}
    assert changed_sections(base, _cfg(more=[b])) == ()  # a fixed backend more: applied live
    assert changed_sections(base, _cfg(policy={"type": "round_robin"})) == ("policy",)
    pool = {
        "name": "pool",
        "url": "http://vllm.default.svc:8000",
        "discovery": "dns",
        "engine": "vllm",
        "models": ["m"],
    }
    assert changed_sections(base, _cfg(more=[pool])) == ("backends (discovery: dns entries)",)
    moved = {**pool, "url": "http://vllm.other.svc:8000"}
    assert changed_sections(_cfg(more=[pool]), _cfg(more=[moved])) == ("backends (discovery: dns entries)",)
