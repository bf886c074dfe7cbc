"""`hetroute demo` end to end, scaled down: both policies run and the table is printed."""

from __future__ import annotations

import argparse

import pytest

from hetroute.commands import demo


def test_demo_small_run(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["demo", "--requests", "12", "--rate", "40", "--speedup", "40"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "round_robin" in out and "default (" in out and "v100-tp4" in out and "v100-tp1" in out
    assert "throughput" in out and "vs round_robin" in out
    rows = [
        line
        for line in out.splitlines()
        if "|" in line and line.strip().startswith(("round_robin", "default ("))
    ]
    assert len(rows) == 2
    assert all(" 12 |" in line for line in rows)  # every request answered (ok column)
