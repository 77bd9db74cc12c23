"""The `strata` command line: make-tiny-model, generate, bench, plan, serve, build-kernels, ops, align, smoke.

The entry room: it only calls down into the rooms below (deployments, stages, pipeline, ...).
Results go to stdout (generated text, benchmark tables); logs and progress go to stderr.
Each command is a module of ``strata.commands`` (``add_arguments`` and ``run``), listed here once; heavy
rooms (Ray, the benchmarks) are imported when their command runs, so `strata --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from strata.commands import CLIError, register
from strata.pipeline.contract.errors import RequestFailed

log = logging.getLogger("strata")


# Packages only benchmarks, plots, load tests and the smoke check use: extras, not runtime dependencies.
OPTIONAL_PACKAGES = {"matplotlib": "bench", "locust": "bench", "openai": "bench", "psutil": "bench"}


def _version() -> str:
    """The installed package's version (what `/version` serves too)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strata")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from strata.bringup import add_bringup_commands
    from strata.commands import (bench, build_kernels, evaluate, generate, make_demo_image, make_tiny_model, plan,
                                 real_model, serve)

    parser = argparse.ArgumentParser(prog="strata", description="Serve LLaVA-style models as a pipeline of stages.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (stderr)")
    parser.add_argument("--version", action="version", version=f"strata {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, [
        ("make-tiny-model", "write a tiny random checkpoint of a real architecture", make_tiny_model),
        ("make-demo-image", "write the deterministic demo PNG", make_demo_image),
        ("real-model", "prepare the real SmolLM2-135M-Instruct (the installed GGUF, converted once) and print "
         "its directory: strata serve --model \"$(strata real-model)\"", real_model),
        ("generate", "generate text for one prompt (and images) in this process", generate),
        ("bench", "benchmarks", bench),
        ("eval", "model-level checks against a reference: `strata eval ppl` (perplexity)", evaluate),
        ("plan", "plan device / host / disk memory from config.json alone (no weights needed)", plan),
        ("serve", "serve the model over an OpenAI-compatible HTTP API (Ray Serve)", serve),
        ("build-kernels", "compile the C++ CPU kernels now (install time), not on the first server start",
         build_kernels),
    ])
    add_bringup_commands(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from strata.kvstore import HandleError
    from strata.pipeline.models.model_config import ModelConfigError
    from strata.pipeline.models.weights import WeightsError

    errors: list[type[BaseException]] = [CLIError, ModelConfigError, WeightsError, HandleError, ValueError, OSError]
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except _user_errors() as exc:  # includes stages' ImageError (a ValueError)
        if args.verbose:
            log.exception("failed")
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = OPTIONAL_PACKAGES.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"strata: error: this command needs the optional package {exc.name.split('.')[0]}: "
              f"pip install 'strata[{extra}]'", file=sys.stderr)
        return 2
    except RequestFailed as exc:  # the request ran and failed (not the user's input): exit 1
        print(f"strata: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
