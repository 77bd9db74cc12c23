"""Attention kinds: how a layer's attention is parameterised, one object per kind.

A kind knows everything about its attention that is not arithmetic on tensors: the config keys it reads
(``resolve``), how a tensor-parallel group splits its tensors (``split``), its parameter count
(``params``) and its line in ``strata ops`` (``describe``). The torch module that computes a kind is
found by its ``module`` in one table (``models.decoder.ATTENTION_MODULES``), so a new attention is one
object here, its module there (if its arithmetic is new) and the families that use it. Like
``router_kinds``, this module stays torch-free: bring-up, the shard plan and the planner read it without
building a model, and it never imports the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.config_values import checked_size, size


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): K and V live as one compressed latent."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the compressed KV and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): ``n_heads`` small heads of ``head_dim``
    score every cached token for each query (ReLU-gated dot products, weighted per head), and MLA attends
    only over the ``topk`` best. Each token caches one indexer key of ``head_dim`` values beside its latent."""

    n_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False  # its RoPE dims in (x0, x1), (x2, x3) pairs (GLM-5), else the two halves (V3.2)
    shared: tuple[bool, ...] = ()  # per layer: reuses the previous indexer layer's top-k, has none (GLM-5)

    def runs_indexer(self, layer: int) -> bool:
        return not (self.shared and self.shared[layer])

    def params(self, hidden: int, q_lora_rank: int) -> int:
        """One layer's indexer: wq_b (from the q LoRA), wk, its LayerNorm (weight and bias), weights_proj."""
        return q_lora_rank * self.n_heads * self.head_dim + hidden * self.head_dim + 2 * self.head_dim + hidden * self.n_heads


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Linear attention with a gated delta rule: per sequence a fixed-size state, no per-token KV. Gated
    DeltaNet (Qwen3-Next, Qwen3.5): each key head serves ``num_v_heads // num_k_heads`` value heads, one
    decay per head and token. KDA (Kimi-Linear, ``kda``): as many key as value heads of one width, a decay
    per key channel. Either way the causal convolution runs over q, k and v together (``conv_dim`` channels)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    split_projections: bool = False  # Qwen3.5: in_proj_qkv / _z / _b / _a; Qwen3-Next: per key head in _qkvz / _ba
    kda: bool = False  # Kimi Delta Attention: q/k/v projections and convolutions apart, low-rank decay and gate

    @property
    def name(self) -> str:
        return "KDA (Kimi Delta Attention)" if self.kda else "Gated DeltaNet"

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def params(self, hidden: int) -> int:
        """One layer's parameters. Gated DeltaNet: in_proj_qkvz and _ba, the convolution, A_log and dt_bias,
        the gated norm, out_proj. KDA: q/k/v_proj and their convolutions, the decay's f_a/f_b_proj, dt_bias
        and A_log, b_proj, the gate's g_a/g_b_proj, the gated norm, o_proj."""
        nk, nv, dk, dv = self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim
        if self.kda:
            width = nv * dv
            return (3 * hidden * width + self.conv_dim * self.conv_kernel + 2 * (hidden * dk + dk * width)
                    + width + nv + hidden * nv + dv + width * hidden)
        return (hidden * (2 * nk * dk + 2 * nv * dv) + hidden * 2 * nv + self.conv_dim * self.conv_kernel + 2 * nv
                + dv + nv * dv * hidden)

    def state_bytes(self, elem_bytes: int = 4) -> int:
        """One sequence's state in one layer: the convolution's last inputs (model dtype, ``elem_bytes`` a
        value) and the fp32 recurrent matrix per value head."""
        return (self.conv_dim * (self.conv_kernel - 1) * elem_bytes
                + 4 * self.num_v_heads * self.k_head_dim * self.v_head_dim)


def resolve_gated_deltanet(tc: dict[str, Any], split_projections: bool = False) -> GatedDeltaNetConfig:
    """Qwen3-Next's and Qwen3.5's ``linear_*`` keys; a value-head count the key heads do not divide is refused."""
    lin = GatedDeltaNetConfig(size(tc, "linear_num_key_heads"), size(tc, "linear_num_value_heads"),
                              size(tc, "linear_key_head_dim"), size(tc, "linear_value_head_dim"),
                              size(tc, "linear_conv_kernel_dim", 4), split_projections)
    if lin.num_v_heads % lin.num_k_heads:
        raise ModelConfigError(f"config.json: linear_num_value_heads ({lin.num_v_heads}) must be a multiple of "
                               f"linear_num_key_heads ({lin.num_k_heads})")
    return lin


def resolve_kimi_delta(tc: dict[str, Any]) -> GatedDeltaNetConfig:
    """Kimi-Linear's KDA geometry: the release's ``linear_attn_config`` (``num_heads``, ``head_dim``,
    ``short_conv_kernel_size``), or the flat ``linear_*`` keys transformers saves."""
    nested = tc.get("linear_attn_config") or {}
    heads = size(nested, "num_heads") if "num_heads" in nested else size(tc, "linear_num_heads")
    dim = size(nested, "head_dim") if "head_dim" in nested else size(tc, "linear_head_dim")
    kernel = (size(nested, "short_conv_kernel_size") if "short_conv_kernel_size" in nested
              else size(tc, "linear_conv_kernel_dim", 4))
    return GatedDeltaNetConfig(heads, heads, dim, dim, kernel, kda=True)


LINEAR_KINDS = {"gated_deltanet": resolve_gated_deltanet, "kda": lambda tc, split: resolve_kimi_delta(tc)}


def _shared_indexer_layers(tc: dict[str, Any]) -> tuple[bool, ...]:
    """GLM-5's cross-layer top-k sharing, as transformers reads it: ``indexer_types`` ("full" / "shared" per
    layer), else ``index_topk_pattern`` ("F" / "S"), else every ``index_topk_freq``-th layer from
    ``index_skip_topk_offset`` runs its indexer. () when every layer runs one (DeepSeek-V3.2)."""
    layers = size(tc, "num_hidden_layers")
    types = tc.get("indexer_types")
    if types is None and tc.get("index_topk_pattern") is not None:
        pattern = tc["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq, offset = max(int(tc.get("index_topk_freq") or 1), 1), int(tc.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise ModelConfigError(f"config.json: indexer_types must be {layers} of 'full' / 'shared', the first 'full'")
    shared = tuple(t == "shared" for t in types)
    return shared if any(shared) else ()


@dataclass(frozen=True)
class ResolvedAttention:
    """What a kind reads from a text config: the fields ``TextConfig`` carries for its attention."""

    attention_bias: bool  # q/k/v carry a bias
    o_bias: bool
    qk_norm: bool
    qk_norm_over_heads: bool
    sinks: bool
    mla: MLAConfig | None
    output_gate: bool = False
    dsa: DSAConfig | None = None


@dataclass(frozen=True)
class AttentionKind:
    """One way of attending. ``module`` names its torch module in ``models.decoder.ATTENTION_MODULES``."""

    name: str  # what ``strata ops`` calls it when the head counts do not say more (MHA/GQA/MQA)
    module: str  # "gqa": separate K and V per KV head | "mla": one compressed latent per token
    qkv_bias: bool = False  # q/k/v always carry a bias (Qwen2); otherwise the config's ``attention_bias`` decides
    bias_on_o: bool = True  # ``attention_bias`` covers the output projection too (Llama); GLM biases q/k/v only
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "per-head" (Qwen3) or "over-heads" (MiniMax-M2:
    # each over its whole projection, all heads at once)
    qk_norm_key: str | None = None  # the norm is on only where this config key is true (GLM-4.5's ``use_qk_norm``)
    sinks: bool = False  # a learned logit per head takes part in every softmax and absorbs weight (gpt-oss)
    output_gate: bool = False  # q_proj also gives each head a gate; the output is scaled by its sigmoid (Qwen3-Next)
    indexer: bool = False  # MLA over the top-k tokens a lightning indexer picks (DeepSeek-V3.2's DSA)
    indexer_rope_interleave: bool = False  # the indexer rotates interleaved pairs (GLM-5)

    @property
    def latent(self) -> bool:
        """K and V are one cached latent (MLA), attended in the weight-absorbed form."""
        return self.module in ("mla", "mla_dsa")

    @property
    def compressed(self) -> bool:
        """DeepSeek-V4's: a window plus pooled entries per layer (``compressed_attention_config``)."""
        return self.module == "v4"

    def resolve(self, tc: dict[str, Any]) -> ResolvedAttention:
        """This kind's settings from a text config; a combination its module does not compute is refused."""
        bias = self.qkv_bias or bool(tc.get("attention_bias", False))
        norm = self.qk_norm is not None and (self.qk_norm_key is None or bool(tc.get(self.qk_norm_key)))
        mla = None
        if self.latent:
            if tc.get("attention_bias"):
                raise ModelConfigError("MLA with attention_bias is not supported")
            q_rank = tc.get("q_lora_rank")
            mla = MLAConfig(q_lora_rank=checked_size(q_rank, "q_lora_rank") if q_rank else None,
                            kv_lora_rank=size(tc, "kv_lora_rank"), qk_nope_head_dim=size(tc, "qk_nope_head_dim"),
                            qk_rope_head_dim=size(tc, "qk_rope_head_dim"), v_head_dim=size(tc, "v_head_dim"))
        dsa = None
        if self.indexer:
            if mla is None or mla.q_lora_rank is None:
                raise ModelConfigError("config.json: DSA's indexer reads the q LoRA: q_lora_rank is required")
            dsa = DSAConfig(size(tc, "index_n_heads"), size(tc, "index_head_dim"), size(tc, "index_topk"),
                            self.indexer_rope_interleave, _shared_indexer_layers(tc))
            if dsa.head_dim < mla.qk_rope_head_dim:
                raise ModelConfigError(f"config.json: index_head_dim ({dsa.head_dim}) is narrower than the "
                                       f"qk_rope_head_dim ({mla.qk_rope_head_dim}) it rotates")
        return ResolvedAttention(attention_bias=bias,
                                 o_bias=not self.qkv_bias and self.bias_on_o and bool(tc.get("attention_bias", False)),
                                 qk_norm=norm, qk_norm_over_heads=norm and self.qk_norm == "over-heads",
                                 sinks=self.sinks, mla=mla, output_gate=self.output_gate, dsa=dsa)

    def split(self, cfg: Any, proj: str, kind: str) -> tuple[int, str, int] | None:
        """How a tensor-parallel group splits this layer's ``proj`` (its ``kind``, weight or bias): (dim, the
        heads it follows, "q" or "kv", values per head), or None when every rank reads it whole (MLA's latent
        projections and their norms, per-head norms, the output bias). ``cfg``: the parsed ``TextConfig``."""
        if cfg.compressed is not None:  # V4: q heads, their sinks, and whole groups of the grouped output
            c = cfg.compressed
            rows = {"q_b_proj": c.head_dim, "sinks": 1, "o_a_proj": c.o_groups * c.o_lora_rank // cfg.num_heads}
            if proj in rows:
                return 0, "q", rows[proj]
            return (1, "q", c.o_groups * c.o_lora_rank // cfg.num_heads) if proj == "o_b_proj" else None
        if cfg.mla is not None:
            m = cfg.mla
            rows = {"q_proj": m.qk_head_dim, "q_b_proj": m.qk_head_dim, "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim}
            if proj in rows:
                return 0, "q", rows[proj]
            return (1, "q", m.v_head_dim) if proj == "o_proj" and kind == "weight" else None
        rows = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}
        if cfg.qk_norm_over_heads:  # the norm's weight is as wide as the projection it normalises
            rows.update(q_norm="q", k_norm="kv")
        if proj == "q_proj" and cfg.attention_gate:  # each head's [query, gate] rows (Qwen3-Next)
            return 0, "q", 2 * cfg.head_dim
        if proj in rows:
            return 0, rows[proj], cfg.head_dim
        if proj == "sinks":  # one logit per q head
            return 0, "q", 1
        return (1, "q", cfg.head_dim) if proj == "o_proj" and kind == "weight" else None

    def params(self, cfg: Any, q_heads: int, kv_heads: int) -> tuple[int, int, int]:
        """One layer's parameters where a rank holds ``q_heads`` and ``kv_heads``: (projection weights but
        MLA's ``kv_b_proj``, ``kv_b_proj``, norms and biases)."""
        h = cfg.hidden_size
        if cfg.mla is not None:
            m = cfg.mla
            q = h * m.q_lora_rank + m.q_lora_rank * q_heads * m.qk_head_dim if m.q_lora_rank else h * q_heads * m.qk_head_dim
            kv_a = h * m.latent_dim
            kv_b = m.kv_lora_rank * q_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv_a + q_heads * m.v_head_dim * h, kv_b, (m.q_lora_rank or 0) + m.kv_lora_rank
        d = cfg.head_dim
        q, kv = q_heads * d, kv_heads * d
        norms = (q + kv if cfg.qk_norm_over_heads else 2 * d) * cfg.qk_norm
        other = (q + 2 * kv) * cfg.attention_bias + h * cfg.o_bias + norms + q_heads * cfg.sinks
        return (2 + cfg.attention_gate) * h * q + 2 * h * kv, 0, other

    def describe(self, cfg: Any) -> str:
        """Its ``strata ops`` line for a parsed config (windows and per-layer types are the family's rows)."""
        if cfg.compressed is not None:
            return _describe_compressed(cfg)
        if cfg.mla is not None:
            detail = (f"MLA ({cfg.num_heads} heads over one {cfg.mla.latent_dim}-value latent per token: compressed "
                      "KV + shared RoPE key)")
            if cfg.dsa is not None:
                detail += (f", sparse (DSA): an indexer of {cfg.dsa.n_heads} heads of {cfg.dsa.head_dim} picks the top "
                           f"{cfg.dsa.topk} tokens, its key cached per token")
                if cfg.dsa.shared:
                    detail += f" on {cfg.index_layers} of {cfg.num_layers} layers (the others reuse its choice)"
            return detail
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        label = "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else self.name)
        detail = f"{label} ({heads} query / {kv_heads} KV heads)"
        if cfg.qk_norm:
            detail += ", q/k RMSNorm " + ("over all heads at once" if cfg.qk_norm_over_heads else "per head")
        if cfg.sinks:
            detail += ", a sink logit per head (kernels.sinks)"
        if cfg.attention_gate:
            detail += ", a sigmoid gate per head on the output"
        return detail


GQA = AttentionKind("GQA", "gqa")
GQA_QKV_BIAS = AttentionKind("GQA", "gqa", qkv_bias=True)  # Qwen2, Qwen2.5-VL
GQA_QK_NORM = AttentionKind("GQA", "gqa", qk_norm="per-head")  # Qwen3, Qwen3-VL
GQA_GLM = AttentionKind("GQA", "gqa", bias_on_o=False, qk_norm="per-head", qk_norm_key="use_qk_norm")  # GLM-4.5
GQA_SINKS = AttentionKind("GQA", "gqa", sinks=True)  # gpt-oss
GQA_QK_NORM_OVER_HEADS = AttentionKind("GQA", "gqa", qk_norm="over-heads")  # MiniMax-M2
GQA_GATED = AttentionKind("GQA", "gqa", qk_norm="per-head", output_gate=True)  # Qwen3-Next's full layers
MLA = AttentionKind("MLA", "mla")  # DeepSeek-V3, Kimi-K2
MLA_DSA = AttentionKind("MLA", "mla_dsa", indexer=True)  # DeepSeek-V3.2
MLA_DSA_INTERLEAVED = AttentionKind("MLA", "mla_dsa", indexer=True, indexer_rope_interleave=True)  # GLM-5
# DeepSeek-V4: shared-KV MQA over a sliding window plus pooled entries (``compressed_attention_config``)
COMPRESSED = AttentionKind("MQA", "v4", sinks=True)


def _describe_compressed(cfg: Any) -> str:
    """DeepSeek-V4's attention line: the window, each compression and the indexer, the grouped output."""
    c = cfg.compressed
    parts = [f"shared-KV MQA ({cfg.num_heads} query heads, one K=V head of {c.head_dim}) over a {c.window}-token "
             "window, a sink logit per head"]
    for rate in c.rates:
        n = len(c.layers_at(rate))
        if any(s for r, s in zip(c.compress, c.sparse) if r == rate):
            parts.append(f"CSA {rate}:1 on {n} layers (an indexer of {c.index_heads} heads of {c.index_dim} picks the "
                         f"top {c.index_topk} entries)")
        else:
            parts.append(f"HCA {rate}:1 on {n} layers (every entry)")
    sliding = sum(1 for r in c.compress if not r)
    if sliding:
        parts.append(f"window only on {sliding} layers")
    parts.append(f"grouped output projection ({c.o_groups} groups of rank {c.o_lora_rank})")
    return ", ".join(parts)
