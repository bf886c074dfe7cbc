"""The one-line ``real_engine tier:`` summary printed at the end of every pytest run (tests/conftest.py)."""

from __future__ import annotations

from typing import Literal

import pytest

from tests.conftest import real_engine_summary

NOT_INSTALLED = "REAL ENGINE NOT INSTALLED: no ready vLLM venv at /x; run tests/real_engine/setup.sh"


def report(
    name: str,
    outcome: Literal["passed", "failed", "skipped"],
    when: Literal["setup", "call", "teardown"] = "call",
    *,
    longrepr: object = None,
    real: bool = True,
) -> pytest.TestReport:
    keywords = {name: 1, "real_engine": 1} if real else {name: 1}
    return pytest.TestReport(f"t.py::{name}", ("t.py", 1, name), keywords, outcome, longrepr, when)  # type: ignore[arg-type]


def test_counts_each_real_engine_test_once_and_ignores_the_others() -> None:
    stats = {
        "passed": [
            report("a", "passed", "setup"),
            report("a", "passed"),
            report("b", "passed", "setup"),
            report("b", "passed"),
            report("u", "passed", real=False),
        ],
        "error": [report("b", "failed", "teardown", longrepr="boom")],
        "failed": [report("c", "failed", longrepr="E assert 1 == 2")],
    }
    assert real_engine_summary(stats) == "real_engine tier: 1 passed / 2 failed / 0 skipped"


def test_a_missing_engine_fails_and_says_so() -> None:
    stats = {"error": [report("a", "failed", "setup", longrepr=NOT_INSTALLED)]}
    assert (
        real_engine_summary(stats)
        == f"real_engine tier: 0 passed / 1 failed / 0 skipped (failed: {NOT_INSTALLED})"
    )


def test_skips_give_their_reason_once() -> None:
    why = "REAL ENGINE NOT INSTALLED (allowed by HETROUTE_ALLOW_NO_REAL_ENGINE=1): no venv"
    stats = {
        "skipped": [
            report(name, "skipped", "setup", longrepr=("t.py", 3, f"Skipped: {why}")) for name in ("a", "b")
        ]
    }
    assert (
        real_engine_summary(stats)
        == f"real_engine tier: 0 passed / 0 failed / 2 skipped (skipped because: {why})"
    )


def test_a_run_without_the_tier_says_so() -> None:
    assert real_engine_summary({}) == "real_engine tier: not in this run"
    assert (
        real_engine_summary({"passed": [report("u", "passed", real=False)]})
        == "real_engine tier: not in this run"
    )
