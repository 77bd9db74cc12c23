"""The model registry: every architecture Strata serves, declared as a choice of components.

A decoder family (:class:`TextFamily`, keyed by ``model_type``) says which attention (an
``attention_kinds.AttentionKind``: GQA or MLA, with its biases, q/k norm and sinks), which sliding-window rule, which MoE router (a
``router_kinds.RouterKind``), which layers are sparse (a ``sparse_layers`` rule) and where its config
keeps the counts. Positions come from the config's
``rope_parameters`` (default / linear / llama3 / yarn with mscale, over all of a head or the first
``partial_rotary_factor`` of it; see ``kernels.rope``).

A model (:class:`ModelArchitecture`, keyed by the Hugging Face class in ``config.json``'s
``architectures``) is a decoder family plus an optional vision tower and projector, and the rules
that map checkpoint tensor names onto the parts (``text``, ``vision``, ``projector``).

``model_config`` parses configs with it, the loader maps names with it, ``strata ops`` reports it and
the shard plan and planner read the parsed config it produces: a new architecture is one entry here
plus whatever component it needs that does not exist yet. Pure data: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from strata.pipeline.models import attention_kinds, expert_kinds, position_kinds, router_kinds, vision_kinds
from strata.pipeline.models.attention_kinds import AttentionKind
from strata.pipeline.models.expert_kinds import ExpertKind
from strata.pipeline.models.position_kinds import PositionKind
from strata.pipeline.models.vision_kinds import ProjectorKind, VisionKind
from strata.pipeline.models.router_kinds import RouterKind
from strata.pipeline.models.layer_rules import (
    SparseLayerRule,
    WindowRule,
    LinearLayerRule,
    every_layer,
    first_k_dense,
    kda_layers,
    linear_by_type,
    no_window,
    one_window,
    sparse_step,
    typed_mlp_layers,
    typed_windows,
    typed_windows_if_enabled,
)


@dataclass(frozen=True)
class TextFamily:
    """How one decoder family's config maps onto components."""

    model_type: str
    attention: AttentionKind = attention_kinds.GQA  # its parameters, config keys and module (``attention_kinds``)
    windows: WindowRule = no_window  # which layers attend within a sliding window (``layer_rules``)
    norm_scale_fp32: bool = False  # RMSNorm scales in fp32 before its cast back (gpt-oss), not after (Llama)
    router: RouterKind | None = None  # None: a dense decoder
    sparse_layers: SparseLayerRule = every_layer  # which layers route to experts
    shared_experts: bool = False  # ``n_shared_experts`` always-on experts beside the routed ones (DeepSeek)
    experts: ExpertKind = expert_kinds.SWIGLU  # what a routed expert computes and how it is stored (``expert_kinds``)
    experts_keys: tuple[str, ...] = ("num_local_experts",)  # where configs keep the routed expert count
    expert_size_key: str = "moe_intermediate_size"  # where configs keep one routed expert's width
    positions: PositionKind = position_kinds.ROPE  # 1-D, or M-RoPE's three axes (``position_kinds``)
    linear_layers: LinearLayerRule | None = None  # which layers are linear attention (Qwen3-Next, Kimi-Linear)
    linear_kind: str = "gated_deltanet"  # which: "gated_deltanet" or "kda" (``attention_kinds.LINEAR_KINDS``)
    linear_split_projections: bool = False  # its q/k/v, z, b and a come from four projections (Qwen3.5)
    norm_offset: bool = False  # RMSNorm weights are stored as w and scale by 1 + w, in fp32 (Qwen3-Next)
    shared_expert_key: str | None = None  # one shared expert this wide, behind a sigmoid gate (Qwen3-Next)
    # (the release's key, the key the parse reads), as transformers' ``attribute_map``: Kimi-Linear counts its
    # experts and context under names of its own
    config_aliases: tuple[tuple[str, str], ...] = ()
    rope_interleave: bool | None = None  # MLA's RoPE pairs: fixed by the family (DeepSeek-V3.2), else the config's key

    def config_view(self, tc: dict[str, Any]) -> dict[str, Any]:
        """The text config with this family's aliased keys under the names the parse reads."""
        if not self.config_aliases:
            return tc
        return {**{ours: tc[theirs] for theirs, ours in self.config_aliases if theirs in tc and ours not in tc}, **tc}


TEXT_FAMILIES: dict[str, TextFamily] = {}


def register_text_family(family: TextFamily) -> TextFamily:
    TEXT_FAMILIES[family.model_type] = family
    return family


for _family in (
    TextFamily("llama"),
    TextFamily("mistral", windows=one_window),
    TextFamily("qwen2", attention=attention_kinds.GQA_QKV_BIAS, windows=typed_windows_if_enabled),
    TextFamily("qwen3", attention=attention_kinds.GQA_QK_NORM, windows=typed_windows_if_enabled),
    # Mixtral: every layer sparse, experts as wide as a dense MLP would be
    TextFamily("mixtral", windows=one_window, router=router_kinds.SOFTMAX_MIXTRAL, expert_size_key="intermediate_size"),
    TextFamily("qwen3_moe", attention=attention_kinds.GQA_QK_NORM, windows=typed_windows_if_enabled,
               router=router_kinds.SOFTMAX_QWEN, sparse_layers=sparse_step,
               experts_keys=("num_experts", "num_local_experts")),  # Qwen's checkpoints, transformers 5's
    TextFamily("deepseek_v3", attention=attention_kinds.MLA, router=router_kinds.SIGMOID_GROUPED,
               sparse_layers=first_k_dense, shared_experts=True, experts_keys=("n_routed_experts",)),
    TextFamily("kimi_k2", attention=attention_kinds.MLA, router=router_kinds.SIGMOID_GROUPED,
               sparse_layers=first_k_dense, shared_experts=True, experts_keys=("n_routed_experts",)),
    # GLM-4.5/4.6: GQA with q/k/v biases (none on o), optional q/k norm, partial RoPE; DeepSeek-V3's router
    TextFamily("glm4_moe", attention=attention_kinds.GQA_GLM, router=router_kinds.SIGMOID_GROUPED,
               sparse_layers=first_k_dense, shared_experts=True, experts_keys=("n_routed_experts",)),
    # gpt-oss: GQA with biases and sinks, sliding and full layers alternating, a biased top-k router over
    # clamped-SwiGLU experts with biases
    TextFamily("gpt_oss", attention=attention_kinds.GQA_SINKS, windows=typed_windows, norm_scale_fp32=True,
               router=router_kinds.TOPK_SOFTMAX, experts=expert_kinds.CLAMPED_SWIGLU, expert_size_key="intermediate_size"),
    # MiniMax-M2: GQA with q and k normalised over all heads at once, partial RoPE, sigmoid routing with a
    # correction bias over every expert in every layer, experts as wide as ``intermediate_size``
    TextFamily("minimax_m2", attention=attention_kinds.GQA_QK_NORM_OVER_HEADS, router=router_kinds.SIGMOID_TOPK,
               expert_size_key="intermediate_size"),
    # Qwen3-Next: Gated DeltaNet linear attention in 3 of every 4 layers, gated GQA with q/k norm and a quarter of
    # each head rotated in the 4th; RMSNorms scale by 1 + w; a softmax top-k router with a gated shared expert
    TextFamily("qwen3_next", attention=attention_kinds.GQA_GATED, linear_layers=linear_by_type, norm_offset=True,
               norm_scale_fp32=True, router=router_kinds.SOFTMAX_QWEN, sparse_layers=sparse_step,
               experts_keys=("num_experts",), shared_expert_key="shared_expert_intermediate_size"),
    # Qwen3.5: Qwen3-Next's layers with the linear layers' projections kept apart, dense or every layer sparse
    TextFamily("qwen3_5_text", attention=attention_kinds.GQA_GATED, linear_layers=linear_by_type,
               linear_split_projections=True, norm_offset=True, norm_scale_fp32=True),
    TextFamily("qwen3_5_moe_text", attention=attention_kinds.GQA_GATED, linear_layers=linear_by_type,
               linear_split_projections=True, norm_offset=True, norm_scale_fp32=True,
               router=router_kinds.SOFTMAX_QWEN_VL, experts_keys=("num_experts",),
               shared_expert_key="shared_expert_intermediate_size"),
    # ... and their decoders under Qwen3.5's vision tower: positions 3-D (interleaved M-RoPE) for image tokens
    TextFamily("qwen3_5_vl_text", attention=attention_kinds.GQA_GATED, linear_layers=linear_by_type,
               linear_split_projections=True, norm_offset=True, norm_scale_fp32=True,
               positions=position_kinds.MROPE_INTERLEAVED),
    TextFamily("qwen3_5_moe_vl_text", attention=attention_kinds.GQA_GATED, linear_layers=linear_by_type,
               linear_split_projections=True, norm_offset=True, norm_scale_fp32=True,
               router=router_kinds.SOFTMAX_QWEN_VL, experts_keys=("num_experts",),
               shared_expert_key="shared_expert_intermediate_size", positions=position_kinds.MROPE_INTERLEAVED),
    # DeepSeek-V3.2: DeepSeek-V3 with DSA (MLA over the top-k tokens a lightning indexer picks), RoPE pairs
    # always interleaved, dense and sparse layers listed per layer
    TextFamily("deepseek_v32", attention=attention_kinds.MLA_DSA, router=router_kinds.SIGMOID_GROUPED,
               sparse_layers=typed_mlp_layers, shared_experts=True, experts_keys=("n_routed_experts",),
               rope_interleave=True),
    # GLM-5: the same DSA with the indexer's RoPE in interleaved pairs, and layers that reuse the previous indexer
    # layer's top-k instead of running their own (``indexer_types``)
    TextFamily("glm_moe_dsa", attention=attention_kinds.MLA_DSA_INTERLEAVED, router=router_kinds.SIGMOID_GROUPED,
               sparse_layers=typed_mlp_layers, shared_experts=True, experts_keys=("n_routed_experts",),
               rope_interleave=True),
    # DeepSeek-V4: every layer a sliding window of shared-KV MQA with sinks, most also pooled entries (CSA with a
    # lightning indexer, or HCA), the residual as mHC streams, sqrt-softplus routing (fixed per token id in the first
    # layers) over clamped-SwiGLU experts and a clamped shared expert
    TextFamily("deepseek_v4", attention=attention_kinds.COMPRESSED, router=router_kinds.SQRTSOFTPLUS,
               shared_experts=True, experts=expert_kinds.CLAMPED_SILU, experts_keys=("n_routed_experts",),
               config_aliases=(("moe_intermediate_size", "intermediate_size"),)),
    # Kimi-Linear: KDA linear attention in 3 of every 4 layers, MLA without positions (NoPE) in the 4th,
    # DeepSeek-V3's router and shared expert
    TextFamily("kimi_linear", attention=attention_kinds.MLA, positions=position_kinds.NOPE, linear_layers=kda_layers,
               linear_kind="kda", router=router_kinds.SIGMOID_GROUPED, sparse_layers=typed_mlp_layers,
               shared_experts=True, experts_keys=("num_experts",),
               config_aliases=(("num_experts_per_token", "num_experts_per_tok"), ("moe_renormalize", "norm_topk_prob"),
                               ("num_expert_group", "n_group"), ("num_shared_experts", "n_shared_experts"),
                               ("model_max_length", "max_position_embeddings"))),
    # the Qwen-VL decoders: their text family's components, positions 3-D (M-RoPE) for image tokens
    TextFamily("qwen2_5_vl_text", attention=attention_kinds.GQA_QKV_BIAS, windows=typed_windows_if_enabled,
               positions=position_kinds.MROPE),
    TextFamily("qwen3_vl_text", attention=attention_kinds.GQA_QK_NORM, positions=position_kinds.MROPE_INTERLEAVED),
    TextFamily("qwen3_vl_moe_text", attention=attention_kinds.GQA_QK_NORM, router=router_kinds.SOFTMAX_QWEN_VL,
               sparse_layers=sparse_step, experts_keys=("num_experts", "num_local_experts"),
               positions=position_kinds.MROPE_INTERLEAVED),
):
    register_text_family(_family)


# (checkpoint-name prefix, part, prefix of the name inside that part's module); first match wins.
NameRule = tuple[str, str, str]

# gpt-oss calls its router ``mlp.router``; every other family's is ``mlp.gate``
GPT_OSS_RENAMES: tuple[NameRule, ...] = ((r"^model\.layers\.(\d+)\.mlp\.router\.", "text", r"layers.\1.mlp.gate."),)
# MiniMax-M2 keeps its routing correction on the MoE block; it is the router's (``router_kinds.SIGMOID_TOPK``)
# Qwen3-Next's one gated shared expert is the MoE block's shared MLP
QWEN3_NEXT_RENAMES: tuple[NameRule, ...] = (
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.", "text", r"layers.\1.mlp.shared_experts."),)
QWEN3_5_VL_RENAMES: tuple[NameRule, ...] = (  # the same, under Qwen3.5's vision tower
    (r"^model\.language_model\.layers\.(\d+)\.mlp\.shared_expert\.", "text", r"layers.\1.mlp.shared_experts."),)
MINIMAX_M2_RENAMES: tuple[NameRule, ...] = (
    (r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.e_score_correction_bias$", "text",
     r"layers.\1.mlp.gate.e_score_correction_bias"),)

# DeepSeek-V4 as DeepSeek releases it (``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn``, ``head``, with or
# without ``model.``, which is also what transformers 5 writes): one rule per tensor kind onto Strata's modules,
# which keep transformers' in-memory names. Its multi-token-prediction layers (``mtp.*``) belong to no part loaded.
_V4_LAYER = r"^(?:model\.)?layers\.(\d+)\."
_V4_ATTENTION = {"attn_sink$": "self_attn.sinks", r"wq_a\.": "self_attn.q_a_proj.", r"q_norm\.": "self_attn.q_a_norm.",
                 r"wq_b\.": "self_attn.q_b_proj.", r"wkv\.": "self_attn.kv_proj.", r"norm\.": "self_attn.kv_norm.",
                 r"wo_a\.": "self_attn.o_a_proj.", r"wo_b\.": "self_attn.o_b_proj.",
                 r"indexer\.wq_b\.": "self_attn.compressor.indexer.q_b_proj.",
                 r"indexer\.weights_proj\.": "self_attn.compressor.indexer.scorer.weights_proj."}
_V4_POOLER = {r"wkv\.": "kv_proj.", r"wgate\.": "gate_proj.", "ape$": "position_bias", r"norm\.": "kv_norm."}
DEEPSEEK_V4_RENAMES: tuple[NameRule, ...] = (
    *((_V4_LAYER + r"attn\." + k, "text", r"layers.\1." + v) for k, v in _V4_ATTENTION.items()),
    *((_V4_LAYER + r"attn\.compressor\." + k, "text", r"layers.\1.self_attn.compressor." + v) for k, v in _V4_POOLER.items()),
    *((_V4_LAYER + r"attn\.indexer\.compressor\." + k, "text", r"layers.\1.self_attn.compressor.indexer." + v)
      for k, v in _V4_POOLER.items()),
    (_V4_LAYER + r"attn_norm\.", "text", r"layers.\1.input_layernorm."),
    (_V4_LAYER + r"ffn_norm\.", "text", r"layers.\1.post_attention_layernorm."),
    (_V4_LAYER + r"hc_(attn|ffn)_(fn|base|scale)$", "text", r"layers.\1.\2_hc.\3"),
    (_V4_LAYER + r"ffn\.gate\.bias$", "text", r"layers.\1.mlp.gate.e_score_correction_bias"),
    *((_V4_LAYER + rf"ffn\.shared_experts\.{k}\.", "text", rf"layers.\1.mlp.shared_experts.{v}.")
      for k, v in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))),
    (_V4_LAYER + r"ffn\.(gate|experts)\.", "text", r"layers.\1.mlp.\2."),
    (r"^(?:model\.)?hc_head[._](?:hc_)?(fn|base|scale)$", "text", r"hc_head.hc_\1"),
    (r"^(?:model\.)?embed\.weight$", "text", "embed_tokens.weight"),
    (r"^head\.weight$", "text", "lm_head.weight"),
    (r"^norm\.weight$", "text", "norm.weight"),
    (r"^mtp\.", "mtp", ""),
)

CAUSAL_LM_NAMES: tuple[NameRule, ...] = (
    ("model.layers.", "text", "layers."),
    ("model.embed_tokens.", "text", "embed_tokens."),
    ("model.norm.", "text", "norm."),
    ("lm_head.", "text", "lm_head."),
)

# Classic llava-hf names (language_model.model.…, vision_tower.vision_model.…) and transformers-5 ones
# (model.language_model.…, model.vision_tower.…, lm_head).
LLAVA_NAMES: tuple[NameRule, ...] = (
    ("language_model.model.", "text", ""),
    ("language_model.lm_head.", "text", "lm_head."),
    ("model.language_model.", "text", ""),
    ("language_model.", "text", ""),
    ("lm_head.", "text", "lm_head."),
    ("model.vision_tower.vision_model.", "vision", ""),
    ("vision_tower.vision_model.", "vision", ""),
    ("model.vision_tower.", "vision", ""),
    ("vision_tower.", "vision", ""),
    ("model.multi_modal_projector.", "projector", ""),
    ("multi_modal_projector.", "projector", ""),
)


# Kimi-K2.5 as Moonshot releases it (which is also what transformers 5's save_pretrained writes, its
# conversion mapping run backwards): blocks for layers, norm0/norm1, fc0/fc1, wo, a fused wqkv whose q
# and k rows pair RoPE dims (x0, x1), ... (MoonViT splits and reorders it: ``owner_of``/``split_fused``),
# mm_projector.proj.0/2. Regex rules, tried before the prefix rules below.
KIMI_K25_RENAMES: tuple[NameRule, ...] = (
    (r"^language_model\.model\.(?:layers|blocks)\.", "text", "layers."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm0\.", "vision", r"layers.\1.norm1."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm1\.", "vision", r"layers.\1.norm2."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\.", "vision", r"layers.\1.mlp.fc1."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\.", "vision", r"layers.\1.mlp.fc2."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.wo\.", "vision", r"layers.\1.attn.proj."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.", "vision", r"layers.\1.attn.wqkv."),
    (r"^vision_tower\.encoder\.(final_layernorm|patch_embed)\.", "vision", r"\1."),
    (r"^vision_tower\.patch_embed\.pos_emb\.weight$", "vision", "patch_embed.pos_emb.position_embeddings"),
    (r"^(?:model\.)?mm_projector\.proj\.0\.", "projector", "in_proj."),
    (r"^(?:model\.)?mm_projector\.proj\.2\.", "projector", "out_proj."),
)

# Kimi-K2.5 as transformers 5 holds it in memory (model.language_model / model.vision_tower / model.mm_projector).
KIMI_K25_NAMES: tuple[NameRule, ...] = (
    ("model.language_model.", "text", ""),
    ("language_model.model.", "text", ""),
    ("language_model.lm_head.", "text", "lm_head."),
    ("lm_head.", "text", "lm_head."),
    ("model.vision_tower.", "vision", ""),
    ("vision_tower.", "vision", ""),
    ("model.mm_projector.", "projector", ""),
    ("mm_projector.", "projector", ""),
)


# Qwen2.5-VL as Qwen releases it and transformers 5 saves it (model.layers, visual.blocks, visual.merger,
# lm_head), and as transformers 5 holds it (model.language_model, model.visual); Qwen3-VL (dense and MoE) as
# both save it (model.language_model, model.visual). The merger is the projector; Qwen3-VL's DeepStack
# mergers (visual.deepstack_merger_list) belong to the tower, which emits their features with its own.
QWEN_VL_NAMES: tuple[NameRule, ...] = (
    ("model.language_model.", "text", ""),
    ("model.visual.merger.", "projector", ""),
    ("visual.merger.", "projector", ""),
    ("model.visual.", "vision", ""),
    ("visual.", "vision", ""),
    ("model.", "text", ""),
    ("lm_head.", "text", "lm_head."),
)


# LLaVA-OneVision keeps the llava-hf layout, plus the newline embedding that ends each row of tiles.
LLAVA_ONEVISION_NAMES: tuple[NameRule, ...] = (
    ("model.image_newline", "projector", "image_newline"),
    ("image_newline", "projector", "image_newline"),
    *LLAVA_NAMES,
)


@dataclass(frozen=True)
class ModelArchitecture:
    """One servable model class: a decoder, optionally behind a vision tower and projector."""

    name: str  # the Hugging Face class, as config.json's ``architectures`` lists it
    model_type: str  # the top-level ``model_type`` it is found by when ``architectures`` is absent
    names: tuple[NameRule, ...]
    text_config_key: str | None = None  # "text_config" when the decoder's fields are nested
    flat_text_config: bool = False  # the decoder's fields may also sit at the top level (Qwen's own releases)
    vision: VisionKind | None = None  # the tower (``vision_kinds``: CLIP/SigLIP, MoonViT, a Qwen-VL ViT); None: text only
    projector: ProjectorKind | None = None  # LLaVA's two linears (which may tile), or a 2x2 patch merger
    text_family: str | None = None  # fixed decoder family; None: the text config's own model_type
    renames: tuple[NameRule, ...] = ()  # (regex, part, replacement): a release's own names, tried first
    # a decoder family this architecture reads another way: Qwen3.5's text config says qwen3_5_text, which
    # under its vision tower has 3-D positions (``qwen3_5_vl_text``)
    family_by_type: tuple[tuple[str, str], ...] = ()
    # When the LM head is the embedding, as transformers decides for this class: "either" (the top-level
    # tie_word_embeddings or the text config's: LLaVA, Qwen2.5-VL, OneVision) or "top" (only the composite's
    # own setting, ``tie_default`` when absent: Kimi-K2.5, Qwen3-VL)
    tie: str = "either"
    tie_default: bool = False
    # transformers' own modules run the layers, attention through Strata's paged attention (``models.fallback_model``)
    fallback: bool = False

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def text_config(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The decoder's fields of a config.json of this architecture."""
        if self.text_config_key is None:
            return raw
        nested = raw.get(self.text_config_key)
        if not isinstance(nested, dict):
            if self.flat_text_config:
                return raw
            raise KeyError(self.text_config_key)
        return nested

    def map_name(self, name: str) -> tuple[str, str] | None:
        """(part, name inside that part's module) for a checkpoint tensor; None if no part claims it."""
        for pattern, part, replacement in self.renames:
            mapped, count = re.subn(pattern, replacement, name, count=1)
            if count:
                return part, mapped
        for prefix, part, inner in self.names:
            if name.startswith(prefix):
                return part, inner + name[len(prefix):].replace(".block_sparse_moe.", ".mlp.")
        return None


ARCHITECTURES: dict[str, ModelArchitecture] = {}


def register_architecture(arch: ModelArchitecture) -> ModelArchitecture:
    ARCHITECTURES[arch.name] = arch
    return arch


register_architecture(ModelArchitecture("LlavaForConditionalGeneration", "llava", LLAVA_NAMES,
                                        text_config_key="text_config", vision=vision_kinds.CLIP,
                                        projector=vision_kinds.MLP2))
register_architecture(ModelArchitecture("LlavaOnevisionForConditionalGeneration", "llava_onevision",
                                        LLAVA_ONEVISION_NAMES, text_config_key="text_config", vision=vision_kinds.CLIP,
                                        projector=vision_kinds.MLP2_ANYRES))
register_architecture(ModelArchitecture("Kimi_K25ForConditionalGeneration", "kimi_k25", KIMI_K25_NAMES,
                                        text_config_key="text_config", vision=vision_kinds.MOONVIT,
                                        projector=vision_kinds.PATCH_MERGER,
                                        renames=KIMI_K25_RENAMES, tie="top", tie_default=True))
register_architecture(ModelArchitecture("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", QWEN_VL_NAMES,
                                        text_config_key="text_config", flat_text_config=True,
                                        vision=vision_kinds.QWEN2_5_VIT,
                                        projector=vision_kinds.PATCH_MERGER, text_family="qwen2_5_vl_text"))
for _cls, _type in (("Qwen3VLForConditionalGeneration", "qwen3_vl"), ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe")):
    register_architecture(ModelArchitecture(_cls, _type, QWEN_VL_NAMES, text_config_key="text_config",
                                            vision=vision_kinds.QWEN3_VIT, projector=vision_kinds.PATCH_MERGER,
                                            text_family=f"{_type}_text", tie="top"))
for _cls, _type in (("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"), ("Qwen2ForCausalLM", "qwen2"),
                    ("Qwen3ForCausalLM", "qwen3"), ("MixtralForCausalLM", "mixtral"),
                    ("Qwen3MoeForCausalLM", "qwen3_moe"), ("DeepseekV3ForCausalLM", "deepseek_v3"),
                    ("Glm4MoeForCausalLM", "glm4_moe"), ("DeepseekV32ForCausalLM", "deepseek_v32"),
                    ("GlmMoeDsaForCausalLM", "glm_moe_dsa")):
    register_architecture(ModelArchitecture(_cls, _type, CAUSAL_LM_NAMES, text_family=_type))
register_architecture(ModelArchitecture("DeepseekV4ForCausalLM", "deepseek_v4", CAUSAL_LM_NAMES,
                                        text_family="deepseek_v4", renames=DEEPSEEK_V4_RENAMES))
register_architecture(ModelArchitecture("GptOssForCausalLM", "gpt_oss", CAUSAL_LM_NAMES, text_family="gpt_oss",
                                        renames=GPT_OSS_RENAMES))
register_architecture(ModelArchitecture("MiniMaxM2ForCausalLM", "minimax_m2", CAUSAL_LM_NAMES, text_family="minimax_m2",
                                        renames=MINIMAX_M2_RENAMES))
register_architecture(ModelArchitecture("Qwen3NextForCausalLM", "qwen3_next", CAUSAL_LM_NAMES, text_family="qwen3_next",
                                        renames=QWEN3_NEXT_RENAMES))
register_architecture(ModelArchitecture("KimiLinearForCausalLM", "kimi_linear", CAUSAL_LM_NAMES, text_family="kimi_linear"))
register_architecture(ModelArchitecture("Qwen3_5ForCausalLM", "qwen3_5_text", CAUSAL_LM_NAMES, text_family="qwen3_5_text"))
for _cls, _type, _family in (("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5_vl_text"),
                             ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_vl_text")):
    register_architecture(ModelArchitecture(_cls, _type, QWEN_VL_NAMES, text_config_key="text_config",
                                            vision=vision_kinds.QWEN3_5_VIT, projector=vision_kinds.PATCH_MERGER,
                                            text_family=_family, tie="top", renames=QWEN3_5_VL_RENAMES,
                                            family_by_type=((f"{_type}_text", _family),)))
register_architecture(ModelArchitecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", CAUSAL_LM_NAMES,
                                        text_family="qwen3_5_moe_text", renames=QWEN3_NEXT_RENAMES))


class UnknownArchitecture(ValueError):
    """config.json names an architecture the registry does not hold; the message lists those it does."""


def resolve_architecture(raw: dict[str, Any]) -> ModelArchitecture:
    """The registered architecture of a config.json: by its ``architectures`` class, else by ``model_type``.
    A checkpoint whose class is unknown but whose ``model_type`` is a registered text family (a Kimi-K2
    config says ``DeepseekV3ForCausalLM`` or ``KimiK2ForCausalLM``) is served as that family's causal LM."""
    names = raw.get("architectures") or []
    for name in names if isinstance(names, list) else []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = raw.get("model_type")
    for arch in ARCHITECTURES.values():
        if arch.model_type == model_type:
            return arch
    if model_type in TEXT_FAMILIES and raw.get("text_config") is None:
        return ModelArchitecture(f"{model_type} causal LM", model_type, CAUSAL_LM_NAMES, text_family=model_type)
    known = ", ".join(sorted(ARCHITECTURES))
    shown = ", ".join(map(str, names)) if isinstance(names, list) and names else f"model_type {model_type!r}"
    raise UnknownArchitecture(f"unsupported architecture {shown}; Strata serves {known}")
