"""`strata eval ppl --model DIR --text FILE`: perplexity in Strata next to transformers' on the same
checkpoint, the seeds' "model level" check as one command (``align`` is the numerical level, ``smoke`` the
functional one).

Both sides score the same token ids (the checkpoint's tokenizer on the text, cut to ``--max-tokens``):
Strata through its engine's prompt logprobs (``pipeline.core.prompt_logprobs``: a chunked prefill, the
first token unscored), transformers by one forward in the same dtype. It prints both perplexities and their
ratio and exits 1 when the ratio (either way) passes ``--threshold`` (1.01 in fp32). ``--save-reference``
keeps transformers' figure with a digest of the ids and the weights, and ``--reference`` compares with it:
a platform without transformers' model classes, or a quantized checkpoint, is checked against a figure
taken where the reference ran (on the exactly dequantized weights, say).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

from strata.commands import CLIError

THRESHOLDS = {"float32": 1.01, "bfloat16": 1.05}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (or a .gguf file)")
    p.add_argument("--text", type=Path, required=True, help="a UTF-8 text file to score")
    p.add_argument("--dtype", choices=tuple(THRESHOLDS), default="float32", help="compute dtype of both sides")
    p.add_argument("--max-tokens", type=int, default=1024, help="score at most this many tokens of the text")
    p.add_argument("--chunk", type=int, default=256, help="Strata's prefill chunk in tokens")
    p.add_argument("--threshold", type=float, default=None,
                   help="largest allowed ratio of the two perplexities (default: 1.01 in fp32, 1.05 in bf16)")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--no-reference", action="store_true", help="Strata's perplexity alone (exit 0)")
    ref.add_argument("--reference", type=Path, help="compare with a figure saved by --save-reference")
    ref.add_argument("--save-reference", type=Path, help="also save transformers' figure here")
    p.add_argument("--json", type=Path, help="also write the result here")


def token_ids(model_dir: Path, text: str, limit: int) -> list[int]:
    """The checkpoint tokenizer's ids of the text (its BOS as it adds one), at most ``limit``."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"][:limit]
    if len(ids) < 2:
        raise CLIError("the text is shorter than two tokens: nothing to score")
    return ids


def strata_nll(model_dir: Path, ids: list[int], dtype: str, chunk: int) -> float:
    """Mean negative log-likelihood of ids[1:] given what precedes each, from Strata's engine."""
    from strata.offline import load_engine
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.sampling_params import SamplingParams

    config = EngineConfig(dtype=dtype, prefill_chunk_tokens=chunk, max_model_len=max(len(ids) + 1, 16))
    engine = load_engine(model_dir, config)
    try:
        out = engine.generate([{"prompt_token_ids": ids, "params": SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0)}])[0]
    finally:
        engine.close()
    if out.error is not None:
        raise CLIError(f"Strata could not score the text: {out.error}")
    return -sum(p.logprob for p in out.prompt_logprobs) / len(out.prompt_logprobs)


def transformers_nll(model_dir: Path, ids: list[int], dtype: str, gguf: Path | None) -> float:
    """The same figure from transformers, one forward in ``dtype`` (a GGUF read by transformers itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name} if gguf else {
        "pretrained_model_name_or_path": model_dir}
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return float(-lp.mean())


def _ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def run(args: argparse.Namespace) -> int:
    from strata.pipeline.models.model_identity import weights_content_digest

    gguf = args.model if args.model.suffix == ".gguf" else None
    if gguf is not None:
        from strata.pipeline.models.model_source import resolve_model_dir

        args.model = resolve_model_dir(gguf)
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read --text {args.text.name}: {exc.__class__.__name__}") from None
    ids = token_ids(args.model, text, args.max_tokens)
    ours = strata_nll(args.model, ids, args.dtype, args.chunk)
    result = {"tokens_scored": len(ids) - 1, "dtype": args.dtype, "strata_ppl": math.exp(ours)}
    print(f"# strata eval ppl: {len(ids) - 1} tokens of {args.text.name}, {args.dtype}")
    print(f"strata        perplexity {math.exp(ours):.6f}")
    if args.no_reference:
        _write(args.json, result)
        return 0
    if args.reference is not None:
        saved = json.loads(args.reference.read_text())
        if saved.get("ids") != _ids_digest(ids) or saved.get("dtype") != args.dtype:
            raise CLIError(f"{args.reference.name} scored other tokens or another dtype: save it again for these")
        ref, source = float(saved["nll"]), f"saved reference {args.reference.name}"
        if saved.get("weights") != weights_content_digest(args.model):
            print("# note: the reference was taken from different weights than these")
    else:
        ref, source = transformers_nll(args.model, ids, args.dtype, gguf), "transformers"
        if args.save_reference is not None:
            args.save_reference.write_text(json.dumps({"nll": ref, "ids": _ids_digest(ids), "dtype": args.dtype,
                                                       "weights": weights_content_digest(args.model)}))
    ratio = math.exp(ours - ref)
    threshold = args.threshold or THRESHOLDS[args.dtype]
    ok = max(ratio, 1 / ratio) <= threshold
    print(f"{source:13} perplexity {math.exp(ref):.6f}")
    print(f"ratio {ratio:.6f} (threshold {threshold}): {'PASS' if ok else 'FAIL'}")
    _write(args.json, {**result, "reference_ppl": math.exp(ref), "ratio": ratio, "pass": ok})
    return 0 if ok else 1


def _write(path: Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1))
