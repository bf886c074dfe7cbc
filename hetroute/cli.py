"""The ``hetroute`` command line: one sub-command per module in ``hetroute.commands``.

Each command module exposes ``add_parser(subparsers) -> None`` (which sets
``func=run`` on its parser) and ``run(args) -> int``. This file holds no logic.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import cast

from hetroute import __version__

COMMANDS = ("serve", "demo", "emulate", "simulate", "profile", "tune_deploy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetroute",
        description="Request router for LLM serving on heterogeneous GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=f"hetroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"hetroute.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return cast(Callable[[argparse.Namespace], int], func)(args)
