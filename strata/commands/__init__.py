"""The `strata` subcommands, one idiom for all: a command is a module with ``add_arguments(parser)`` and
``run(args) -> exit code`` (a family of subcommands, like ``bench``, registers its own and has no ``run``),
listed once with its name and help where its family is registered (``strata.cli``, ``strata.bench``,
``strata.bringup``). Modules are imported when the parser is built; a command imports its heavy rooms (Ray,
the benchmarks) in ``run``, so `strata --help` stays fast."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Sequence


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def register(sub: argparse._SubParsersAction, commands: Sequence[tuple[str, str, ModuleType]]) -> None:
    for name, help_text, module in commands:
        p = sub.add_parser(name, help=help_text, description=getattr(module, "DESCRIPTION", None))
        module.add_arguments(p)
        if hasattr(module, "run"):
            p.set_defaults(func=module.run)
