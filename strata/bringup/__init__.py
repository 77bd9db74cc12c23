"""Bringing up a new checkpoint, one command per step: `strata ops` (operator inventory), `strata
align` (layer-by-layer numerics against a reference), `strata eval ppl` (perplexity against a reference,
``bringup.perplexity``, registered with the `eval` family in ``strata.commands.evaluate``) and `strata smoke`
(a real server, checked through the openai client). `strata plan` (memory) and `strata bench serve` (load) complete the path.
"""

from __future__ import annotations

import argparse

from strata.commands import register


def add_bringup_commands(sub: argparse._SubParsersAction) -> None:
    """Register ops / align / smoke; each module is imported when its command is parsed for."""
    from strata.bringup import align, ops, smoke

    commands = (
        ("ops", "the operators a checkpoint needs and what implements each here (exit 1: something is missing)", ops),
        ("align", "Strata vs transformers (or a saved reference), layer by layer, as a chunked prefill", align),
        ("smoke", "start a real server, check it through the openai client, print a pass/fail table", smoke),
    )
    register(sub, commands)
