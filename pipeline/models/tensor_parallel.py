"""The decoder split over a tensor-parallel group, Megatron style, with routed experts split whole.

One rank holds:

* attention: heads ``[h0, h1)`` of q and KV heads ``[k0, k1)`` of k/v (column-parallel, so its KV
  cache holds only those KV heads) and the matching input columns of ``o_proj`` (row-parallel).
  With more ranks than KV heads (tp = 32 on 8 KV heads, say) each KV head is held by tp / heads
  ranks, the ones whose q heads read it (as vLLM does). MLA: heads ``[h0, h1)`` of ``q_b_proj``,
  ``kv_b_proj`` and ``o_proj``; the latent projection whole, so every rank caches the whole latent;
* dense MLP: rows ``[i0, i1)`` of gate/up (column-parallel) and those columns of down (row-parallel);
* MoE: the router whole (every rank routes every token identically), experts ``[e0, e1)`` whole and
  a column slice of the shared experts, so routed and shared partial outputs share one all-reduce;
* embedding and LM head: vocab rows ``[v0, v1)``, padded to one length so the logits gather evenly.

A q/k norm over every head (MiniMax-M2) holds this rank's columns of its weight and sums its squares over
the group (one small all-reduce each for q and k). A layer's two row-parallel outputs (attention's projection, the MLP) are summed over the group
(one all-reduce each) before the residual add; a bias on them is added once, after the sum. Norms,
RoPE and the router are replicated. A linear-attention layer (Gated DeltaNet, KDA) holds whole key heads and
the value heads they serve, with their part of every sequence's state (``parallel.linear_shards``), and sums
only its ``out_proj``, like attention's ``o_proj``. ``pipeline.shard_plan.ShardPlan`` says which slice of each
checkpoint tensor a rank reads, so the loader reads nothing else.
"""

from __future__ import annotations


import torch

from strata.kernels import linear, rms_norm
from strata.kernels.layer_ops import silu_mul
from strata.pipeline.models.decoder import DecoderLayer, LanguageModel
from strata.pipeline.models.mlp import DenseMLP
from strata.pipeline.models.moe import MoEExperts
from strata.pipeline.parallel.fault_points import fault_point
from strata.pipeline.parallel.shard_plan import ShardPlan, shard_range
from strata.pipeline.parallel.tp_group import TPGroup


class ParallelDecoderLayer(DecoderLayer):
    """One decoder layer over this rank's heads, MLP columns or experts; sums the partial outputs."""

    group: TPGroup
    first_expert: int = 0

    def forward(self, x, cos, sin_signed, kv, meta, backend, steps) -> torch.Tensor:
        a, ln2, mlp = self.mixer, self.post_attention_layernorm, self.mlp
        attn = self.attention(x, cos, sin_signed, kv, meta, backend, steps)  # this rank's heads
        x = x + self._reduce(linear(attn.reshape(x.shape[0], -1), a.o_proj.weight), a.o_proj.bias)
        fault_point("tp_layer", self.group.rank)  # mid-step: between one layer's two all-reduces
        h = rms_norm(x, ln2.weight, ln2.eps)
        if isinstance(mlp, DenseMLP):
            if mlp.gate_up_weight is None:
                mlp.fuse()
            out = linear(silu_mul(linear(h, mlp.gate_up_weight, mlp.gate_up_bias)), mlp.down_proj.weight)
            return x + self._reduce(out, mlp.down_proj.bias)
        return x + self._reduce(mlp.forward(h, self.first_expert), None)

    def _reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.group.all_reduce(partial)
        return partial if bias is None else partial + bias


class ParallelLanguageModel(LanguageModel):
    """This rank's shard of the decoder. Logits come back whole on rank 0 only (None elsewhere)."""

    layer_class = ParallelDecoderLayer

    def __init__(self, plan: ShardPlan, group: TPGroup) -> None:
        local = plan.local_config()
        super().__init__(local)
        self.plan = plan
        self.group = group
        self.vocab_start, self.vocab_stop = plan.vocab
        c = plan.cfg
        for index, layer in enumerate(self.layers):
            layer.group = group
            layer.mixer.join_group(c, group.all_reduce, plan.kv_replicas)
            if plan.cfg.is_moe_layer(index):
                lo, hi = plan.experts
                layer.first_expert = lo
                layer.mlp.experts = MoEExperts(hi - lo, local.hidden_size, local.moe.intermediate_size,
                                               local.moe.expert_bias)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its range (zeros elsewhere), summed."""
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_stop)
        local = torch.where(mine, token_ids - self.vocab_start, torch.zeros_like(token_ids))
        rows = self.embed_tokens(local)
        out = rows * mine.unsqueeze(-1).to(rows.dtype)
        return self.group.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.gather_to_driver(linear(hidden, self.lm_head.weight))
        if parts is None:
            return None
        v, n = self.plan.cfg.vocab_size, self.plan.size
        widths = [hi - lo for lo, hi in (shard_range(v, n, r) for r in range(n))]
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=-1).float()
