"""`strata bench structured`: what structured output costs the batched sampler step.

One step's sampling work for a batch of 32 (logits of the model's vocabulary, greedy), with 0, 1 and all
32 rows constrained by a JSON schema, and all 32 rows asking for tools (Hermes syntax): ``auto`` while the
answer is text (the opening marker as text, a lazy grammar; and as one added token, the grammar's trigger),
and ``required`` while it writes a call. That is the grammar masks (llguidance, one matcher
per row), the masked sampling and feeding each token back to its matcher. Every row's matcher is advanced along a fixed
valid answer, so each step costs what a real constrained step costs at that point of the answer. The
unconstrained batch is the baseline; rounds alternate the cases and medians are reported. The
tokenizer is SmolLM2's (49,152 tokens) when its real weights are here, else the demo model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import torch

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.engine_core import sample_rows
from strata.pipeline.core.grammar import GrammarRunner
from strata.pipeline.core.sampler import Sampler
from strata.pipeline.frontend.tools.calls import constrain
from strata.pipeline.frontend.tools.formats import Hermes
from strata.pipeline.frontend.tools.request import tool_request

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population_millions": {"type": "number"}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}
ANSWER = '{"city": "Paris", "country": "France", "population_millions": 2.1}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)


def _tokenizer() -> tuple[Any, str]:
    from transformers import AutoTokenizer

    try:
        from strata.checkpoints.gguf_checkpoint import ensure_smollm2

        path, name = ensure_smollm2(), "SmolLM2-135M-Instruct"
    except Exception:  # no real weights here: the demo model's tokenizer
        from strata.checkpoints.tiny_model import ensure_demo_model

        path, name = ensure_demo_model(), "the demo model"
    return AutoTokenizer.from_pretrained(path), name


def _step_seconds(runner: GrammarRunner, sampler: Sampler, seqs: list[Any], answer: list[int], vocab: int) -> float:
    """Sampling work of one whole answer's steps, per step."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(seqs), vocab, generator=gen)
    for seq in seqs:
        seq.grammar_matcher, seq.grammar_template, seq.token_ids = None, None, []
    start = time.perf_counter()
    for token in answer:
        sample_rows(sampler, runner, logits, seqs, ())  # what the engine core runs each step
        for seq in seqs:  # the answer's token, so every matcher follows a valid path
            runner.accept(seq, token)
            seq.token_ids.append(token)
    return (time.perf_counter() - start) / len(answer)


def run(args: argparse.Namespace) -> int:
    tok, name = _tokenizer()
    vocab = len(tok)
    answer = tok(ANSWER, add_special_tokens=False)["input_ids"]
    call = tok(CALL, add_special_tokens=False)["input_ids"]
    runner, sampler = GrammarRunner(lambda: tok, vocab), Sampler()
    plain = SamplingParams(max_tokens=64, temperature=0.0)
    constrained = SamplingParams(max_tokens=64, temperature=0.0, structured=("json", json.dumps(SCHEMA)))
    hermes = Hermes(tok)
    auto, required = (SamplingParams(max_tokens=64, temperature=0.0, structured=(
        "lark", hermes.grammar(tool_request(TOOLS, choice, None)))) for choice in ("auto", "required"))

    def batch(k: int, params: SamplingParams = constrained) -> list[Any]:
        return [SimpleNamespace(params=params if i < k else plain, token_ids=[], num_prompt_tokens=0,
                                output_token_ids=[], token_counts=None, grammar_matcher=None, grammar_template=None,
                                request_id=f"r{i}",
                                generator=None)
                for i in range(args.batch)]

    # the same tokenizer with <tool_call> as one added token (as Qwen's): the marker is the grammar's trigger
    marked = type(tok).from_pretrained(tok.name_or_path)
    marked.add_tokens(["<tool_call>", "</tool_call>"])
    triggered = SamplingParams(max_tokens=64, temperature=0.0)
    constrain(triggered, tool_request(TOOLS, "auto", None), Hermes(marked))
    marked_runner = GrammarRunner(lambda: marked, len(marked))

    n = args.batch
    cases = {"none constrained": (runner, batch(0), answer, vocab), "1 constrained": (runner, batch(1), answer, vocab),
             f"all {n} constrained": (runner, batch(n), answer, vocab),
             f"all {n} tools, auto, text": (runner, batch(n, auto), answer, vocab),
             f"all {n} tools, auto, 1-token marker": (marked_runner, batch(n, triggered), answer, len(marked)),
             f"all {n} tools, required": (runner, batch(n, required), call, vocab)}
    for grammar, seqs, path, size in cases.values():  # warm-up (the tokenizer's trie, each grammar's first masks)
        _step_seconds(grammar, sampler, seqs, path, size)
    runs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for label, (grammar, seqs, path, size) in cases.items():
            runs[label].append(_step_seconds(grammar, sampler, seqs, path, size))
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = med["none constrained"]
    print(f"# strata bench structured: the sampler's step for a batch of {args.batch} over {name}'s {vocab:,}-token "
          f"vocabulary (greedy), a JSON schema on 0 / 1 / all rows, then tools on all rows (Hermes; auto along a "
          f"text answer with <tool_call> as text and as one token, required along a call); llguidance masks; {len(answer)} steps of a valid answer ({len(call)} "
          f"of the call), median of {args.rounds} alternating rounds, {torch.get_num_threads()} threads")
    for label, seconds in med.items():
        print(f"  {label:<36} {seconds * 1e3:7.3f} ms/step  (+{(seconds - base) * 1e3:6.3f} ms over unconstrained)")
    if args.json:
        args.json.write_text(json.dumps({"vocab": vocab, "tokenizer": name, "batch": args.batch,
                                         "ms_per_step": {k: v * 1e3 for k, v in med.items()}}, indent=2))
    return 0
