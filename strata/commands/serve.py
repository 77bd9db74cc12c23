"""`strata serve`: the OpenAI-compatible HTTP server on Ray Serve (its flags and start live with the
deployments, ``deployments/ray_serve/cli.py``); the built-in demo model when none is named."""

from __future__ import annotations

import argparse

from strata.commands import CLIError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from strata.deployments.ray_serve.serve_flags import add_arguments as serve_arguments

    serve_arguments(p)


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_model import ensure_demo_model
    from strata.deployments.ray_serve.cli import run as serve

    try:
        return serve(args, default_model=ensure_demo_model)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
