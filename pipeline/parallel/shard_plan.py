"""Which part of a decoder each rank of a tensor-parallel group holds: arithmetic on the config only
(no torch), shared by the sharded model, the weight loader and the memory planner.

Rank ``r`` of ``n`` holds q heads, KV heads, MLP columns, routed experts, shared-expert columns and
vocab rows ``shard_range(...)`` of each; with more ranks than KV heads, each KV head is held by the
``n / heads`` ranks whose q heads read it. MLA splits its heads the same way (rows of ``q_b_proj`` and
``kv_b_proj``, columns of ``o_proj``) and replicates the latent: every rank holds the whole compressed
KV, as vLLM does, because the latent is shared by all heads and is small. A model that does not split
``n`` ways is refused with the dimension that does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Protocol

from strata.pipeline.parallel.linear_shards import LinearShards
from strata.pipeline.parallel.shard_range import shard_range


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
    qk_norm: bool
    qk_norm_over_heads: bool  # the q/k norm weights are as wide as q and k (split with their heads)
    sinks: bool  # a learned softmax logit per q head (gpt-oss)
    mla: Any  # MLAConfig | None: q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    attention: Any  # AttentionKind: which heads each attention tensor follows (``split``) and its ``params``
    moe: Any  # MoEConfig | None: num_experts, intermediate_size, router, n_shared_experts, shared_split,
    # expert_bias
    moe_layers: tuple[bool, ...]
    linear: Any  # GatedDeltaNetConfig | None: the linear-attention layers' geometry and ``params``
    linear_layers: tuple[bool, ...]  # which layers are linear attention (Qwen3-Next); () for none
    compressed: Any  # CompressedAttentionConfig | None: DeepSeek-V4's attention (its output groups split)

    @property
    def kv_cache_heads(self) -> int: ...


_LAYER = re.compile(r"^layers\.\d+\.(self_attn|mlp|mlp\.shared_experts)\.(\w+)\.(weight|bias)$")
_MIXER = re.compile(r"^layers\.(\d+)\.(?:self_attn|linear_attn)\.(.+)$")  # a layer's token mixer, any tensor
_STACKED_EXPERTS = re.compile(r"^layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_SINKS = re.compile(r"^layers\.\d+\.self_attn\.sinks$")
_V4_OUTPUT = re.compile(r"^layers\.\d+\.self_attn\.(o_a_proj|o_b_proj|q_b_proj)\.weight$")
_CLASSIC_EXPERT = re.compile(r"^layers\.\d+\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


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
        if c.linear is not None:  # a rank holds whole key heads and the value heads they serve
            checks.append(("linear-attention key heads", c.linear.num_k_heads))
        if c.compressed is not None:  # V4: a rank holds whole groups of its output projection
            checks.append(("output projection groups", c.compressed.o_groups))
            if n > 1 and c.compressed.o_groups * c.compressed.o_lora_rank % c.num_heads:
                raise ShardingError(f"tp={n}: the output projection's {c.compressed.o_groups} x "
                                    f"{c.compressed.o_lora_rank} rows do not split evenly over {c.num_heads} heads")
        if not all(c.moe_layers) or not c.num_experts:
            checks.append(("MLP intermediate size", c.intermediate_size))
        if c.moe is not None and c.moe.n_shared_experts:
            checks.append(("shared-expert intermediate size", c.moe.shared_total))
        for what, value in checks:
            if value % n:
                raise ShardingError(f"tp={n} does not divide the model's {value} {what}")
        hkv = c.kv_cache_heads
        if hkv % n and n % hkv:
            raise ShardingError(f"tp={n} neither divides nor is a multiple of the model's {hkv} KV heads")
        if c.num_experts and c.num_experts < n:
            raise ShardingError(f"tp={n} exceeds the model's {c.num_experts} experts")

    # ------------------------------------------------------------ ranges
    @property
    def heads(self) -> tuple[int, int]:
        return shard_range(self.cfg.num_heads, self.size, self.rank)

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The cached heads this rank holds (MLA caches one latent "head": every rank holds it)."""
        hkv, n = self.cfg.kv_cache_heads, self.size
        if hkv >= n:
            return shard_range(hkv, n, self.rank)
        first = self.rank * hkv // n  # the KV head this rank's q heads read
        return first, first + 1

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless tp exceeds the KV heads; every rank for MLA's latent)."""
        return max(1, self.size // self.cfg.kv_cache_heads)

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
        moe = replace(c.moe, shared_split=n) if c.moe is not None else None
        kv_heads = c.num_heads // n if c.mla is not None else max(1, c.num_kv_heads // n)
        linear = self.linear_shards.local() if self.linear_shards is not None else None
        extra = {"compressed": replace(c.compressed, o_groups=c.compressed.o_groups // n)} if c.compressed else {}
        return replace(c, num_heads=c.num_heads // n, num_kv_heads=kv_heads, intermediate_size=c.intermediate_size // n,
                       vocab_size=self.padded_vocab, moe=moe, linear=linear, **extra)

    @property
    def linear_shards(self) -> LinearShards | None:
        """This rank's part of the linear-attention layers and their state; None without them."""
        return LinearShards(self.cfg.linear, self.rank, self.size) if self.cfg.linear is not None else None

    # ------------------------------------------------------------ checkpoint slices
    def cut_for(self, name: str) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        """(dim, ranges) of the checkpoint tensor ``name`` (our module's name) this rank reads, the ranges
        concatenated in order (a linear-attention layer's q|k|v parts are three); None: read whole."""
        inner = self._linear_tensor(name)
        if inner is not None:
            return self.linear_shards.cut(inner)
        one = self.slice_for(name)
        return None if one is None else (one[0], (one[1:],))

    def slice_for(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the checkpoint tensor ``name`` (our module's name) this rank reads;
        None when it reads the tensor whole (norms, router, row-parallel biases, MLA's latent projections).
        A tensor read in several ranges (:meth:`cut_for`) is refused."""
        c = self.cfg
        inner = self._linear_tensor(name)
        if inner is not None:
            cut = self.linear_shards.cut(inner)
            if cut is not None and len(cut[1]) > 1:
                raise ShardingError(f"{name} is split in {len(cut[1])} ranges: it is not read as one slice")
            return None if cut is None else (cut[0], *cut[1][0])
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab)
        m = _STACKED_EXPERTS.match(name)
        if m:
            return (0, *self.experts)
        if _SINKS.match(name):
            return self._attention_slice("sinks", "weight")
        m = _V4_OUTPUT.match(name)
        if m and c.compressed is not None:  # V4's q heads and whole output groups
            return self._attention_slice(m.group(1), "weight")
        m = _LAYER.match(name)
        if m is None:
            return None
        block, proj, kind = m.group(1), m.group(2), m.group(3)
        if block == "mlp.shared_experts":
            shared = shard_range(c.moe.shared_total, self.size, self.rank)
            if proj in ("gate_proj", "up_proj"):
                return (0, *shared)
            return (1, *shared) if proj == "down_proj" and kind == "weight" else None
        if block == "self_attn":
            return self._attention_slice(proj, kind)
        if proj in ("gate_proj", "up_proj"):
            return (0, *self.intermediate)
        if proj == "down_proj":
            return (1, *self.intermediate) if kind == "weight" else None
        return None

    def _linear_tensor(self, name: str) -> str | None:
        """The name inside its layer of a linear-attention layer's tensor; None for any other tensor."""
        m = _MIXER.match(name)
        if m is None or self.cfg.linear is None:
            return None
        layer = int(m.group(1))
        return m.group(2) if layer < len(self.cfg.linear_layers) and self.cfg.linear_layers[layer] else None

    def _attention_slice(self, proj: str, kind: str) -> tuple[int, int, int] | None:
        """The attention kind says which heads a tensor follows and how wide each is (``AttentionKind.split``)."""
        split = self.cfg.attention.split(self.cfg, proj, kind)
        if split is None:
            return None
        dim, follows, per_head = split
        lo, hi = self.heads if follows == "q" else self.kv_heads
        return (dim, lo * per_head, hi * per_head)

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
        return sum(self.params_by_role().values())

    def params_by_role(self) -> dict[str, int]:
        """This rank's parameters by what they are, so each role can be sized in its stored format:
        ``attention`` (q/k/v/o or MLA's projections but ``kv_b_proj``), ``kv_b_proj``, ``dense_mlp``,
        ``experts`` (routed), ``shared_experts``, ``router`` (scores and bias), ``embed``, ``lm_head``, and
        ``other`` (norms and biases)."""
        c, h = self.cfg, self.cfg.hidden_size
        heads = self.heads[1] - self.heads[0]
        moe_layers = sum(c.moe_layers) if c.num_experts else 0
        dense_layers = c.num_layers - moe_layers
        dense_i = self.intermediate[1] - self.intermediate[0]
        roles = dict.fromkeys(("attention", "kv_b_proj", "dense_mlp", "experts", "shared_experts", "router", "embed",
                               "lm_head", "other"), 0)
        attention, kv_b, attention_other = c.attention.params(c, heads, self.kv_heads[1] - self.kv_heads[0])
        linear = sum(c.linear_layers)  # Gated DeltaNet layers (Qwen3-Next): their own parameters
        full = c.num_layers - linear
        roles["attention"], roles["kv_b_proj"] = full * attention, full * kv_b
        roles["attention"] += linear * self.linear_shards.local().params(h) if linear else 0
        if c.dsa is not None:  # DSA's indexer, whole on every rank (DeepSeek-V3.2)
            roles["attention"] += c.index_layers * c.dsa.params(h, c.mla.q_lora_rank)
        roles["other"] = full * attention_other + c.num_layers * 2 * h + h  # two norms a layer, the final norm
        if c.compressed is not None:  # DeepSeek-V4: each layer's own kind of attention, and the mHC streams
            per_layer = [c.compressed.layer_params(i, h, heads, self.size) for i in range(c.num_layers)]
            roles["attention"] = sum(w for w, _ in per_layer)
            roles["other"] = sum(o for _, o in per_layer) + c.num_layers * 2 * h + h + c.compressed.hc_params(h)
        roles["dense_mlp"] = dense_layers * 3 * h * dense_i
        roles["other"] += dense_layers * (2 * dense_i + h) * c.mlp_bias
        if moe_layers:
            e, ie = self.experts[1] - self.experts[0], c.moe.intermediate_size
            roles["experts"] = moe_layers * e * 3 * h * ie
            roles["other"] += moe_layers * e * (2 * ie + h) * (c.mlp_bias or c.moe.expert_bias)
            roles["router"] = moe_layers * (c.moe.router.params(c.num_experts, h) + h * c.moe.shared_gate)
            if c.compressed is not None:  # a hash layer's router has no correction bias (its choice is a table)
                roles["router"] -= sum(c.compressed.hash_layers) * c.num_experts
            shared = c.moe.shared_total
            roles["shared_experts"] = moe_layers * 3 * h * (shared // self.size)
        roles["embed"] = self.padded_vocab * h
        roles["lm_head"] = 0 if c.tie_word_embeddings else self.padded_vocab * h
        return roles


def largest_rank_params(cfg: DecoderShape, size: int) -> int:
    """The most decoder parameters any rank of a ``size``-way group holds (what sizes its device)."""
    return max(ShardPlan(cfg, r, size).num_params() for r in range(size))

