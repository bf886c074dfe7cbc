"""The ``hetroute`` command line: one sub-command per module in ``hetroute.commands``.

Each command module exposes ``add_parser(subparsers) -> None`` (which sets
``func=run`` on its parser) and ``run(args) -> int``. Only the module of the command
being run is imported, so one command's heavy imports (matplotlib, scipy) never slow
another down. This file holds no logic.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import cast

from hetroute import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "run the gateway in front of vLLM/TGI backends"),
    "demo": ("demo", "emulated heterogeneous backends + router + a short workload; prints a table"),
    "emulate": ("emulate", "serve an emulated vLLM/TGI engine (real HTTP, modelled GPU timing)"),
    "simulate": ("simulate", "simulate routing policies on a cluster of engines in virtual time"),
    "profile": ("profile", "profile a live engine and fit its latency model (p1..p8)"),
    "tune-deploy": ("tune_deploy", "choose tensor-parallel degrees per machine and emit a deployment"),
}


def build_parser(command: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The top-level parser with every command's full sub-parser.

    With ``lazy=True`` only ``command`` gets its full sub-parser (the others are one-line
    stubs for ``--help``), so only that command's module is imported.
    """
    parser = argparse.ArgumentParser(
        prog="hetroute",
        description="Request router for LLM serving on heterogeneous GPU clusters.",
        epilog="Run 'hetroute COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"hetroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        if not lazy or name == command:
            module = importlib.import_module(f"hetroute.commands.{module_name}")
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command, lazy=True)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return cast(Callable[[argparse.Namespace], int], func)(args)
