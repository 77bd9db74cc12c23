"""Which part of a decoder each rank of a tensor-parallel group holds: arithmetic on the config only
(no torch), shared by the sharded model, the weight loader and the memory planner.

Rank ``r`` of ``n`` holds q heads, KV heads, MLP columns, experts and vocab rows ``shard_range(...)``
of each; with more ranks than KV heads, each KV head is held by the ``n / heads`` ranks whose q
heads read it. A model that does not split ``n`` ways is refused with the dimension that does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Protocol


class DecoderShape(Protocol):
    """The dimensions of a decoder a plan splits (``models.model_config.TextConfig`` is one). A plan
    knows shapes, not models, so the group below the models never imports them."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    vocab_size: int
    attention_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The [start, stop) of part ``index`` when ``total`` items are split as evenly as possible."""
    return total * index // parts, total * (index + 1) // parts


_LAYER = re.compile(r"^layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_STACKED_EXPERTS = re.compile(r"^layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_CLASSIC_EXPERT = re.compile(r"^layers\.\d+\.mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class ShardingError(ValueError):
    """The model cannot be split ``tp`` ways; the message says which dimension does not divide."""


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of a ``size``-way group holds of a decoder with config ``cfg``."""

    cfg: DecoderShape
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.cfg, self.size
        if n < 1 or not 0 <= self.rank < n:
            raise ShardingError(f"rank {self.rank} is not in a group of {n}")
        checks = [("attention heads", c.num_heads)]
        if not c.num_experts:
            checks.append(("MLP intermediate size", c.intermediate_size))
        for what, value in checks:
            if value % n:
                raise ShardingError(f"tp={n} does not divide the model's {value} {what}")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ShardingError(f"tp={n} neither divides nor is a multiple of the model's {c.num_kv_heads} KV heads")
        if c.num_experts and c.num_experts < n:
            raise ShardingError(f"tp={n} exceeds the model's {c.num_experts} experts")

    # ------------------------------------------------------------ ranges
    @property
    def heads(self) -> tuple[int, int]:
        return shard_range(self.cfg.num_heads, self.size, self.rank)

    @property
    def kv_heads(self) -> tuple[int, int]:
        hkv, n = self.cfg.num_kv_heads, self.size
        if hkv >= n:
            return shard_range(hkv, n, self.rank)
        first = self.rank * hkv // n  # the KV head this rank's q heads read
        return first, first + 1

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless tp exceeds the KV heads)."""
        return max(1, self.size // self.cfg.num_kv_heads)

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

    def local_config(self) -> Any:
        """The config this rank's modules are built with (the router keeps every expert); the same
        dataclass type as ``cfg`` (a ``TextConfig`` for the models)."""
        c, n = self.cfg, self.size
        return replace(c, num_heads=c.num_heads // n, num_kv_heads=max(1, c.num_kv_heads // n),
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

    def padded_rows(self, name: str) -> int | None:
        """Rows a vocab shard is zero-padded to (every rank's logits then have one width for the
        gather; the padding columns are dropped after it); None for other tensors."""
        return self.padded_vocab if name in ("embed_tokens.weight", "lm_head.weight") else None

    def num_params(self) -> int:
        """Decoder parameters this rank holds (a vocab shard counts its padding rows)."""
        c, h, d = self.cfg, self.cfg.hidden_size, self.cfg.head_dim
        q = (self.heads[1] - self.heads[0]) * d
        kv = (self.kv_heads[1] - self.kv_heads[0]) * d
        attn = 2 * h * q + 2 * h * kv + (q + 2 * kv) * c.attention_bias + h * c.o_bias
        if c.num_experts:
            i = c.intermediate_size
            ffn = (self.experts[1] - self.experts[0]) * (3 * h * i + (2 * i + h) * c.mlp_bias) + c.num_experts * h
        else:
            i = self.intermediate[1] - self.intermediate[0]
            ffn = 3 * h * i + (2 * i + h) * c.mlp_bias
        embed = self.padded_vocab * h
        return embed * (1 if c.tie_word_embeddings else 2) + c.num_layers * (attn + ffn + 2 * h) + h


def largest_rank_params(cfg: DecoderShape, size: int) -> int:
    """The most decoder parameters any rank of a ``size``-way group holds (what sizes its device)."""
    return max(ShardPlan(cfg, r, size).num_params() for r in range(size))

