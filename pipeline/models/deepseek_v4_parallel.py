"""DeepSeek-V4 over a tensor-parallel group: q heads and whole groups of the grouped output split, the rest whole.

A rank holds q heads ``[h0, h1)`` (rows of ``q_b_proj``, their sinks), the output groups those heads form (rows
of ``o_a_proj``, columns of ``o_b_proj``; tp must divide ``o_groups``), routed experts ``[e0, e1)`` whole and a
column slice of the shared expert, so attention's and the MoE's outputs are partial sums, one all-reduce each,
before they are spread over the mHC streams. Everything else is whole on every rank and computed alike: the q
LoRA, the one K=V head, the compressors and the indexer (so every rank pools the same entries and chooses the
same ones; their caches are replicated, as MLA's latent is), the mHC weights, the norms and the routers.
Embeddings and the LM head split the vocabulary as every tensor-parallel model does (``tensor_parallel``).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.pipeline.models.deepseek_v4 import V4DecoderLayer, V4LanguageModel
from strata.pipeline.models.moe import MoEExperts
from strata.pipeline.models.tensor_parallel import ParallelLanguageModel
from strata.pipeline.parallel.shard_plan import ShardPlan
from strata.pipeline.parallel.tp_group import TPGroup


class ParallelV4Layer(V4DecoderLayer):
    """A V4 layer over this rank's heads and experts; each block's partial output summed over the group."""

    group: TPGroup

    def sum_partial(self, partial: torch.Tensor) -> torch.Tensor:
        self.group.all_reduce(partial)
        return partial


class ParallelV4LanguageModel(V4LanguageModel):
    """This rank's shard of DeepSeek-V4. Logits come back whole on rank 0 only (None elsewhere)."""

    v4_layer_class = ParallelV4Layer
    embed = ParallelLanguageModel.embed  # vocab-parallel lookup, summed over the group
    logits = ParallelLanguageModel.logits  # gathered to the driver

    def __init__(self, plan: ShardPlan, group: TPGroup) -> None:
        local = plan.local_config()
        super().__init__(local)
        self.plan, self.group = plan, group
        self.vocab_start, self.vocab_stop = plan.vocab
        lo, hi = plan.experts
        for layer in self.layers:
            layer.group, layer.first_expert = group, lo
            layer.mlp.experts = MoEExperts(hi - lo, local.hidden_size, local.moe.intermediate_size)
            gate = layer.mlp.gate
            if gate.tid2eid is not None:  # a hash layer's table covers every token id, not this rank's vocab rows
                gate.tid2eid = nn.Parameter(torch.zeros(plan.cfg.vocab_size, gate.tid2eid.shape[1], dtype=torch.int64),
                                            requires_grad=False)
