"""`strata eval NAME`: model-level evaluations, a family of subcommands (``ppl``: ``strata.bringup.perplexity``)."""

from __future__ import annotations

import argparse

from strata.commands import register


def add_arguments(p: argparse.ArgumentParser) -> None:
    from strata.bringup import perplexity

    register(p.add_subparsers(dest="eval_command", required=True), [
        ("ppl", "perplexity of a text in Strata and in transformers, and their ratio (exit 1 past --threshold)",
         perplexity),
    ])
