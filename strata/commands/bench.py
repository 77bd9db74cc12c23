"""`strata bench NAME`: the benchmarks, a family of subcommands (``strata.bench`` registers them)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from strata.bench import add_bench_commands

    add_bench_commands(p.add_subparsers(dest="bench_command", required=True))
