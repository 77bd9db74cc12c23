"""Registering a family of subcommands (`strata bench ...`, `strata ops|align|smoke`): each module
gives ``add_arguments(parser)`` and ``run(args) -> exit code``."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Sequence


def register(sub: argparse._SubParsersAction, commands: Sequence[tuple[str, str, ModuleType]]) -> None:
    for name, help_text, module in commands:
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
