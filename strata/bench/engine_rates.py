"""Decode and prefill rates of an in-process engine, measured the same way by every bench that compares two."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from strata.bench.offline import _interleaved, random_prompts

from strata.pipeline.contract.sampling_params import SamplingParams


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_tok_s(engine: Any, prompts: list[list[int]], output_len: int) -> Callable[[], float]:
    """One measurement of decode tokens/s over the batch ``prompts`` (greedy, EOS ignored): the whole run
    minus a run of the prefill alone. NaN when the machine was too busy to tell (three rounds in which the
    prefill alone took longer than the whole)."""
    decode = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def once() -> float:
        for _ in range(3):
            whole = timed(lambda: engine.generate([{"prompt_token_ids": p, "params": decode} for p in prompts]))
            head = timed(lambda: engine.generate([{"prompt_token_ids": p, "params": first} for p in prompts]))
            if whole > head:
                return len(prompts) * (output_len - 1) / (whole - head)
        return float("nan")
    return once


def prefill_tok_s(engine: Any, prompt: list[int]) -> Callable[[], float]:
    """One measurement of prefill tokens/s of one prompt (its first token included)."""
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return lambda: len(prompt) / timed(lambda: engine.generate([{"prompt_token_ids": prompt, "params": first}]))


def add_rate_arguments(p: argparse.ArgumentParser, batches: list[int]) -> None:
    """The workload flags of a bench that measures decode and prefill rates side by side."""
    p.add_argument("--batches", nargs="+", type=int, default=batches)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians reported)")
    p.add_argument("--json", type=Path, help="also write the results here")


def measure_rates(engines: dict[str, Any], args: argparse.Namespace, vocab: int, rows: dict[str, dict[str, Any]]) -> None:
    """Each engine's decode tokens/s at every ``args.batches`` and prefill tokens/s of one ``args.prefill_len``
    prompt, the engines interleaved round by round (medians), into ``rows[name]``."""
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, vocab, seed=batch)
        for e in engines.values():  # warm-up
            e.generate([{"prompt_token_ids": p, "params": first} for p in prompts[:2]])
        res = _interleaved({n: decode_tok_s(e, prompts, args.output_len) for n, e in engines.items()}, args.repeats)
        for name, v in res.items():
            rows[name][f"decode_b{batch}_tok_s"] = v
    long = random_prompts(1, args.prefill_len, vocab, seed=99)[0]
    for name, v in _interleaved({n: prefill_tok_s(e, long) for n, e in engines.items()}, args.repeats).items():
        rows[name]["prefill_tok_s"] = v
