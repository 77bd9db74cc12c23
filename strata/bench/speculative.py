"""`strata bench spec`: prompt-lookup speculative decoding against plain decoding, side by side.

The real SmolLM2-135M-Instruct (or any checkpoint given) answers the same chats twice per round, once
with speculation off and once on, rounds interleaved in one process (this machine is noisy). The chats
are the work prompt lookup exists for: rewriting given code, and repeating given text with one change.
Reported per side: output tok/s at batch 1, and for the speculating side the acceptance rate and the
tokens a verifying step adds. Greedy answers must be identical, or the comparison is void.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from strata.pipeline.contract.sampling_params import SamplingParams

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
        "    return a * b\n\n\ndef div(a, b):\n    if b == 0:\n        raise ZeroDivisionError('b is zero')\n"
        "    return a / b\n")
TEXT = ("The lighthouse stood on the northern cape for two hundred years. Every night its keeper climbed the "
        "ninety steps, trimmed the wick and watched the ships pass between the rocks. When the storm of the "
        "winter came, the light burned until morning, and every boat of the fleet came home.")
CHATS = {
    "rewrite code": f"Rewrite this code exactly, but add the prefix my_ to every function name:\n\n{CODE}",
    "repeat text": f"Repeat this text word for word, but write 'harbour' instead of 'cape':\n\n{TEXT}",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the real SmolLM2-135M-Instruct)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)


def _answer(engine: Any, chat: str, max_tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    out = engine.generate([{"messages": [{"role": "user", "content": chat}], "params": params}])[0]
    return out.output_token_ids, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    from strata.stages.factory import build_engine
    from strata.pipeline.contract.config import EngineConfig

    if args.model is None:
        from strata.checkpoints.gguf_checkpoint import ensure_smollm2

        args.model = ensure_smollm2()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    engines = {"plain": build_engine(args.model, EngineConfig(dtype=args.dtype)),
               "ngram": build_engine(args.model, EngineConfig(dtype=args.dtype, speculative=spec))}
    print(f"# spec: {args.model.name} ({args.dtype}, {torch.get_num_threads()} threads), batch 1, greedy, "
          f"{args.max_tokens} tokens at most; speculative config {json.dumps(spec)}; medians of {args.rounds} "
          "interleaved rounds")
    for engine in engines.values():  # warm-up: first-call allocations are not what is compared
        _answer(engine, "Say hi.", 4)
    rows: dict[str, dict[str, float]] = {}
    for name, chat in CHATS.items():
        speeds: dict[str, list[float]] = {side: [] for side in engines}
        answers: dict[str, list[int]] = {}
        before = engines["ngram"].core.speculation.to_dict()
        for _ in range(args.rounds):
            for side, engine in engines.items():
                tokens, seconds = _answer(engine, chat, args.max_tokens)
                speeds[side].append(len(tokens) / seconds)
                answers[side] = tokens
        if answers["plain"] != answers["ngram"]:
            raise SystemExit(f"{name}: greedy answers differ with speculation on: the comparison is void")
        after = engines["ngram"].core.speculation.to_dict()
        drafted, accepted, steps = (after[k] - before[k] for k in ("drafted", "accepted", "verifications"))
        plain, ngram = statistics.median(speeds["plain"]), statistics.median(speeds["ngram"])
        rows[name] = {"tokens": len(answers["plain"]), "plain_tok_s": plain, "ngram_tok_s": ngram,
                      "speedup": ngram / plain, "acceptance": accepted / max(drafted, 1),
                      "tokens_per_verifying_step": (accepted + steps) / max(steps, 1)}
        r = rows[name]
        print(f"{name:<14} {r['tokens']:4d} tokens  plain {plain:6.1f} tok/s  ngram {ngram:6.1f} tok/s  "
              f"{r['speedup']:.2f}x  acceptance {r['acceptance']:.0%}  {r['tokens_per_verifying_step']:.2f} "
              "tokens/verifying step  (answers identical)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0
