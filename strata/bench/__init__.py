"""`strata bench ...`: benchmarks that compare Strata with a reference side by side in one run.

Each module measures one room from above it: ``offline`` (engine vs transformers), ``tiers``
(the tiered KV store), ``serve_overhead`` (the Serve path vs the in-process engine), ``soak``
(a long mixed run: memory and KV back to baseline), ``cross_node`` (KV hand-off between two
Ray nodes vs recompute), ``tensor_parallel`` (a tp group vs one process on the same cores), ``mla`` (MLA
decode, absorbed vs expanded), ``mixed_step`` (one forward per step vs decode-then-prefill), ``vision``
(native-resolution images: the encoder's packed batch vs one by one, TTFT by image count), ``structured``
(the sampler's step with grammar-constrained rows), ``speculative`` (prompt lookup vs plain decoding), ``mtp_cost``
(an MTP draft's cost per step, and the acceptance at which it pays), ``linear_attention`` (a hybrid's decode
against context, Gated DeltaNet against full attention), ``sparse_attention`` (DSA over contexts past the device
tier: what a decode step reads, and from where), ``flow`` (a real server's request flow, traced: bytes and
time per hop), ``quant`` (one model in every weight format: bytes, decode and prefill), ``quant_linear`` (one
quantized linear: the CPU kernels vs tiles vs fp32), ``fallback`` (the transformers fallback vs Strata's own
model code); ``serve`` is
the HTTP load generator in
``loadtest``.
"""

from __future__ import annotations

import argparse

from strata.commands import register


def add_bench_commands(bench: argparse._SubParsersAction) -> None:
    """Register the bench subcommands; each module is imported when its command is parsed for."""
    from strata.bench import (cross_node, fallback, flow, linear_attention, mixed_step, mla, mtp_cost, offline, quant,
                              quant_linear, serve_overhead, soak, sparse_attention, speculative, structured,
                              tensor_parallel, tiers, vision, vs_vllm)
    from strata.loadtest import bench as load_bench

    commands = (
        ("offline", "engine vs transformers generate, and cached-prefix prefill", offline),
        ("kv", "tiered KV store: TTFT per tier, decode vs context, largest context", tiers),
        ("serve-overhead", "TTFT and ITL through the Serve path vs the in-process engine", serve_overhead),
        ("cross-node", "prefill->decode hand-off between two Ray nodes: pulled blocks vs recompute", cross_node),
        ("tp", "a tensor-parallel group vs one process on the same cores: decode tok/s, TTFT, comm share",
         tensor_parallel),
        ("step", "one forward per step (decodes + prefill chunks) vs the decode-then-prefill pair it replaced",
         mixed_step),
        ("vision", "images of 100s-1000s of tokens: encoder batch vs one by one, TTFT by image count, a repeated "
         "image", vision),
        ("structured", "the sampler's step with 0, 1 and all of 32 rows constrained by a JSON schema", structured),
        ("flow", "a real server's request flow, traced: bytes each way and time per hop, text to 8 images", flow),
        ("quant", "one model as fp32, bf16, FP8 blocks, INT4 groups and MXFP4: resident bytes, decode and prefill "
         "tok/s", quant),
        ("quant-linear", "one quantized linear on the CPU: the engine's kernels vs dequantized tiles vs fp32 F.linear, "
         "by rows of x", quant_linear),
        ("fallback", "the transformers fallback vs Strata's own model code on a Llama and a Qwen3-MoE: decode and "
         "prefill tok/s, identical greedy answers", fallback),
        ("spec", "prompt-lookup speculative decoding vs plain decoding on a real model: tok/s at batch 1, "
         "acceptance, identical greedy answers", speculative),
        ("mtp", "MTP drafts vs plain decoding on a tiny DeepSeek-V3: a step's cost ratio and the acceptance at which "
         "MTP pays, identical greedy answers", mtp_cost),
        ("linear", "linear attention in a hybrid: decode TPOT against context, a layer's decode step against full "
         "attention, chunked prefill against transformers, memory per sequence at 128K and 1M", linear_attention),
        ("sparse", "sparse attention (DSA, DeepSeek-V4) over contexts far past the device tier: decode TPOT, bytes "
         "read per step from the device and the host tier, the share of spilled blocks touched; or decode tok/s "
         "by batch size (--decode-batches)", sparse_attention),
        ("mla", "one MLA decode step: weight-absorbed latent attention vs the expanded form, 4K and 32K", mla),
        ("soak", "a long mixed run with disconnects: RSS per replica and KV blocks back to baseline", soak),
        ("serve", "load a running server: throughput, TTFT/TPOT/ITL/E2EL, goodput, plots", load_bench),
        ("vs-vllm", "strata serve and vllm serve on one checkpoint, loaded by vllm bench serve at each concurrency",
         vs_vllm),
    )
    register(bench, commands)
