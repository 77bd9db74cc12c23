"""Logits at every position of a token sequence from the engine's own model runner, and the perplexity they
give: what a teacher-forced comparison with a reference (numerics tests, `strata bench quant`) needs.

One prefill chunk over a freshly reserved block table (the prefix cache is not consulted), so the
logits are the model's on exactly these tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.scheduler import ScheduledChunk
from strata.pipeline.core.sequence import Sequence


def sequence_logits(engine: Any, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab] of an in-process engine's model at every position."""
    kv, runner = engine.kv, engine.core.runner
    seq = Sequence("teacher-forced", list(token_ids), SamplingParams(max_tokens=1), kv.layout.block_size)
    if not kv.reserve(seq.block_table, seq.num_tokens):
        raise ValueError(f"{seq.num_tokens} tokens do not fit the engine's device KV pool")
    try:
        t = seq.num_tokens
        meta = runner.executor.metadata(runner.prepare([ScheduledChunk(seq, 0, t)]), [None])
        ids = torch.tensor(seq.token_ids)
        meta.token_ids = ids  # DeepSeek-V4's hash-routed layers
        with torch.inference_mode():
            embeds = runner.model.embed(ids)
            hidden = runner.model.forward(embeds, torch.arange(t), kv.device_kv, meta, runner.backend)
            return runner.model.logits(hidden)
    finally:
        kv.free(seq.block_table)


def perplexity(engine: Any, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1.. given the ones before them."""
    logits = sequence_logits(engine, token_ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(token_ids[1:]))
    return float(torch.exp(nll))
