"""`vllm serve`'s flags on `strata serve`: each is honoured with vLLM's meaning, or refused in one line that
says why and what to use instead, so a deployment script written for vLLM either runs or stops at once with
a reason. ``FLAGS`` is the table the README prints and the tests hold every flag to."""

from __future__ import annotations

import argparse
import json
from typing import Any

# flag -> (status, what it does here); status "honoured" | "accepted" (Strata does it anyway) | "refused"
FLAGS: dict[str, tuple[str, str]] = {
    "--dtype auto/half/float16/bfloat16/float32": (
        "honoured", "auto: float32 on CPU (exact against transformers), bfloat16 on CUDA; half = float16 (CUDA)"),
    "--enable-prefix-caching / --no-enable-prefix-caching": ("honoured", "engine.enable_prefix_caching"),
    "--max-num-seqs N": ("honoured", "running sequences per stage (engine.max_num_seqs)"),
    "--max-num-batched-tokens N": ("honoured", "per-step token budget (engine.max_num_batched_tokens)"),
    "--enable-auto-tool-choice": ("accepted", "Strata reads tool calls whenever a request sends tools"),
    "--enable-tokenizer-info-endpoint": ("honoured", "serves GET /tokenizer_info: the tokenizer's configuration and "
                                                     "the chat template in use (behind --api-key like the rest)"),
    "--limit-mm-per-prompt": ("honoured", "image=N or {\"image\": N}: images per request "
                                          "(engine.max_images_per_request)"),
    "--chat-template FILE/TEMPLATE": ("honoured", "a file, or the Jinja template itself given inline"),
    "--reasoning-parser NAME": ("honoured", "deepseek_r1, qwen3, glm45, kimi_k2, minimax_m2 (<think> tags) or "
                                            "openai_gptoss (harmony channels): the thinking comes back as "
                                            "reasoning_content, apart from content"),
    "--served-model-name NAME [ALIAS ...]": (
        "honoured", "the model id clients send, then aliases it also answers to; by default a model given by "
                    "Hugging Face id is served as that id"),
    "--kv-cache-dtype auto/fp8/fp8_e4m3": ("honoured", "what the KV cache stores in every tier"),
    "--generation-config auto/vllm/FOLDER": (
        "honoured", "auto: the checkpoint's generation_config.json gives a request's default temperature, top_p, "
                    "top_k, repetition_penalty and max_tokens (its max_new_tokens); vllm: none; a folder: its file"),
    "--tensor-parallel-size N": ("honoured", "tensor-parallel ranks of every decoder stage"),
    "--speculative-config JSON": ("honoured", "ngram (prompt lookup) and mtp (the checkpoint's MTP layer, tp=1) speculation"),
    "--model-impl auto/vllm/transformers": (
        "honoured", "auto: Strata's model code where it has the architecture, else the transformers fallback "
                    "(transformers' modules, Strata's paged attention); vllm: Strata's code only; transformers: "
                    "the fallback (engine.model_impl)"),
    "--trust-remote-code": ("refused", "Strata runs no checkpoint code: it serves the architectures it implements "
                                       "and, on the transformers fallback, those transformers implements "
                                       "(`strata ops --model DIR` says whether it covers one)"),
    "--gpu-memory-utilization F": ("refused", "size the device KV pool with --kv-cache-memory (a size, or a share of "
                                              "what the weights leave free)"),
    "--pipeline-parallel-size N": ("refused", "N > 1: pipeline parallelism is not implemented; use "
                                              "--tensor-parallel-size"),
}


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """The vLLM flags ``strata serve`` takes beside its own (``--dtype``'s vLLM values are on its own flag)."""
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse cached prompt prefixes (engine.enable_prefix_caching; default on)")
    p.add_argument("--max-num-seqs", type=int, help="running sequences per stage (engine.max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, help="per-step token budget (engine.max_num_batched_tokens)")
    p.add_argument("--limit-mm-per-prompt", metavar="LIMITS",
                   help='images per request: image=N or {"image": N} (engine.max_images_per_request)')
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's scripts: Strata reads tool calls whenever a request sends tools")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true", default=None,
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat template; lm-eval's "
                        "remote tokenizer reads it)")
    p.add_argument("--trust-remote-code", action="store_true", help="refused: " + FLAGS["--trust-remote-code"][1])
    p.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                   help="refused: " + FLAGS["--gpu-memory-utilization F"][1])
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, metavar="N",
                   help="only 1: " + FLAGS["--pipeline-parallel-size N"][1])


def vllm_engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the vLLM flags ask for; a refused flag raises ValueError (one line)."""
    if getattr(args, "trust_remote_code", False):
        raise ValueError("--trust-remote-code: " + FLAGS["--trust-remote-code"][1])
    if getattr(args, "gpu_memory_utilization", None) is not None:
        raise ValueError("--gpu-memory-utilization: " + FLAGS["--gpu-memory-utilization F"][1])
    if (getattr(args, "pipeline_parallel_size", None) or 1) != 1:
        raise ValueError("--pipeline-parallel-size " + FLAGS["--pipeline-parallel-size N"][1])
    out = {key: value for key in ("enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens")
           if (value := getattr(args, key, None)) is not None}
    if getattr(args, "limit_mm_per_prompt", None) is not None:
        out["max_images_per_request"] = image_limit(args.limit_mm_per_prompt)
    return out


def image_limit(text: str) -> int:
    """vLLM's ``--limit-mm-per-prompt``: ``image=N`` or a JSON object; only images are served here."""
    try:
        limits = json.loads(text) if text.lstrip().startswith("{") else \
            dict((k.strip(), int(v)) for k, v in (item.split("=", 1) for item in text.split(",")))
    except (ValueError, TypeError):
        raise ValueError(f"--limit-mm-per-prompt: {text!r} is neither image=N nor a JSON object") from None
    other = sorted(k for k, v in limits.items() if k != "image" and v)
    if other:
        raise ValueError(f"--limit-mm-per-prompt: this server takes images only, not {', '.join(other)}")
    count = limits.get("image", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"--limit-mm-per-prompt: the image count must be an integer >= 0, got {count!r}")
    return count


def vllm_dtype(value: str | None) -> str | None:
    """``--dtype``: vLLM's auto (None: the device's default) and half (float16) onto the engine's names."""
    return {"auto": None, "half": "float16"}.get(value, value) if value is not None else None
