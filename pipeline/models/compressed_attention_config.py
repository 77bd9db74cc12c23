"""DeepSeek-V4's attention settings from its config: the sliding window, each layer's compression, the
lightning indexer, the grouped output projection, the mHC streams and the two RoPE bases.

Torch-free, like the other kinds: ``strata ops``, the planner and the cache groups read it without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.config_values import size

# a layer type's tokens per pooled entry: 0 for a sliding-only layer (``compress_rates`` may change the others)
LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_BY_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass(frozen=True)
class CompressedAttentionConfig:
    """Per layer a sliding window of ``window`` tokens of shared K=V (one head of ``head_dim``), plus pooled
    entries of ``compress[i]`` tokens each: CSA layers (``sparse[i]``) attend the top ``index_topk`` an indexer
    of ``index_heads`` x ``index_dim`` picks, HCA layers every entry. The residual is ``hc_mult`` streams."""

    head_dim: int
    rope_dim: int  # trailing dims of a head rotated, in interleaved pairs
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress: tuple[int, ...]  # per layer: 0 (sliding only) or tokens per entry
    sparse: tuple[bool, ...]  # per layer: CSA (entries over two windows, chosen by the indexer)
    index_heads: int
    index_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]  # per layer: experts fixed per token id (``tid2eid``)
    compress_rope: dict[str, Any]  # the compressed layers' and entries' RoPE ("main" is the text config's)

    @property
    def rates(self) -> tuple[int, ...]:
        """The distinct compression rates, ascending."""
        return tuple(sorted({c for c in self.compress if c}))

    def layers_at(self, rate: int) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.compress) if c == rate)

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        """The layers with pooled entries, by rate then layer: the order of their KV-layout layers."""
        return tuple(i for r in self.rates for i in self.layers_at(r))

    def projection_layer(self, layer: int) -> int:
        """The KV-layout layer of ``layer``'s per-token projections (after every layer's sliding KV)."""
        return len(self.compress) + self.compressed_layers.index(layer)

    def entry_layer(self, layer: int) -> int:
        """The KV-layout layer of ``layer``'s pooled entries (after every compressed layer's projections)."""
        return len(self.compress) + len(self.compressed_layers) + self.compressed_layers.index(layer)

    @property
    def indexed_layers(self) -> tuple[int, ...]:
        """The CSA layers, in the same order: each keeps its indexer's keys beside its entries."""
        return tuple(i for i in self.compressed_layers if self.sparse[i])

    def index_layer(self, layer: int) -> int:
        """The KV-layout layer of CSA layer ``layer``'s indexer keys (after every layer's entries)."""
        return len(self.compress) + 2 * len(self.compressed_layers) + self.indexed_layers.index(layer)

    def projection_window(self, rate: int) -> int:
        """Tokens of projections a step may pool from, counting its first row: the window before the one its
        first row is in (CSA), or that window only (HCA)."""
        return 2 * rate if self.is_sparse(rate) else rate

    def projection_width(self, rate: int) -> int:
        """Values a token keeps for a layer compressed ``rate``:1 until its windows close: value and gate, twice as
        wide on CSA (two series), plus the indexer's."""
        return 4 * self.head_dim + 4 * self.index_dim if self.is_sparse(rate) else 2 * self.head_dim

    def is_sparse(self, rate: int) -> bool:
        """The layers compressed ``rate``:1 are CSA (entries over two windows, chosen by an indexer)."""
        return any(s for c, s in zip(self.compress, self.sparse) if c == rate)

    def layer_params(self, layer: int, hidden: int, heads: int, ranks: int = 1) -> tuple[int, int]:
        """One layer's attention parameters on a rank of ``ranks`` holding ``heads`` q heads and their output
        groups (the rest is whole on every rank): (projections, the rest: norms, sinks, position biases)."""
        d, q = self.head_dim, self.q_lora_rank
        weights = (hidden * q + q * heads * d + hidden * d + heads * d * self.o_lora_rank
                   + self.o_groups // ranks * self.o_lora_rank * hidden)
        other = q + d + heads
        m = self.compress[layer]
        if m:
            width = 2 * d if self.sparse[layer] else d
            weights += 2 * hidden * width
            other += m * width + d
        if m and self.sparse[layer]:
            i = self.index_dim
            weights += 2 * hidden * 2 * i + q * self.index_heads * i + hidden * self.index_heads
            other += m * 2 * i + i
        return weights, other

    def hc_params(self, hidden: int) -> int:
        """The mHC weights: two blocks a layer, and the head that collapses the streams at the end."""
        n = self.hc_mult
        per_block = (2 + n) * n * (n * hidden + 1) + 3
        return 2 * len(self.compress) * per_block + n * n * hidden + n + 1


def resolve_compressed_attention(tc: dict[str, Any], layers: int) -> CompressedAttentionConfig:
    """DeepSeek-V4's keys (transformers' names, and the release's ``compress_ratios`` / ``num_hash_layers``)."""
    rates = {**{k: v for k, v in LAYER_TYPES.items() if v}, **(tc.get("compress_rates") or {})}
    types = tc.get("layer_types")
    if types is None and tc.get("compress_ratios") is not None:
        types = [_BY_RATIO.get(r, "?") for r in tc["compress_ratios"]]
    if types is None:
        types = ["heavily_compressed_attention"] * min(layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(layers - 2, 0))]
    types = list(types)[:layers]
    if len(types) != layers or set(types) - set(LAYER_TYPES):
        raise ModelConfigError(f"config.json: layer_types must be {layers} of {', '.join(LAYER_TYPES)}")
    compress = tuple(int(rates[t]) if LAYER_TYPES[t] else 0 for t in types)
    mlp_types = tc.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(tc.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    if len(mlp_types) < layers or set(mlp_types[:layers]) - {"hash_moe", "moe"}:
        raise ModelConfigError(f"config.json: mlp_layer_types must be {layers} of hash_moe / moe")
    head_dim = size(tc, "head_dim")
    factor = tc.get("partial_rotary_factor")
    rope_dim = int(head_dim * float(factor)) if factor else size(tc, "qk_rope_head_dim", 64)
    rope = tc.get("rope_parameters") or {}
    compress_rope = dict(rope["compress"]) if isinstance(rope.get("compress"), dict) else {
        "rope_type": "default", "rope_theta": float(tc.get("compress_rope_theta", 160000.0))}
    compress_rope.setdefault("partial_rotary_factor", rope_dim / head_dim)
    cfg = CompressedAttentionConfig(
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=size(tc, "q_lora_rank"), o_groups=size(tc, "o_groups"),
        o_lora_rank=size(tc, "o_lora_rank"), window=size(tc, "sliding_window"), compress=compress,
        sparse=tuple(t == "compressed_sparse_attention" for t in types), index_heads=size(tc, "index_n_heads"),
        index_dim=size(tc, "index_head_dim"), index_topk=size(tc, "index_topk"), hc_mult=size(tc, "hc_mult"),
        hc_sinkhorn_iters=size(tc, "hc_sinkhorn_iters", 20), hc_eps=float(tc.get("hc_eps", 1e-6)),
        hash_layers=tuple(t == "hash_moe" for t in mlp_types[:layers]), compress_rope=compress_rope)
    heads = size(tc, "num_attention_heads")
    if heads % cfg.o_groups:
        raise ModelConfigError(f"config.json: o_groups ({cfg.o_groups}) must divide num_attention_heads ({heads})")
    if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, cfg.index_dim):
        raise ModelConfigError(f"config.json: {rope_dim} rotated dims do not fit a head of {head_dim} and an indexer "
                               f"head of {cfg.index_dim}")
    return cfg
