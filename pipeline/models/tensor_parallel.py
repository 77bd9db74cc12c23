"""The decoder split over a tensor-parallel group, Megatron style, with Mixtral experts split whole.

One rank holds:

* attention: heads ``[h0, h1)`` of q and KV heads ``[k0, k1)`` of k/v (column-parallel, so its KV
  cache holds only those KV heads) and the matching input columns of ``o_proj`` (row-parallel);
* dense MLP: rows ``[i0, i1)`` of gate/up (column-parallel) and those columns of down (row-parallel);
* MoE: the router whole (every rank routes every token identically) and experts ``[e0, e1)`` whole;
* embedding and LM head: vocab rows ``[v0, v1)``, padded to one length so the logits gather evenly.

A layer's two row-parallel outputs (attention's projection, the MLP) are summed over the group
(one all-reduce each) before the residual add; a bias on them is added once, after the sum. Norms,
RoPE and the router are replicated. :class:`ShardPlan` says which slice of each checkpoint tensor a
rank reads, so the loader reads nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from strata.kernels import linear, moe_experts, moe_route, rms_norm
from strata.pipeline.model_config import TextConfig
from strata.pipeline.models.decoder import DecoderLayer, LanguageModel
from strata.pipeline.models.mlp import DenseMLP, MoEExperts
from strata.pipeline.tp_group import TPGroup, shard_range

_LAYER = re.compile(r"^layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_STACKED_EXPERTS = re.compile(r"^layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_CLASSIC_EXPERT = re.compile(r"^layers\.\d+\.mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class ShardingError(ValueError):
    """The model cannot be split ``tp`` ways; the message says which dimension does not divide."""


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of a ``size``-way group holds of a decoder with config ``cfg``."""

    cfg: TextConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.cfg, self.size
        if n < 1 or not 0 <= self.rank < n:
            raise ShardingError(f"rank {self.rank} is not in a group of {n}")
        checks = [("attention heads", c.num_heads), ("KV heads", c.num_kv_heads)]
        if not c.num_experts:
            checks.append(("MLP intermediate size", c.intermediate_size))
        for what, value in checks:
            if value % n:
                raise ShardingError(f"tp={n} does not divide the model's {value} {what}")
        if c.num_experts and c.num_experts < n:
            raise ShardingError(f"tp={n} exceeds the model's {c.num_experts} experts")

    # ------------------------------------------------------------ ranges
    @property
    def heads(self) -> tuple[int, int]:
        return shard_range(self.cfg.num_heads, self.size, self.rank)

    @property
    def kv_heads(self) -> tuple[int, int]:
        return shard_range(self.cfg.num_kv_heads, self.size, self.rank)

    @property
    def intermediate(self) -> tuple[int, int]:
        return shard_range(self.cfg.intermediate_size, self.size, self.rank)

    @property
    def experts(self) -> tuple[int, int]:
        return shard_range(self.cfg.num_experts, self.size, self.rank)

    @property
    def vocab(self) -> tuple[int, int]:
        return shard_range(self.cfg.vocab_size, self.size, self.rank)

    @property
    def padded_vocab(self) -> int:
        """Rows of every rank's embedding and LM head (the largest share; short shards are zero-padded)."""
        return -(-self.cfg.vocab_size // self.size)

    def local_config(self) -> TextConfig:
        """The config this rank's modules are built with (the router keeps every expert)."""
        c, n = self.cfg, self.size
        return replace(c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n,
                       intermediate_size=c.intermediate_size if c.num_experts else c.intermediate_size // n,
                       vocab_size=self.padded_vocab)

    # ------------------------------------------------------------ checkpoint slices
    def slice_for(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the checkpoint tensor ``name`` (our module's name) this rank reads;
        None when it reads the tensor whole (norms, router, row-parallel biases)."""
        d = self.cfg.head_dim
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab)
        m = _STACKED_EXPERTS.match(name)
        if m:
            return (0, *self.experts)
        m = _LAYER.match(name)
        if m is None:
            return None
        proj, kind = m.group(2), m.group(3)
        rows = {"q_proj": self.heads, "k_proj": self.kv_heads, "v_proj": self.kv_heads}
        if proj in rows:
            lo, hi = rows[proj]
            return (0, lo * d, hi * d)
        if proj == "o_proj":
            return (1, self.heads[0] * d, self.heads[1] * d) if kind == "weight" else None
        if proj in ("gate_proj", "up_proj"):
            return (0, *self.intermediate)
        if proj == "down_proj":
            return (1, *self.intermediate) if kind == "weight" else None
        return None

    def expert_of(self, name: str) -> int | None:
        """The global expert a classic per-expert tensor (``…experts.N.w1.weight``) belongs to."""
        m = _CLASSIC_EXPERT.match(name)
        return int(m.group(1)) if m else None

    def holds_expert(self, expert: int) -> bool:
        lo, hi = self.experts
        return lo <= expert < hi

    def fit(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Zero-pad a short vocab shard to :attr:`padded_vocab` rows (so every rank's logits have one
        width for the gather; the padding columns are dropped after it)."""
        if name in ("embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < self.padded_vocab:
            pad = torch.zeros(self.padded_vocab - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
            return torch.cat([tensor, pad])
        return tensor


class ParallelDecoderLayer(DecoderLayer):
    """One decoder layer over this rank's heads, MLP columns or experts; sums the partial outputs."""

    group: TPGroup
    first_expert: int = 0

    def forward(self, x, cos, sin_signed, kv, meta, backend, steps) -> torch.Tensor:
        a, ln1, ln2, mlp = self.self_attn, self.input_layernorm, self.post_attention_layernorm, self.mlp
        if a.qkv_weight is None:
            a.fuse()
        q, k, v = steps.qkv_rope(x, ln1.weight, ln1.eps, a.qkv_weight, a.qkv_bias, cos, sin_signed,
                                 a.num_heads, a.num_kv_heads, a.head_dim)
        attn = a.attend(q, k, v, kv, meta, backend)
        x = x + self._reduce(linear(attn.reshape(x.shape[0], -1), a.o_proj.weight), a.o_proj.bias)
        h = rms_norm(x, ln2.weight, ln2.eps)
        if isinstance(mlp, DenseMLP):
            if mlp.gate_up_weight is None:
                mlp.fuse()
            gate, up = linear(h, mlp.gate_up_weight, mlp.gate_up_bias).chunk(2, dim=-1)
            out = linear(F.silu(gate) * up, mlp.down_proj.weight)
            return x + self._reduce(out, mlp.down_proj.bias)
        weights, ids = moe_route(F.linear(h, mlp.gate.weight), mlp.top_k)
        out = moe_experts(h, mlp.experts.gate_up_proj, mlp.experts.down_proj, weights, ids, self.first_expert)
        return x + self._reduce(out, None)

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
        for layer in self.layers:
            layer.group = group
            if plan.cfg.num_experts:
                lo, hi = plan.experts
                layer.first_expert = lo
                layer.mlp.experts = MoEExperts(replace(local, num_experts=hi - lo))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its range (zeros elsewhere), summed."""
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_stop)
        local = torch.where(mine, token_ids - self.vocab_start, torch.zeros_like(token_ids))
        out = self.embed_tokens(local) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.group.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.gather_to_driver(linear(hidden, self.lm_head.weight))
        if parts is None:
            return None
        v, n = self.plan.cfg.vocab_size, self.plan.size
        widths = [hi - lo for lo, hi in (shard_range(v, n, r) for r in range(n))]
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=-1).float()
