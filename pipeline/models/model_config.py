"""Typed view of a LLaVA checkpoint's ``config.json``: what our model code needs, nothing more."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served; the message says why."""


@dataclass(frozen=True)
class TextConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    attention_bias: bool  # q/k/v bias (Qwen2, Llama with attention_bias)
    o_bias: bool
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]  # sliding window per layer (None = full attention)
    tie_word_embeddings: bool
    num_experts: int = 0  # > 0: Mixtral sparse MoE
    experts_per_tok: int = 0
    hidden_act: str = "silu"


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    vision_feature_layers: tuple[int, ...]  # absolute hidden-state indices (0 = embeddings)
    vision_feature_select_strategy: str
    projector_hidden_act: str
    projector_bias: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens one image expands to (CLS dropped for the default strategy)."""
        n = self.vision.num_patches + 1
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    @property
    def vision_layers_needed(self) -> int:
        """Encoder layers to run: hidden state k is the output of layer k-1, later layers are unused."""
        return max(self.vision_feature_layers)


def _windows(tc: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = tc.get("sliding_window")
    if model_type == "qwen2":
        if not tc.get("use_sliding_window", False) or window is None:
            return (None,) * num_layers
        types = tc.get("layer_types") or ["full_attention"] * num_layers
        return tuple(window if t == "sliding_attention" else None for t in types)
    if model_type in ("mistral", "mixtral") and window is not None:
        return (int(window),) * num_layers
    return (None,) * num_layers


def _rope_parameters(tc: dict[str, Any]) -> dict[str, Any]:
    params = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    params.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def parse_text_config(tc: dict[str, Any]) -> TextConfig:
    model_type = tc.get("model_type", "llama")
    if model_type not in TEXT_MODEL_TYPES:
        raise ModelConfigError(f"unsupported text model_type {model_type!r}; supported: {', '.join(TEXT_MODEL_TYPES)}")
    heads = int(tc["num_attention_heads"])
    head_dim = tc.get("head_dim") or tc["hidden_size"] // heads
    layers = int(tc["num_hidden_layers"])
    qkv_bias = model_type == "qwen2" or bool(tc.get("attention_bias", False))
    act = tc.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"unsupported text hidden_act {act!r} (only silu)")
    return TextConfig(
        model_type=model_type,
        vocab_size=int(tc["vocab_size"]),
        hidden_size=int(tc["hidden_size"]),
        intermediate_size=int(tc["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(tc.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(tc),
        max_position_embeddings=int(tc.get("max_position_embeddings", 4096)),
        attention_bias=qkv_bias,
        o_bias=model_type != "qwen2" and bool(tc.get("attention_bias", False)),
        mlp_bias=bool(tc.get("mlp_bias", False)),
        layer_windows=_windows(tc, model_type, layers),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        num_experts=int(tc.get("num_local_experts", 0)) if model_type == "mixtral" else 0,
        experts_per_tok=int(tc.get("num_experts_per_tok", 0)) if model_type == "mixtral" else 0,
        hidden_act=act,
    )


def parse_vision_config(vc: dict[str, Any]) -> VisionConfig:
    return VisionConfig(
        hidden_size=int(vc.get("hidden_size", 1024)),
        intermediate_size=int(vc.get("intermediate_size", 4096)),
        num_layers=int(vc.get("num_hidden_layers", 24)),
        num_heads=int(vc.get("num_attention_heads", 16)),
        image_size=int(vc.get("image_size", 336)),
        patch_size=int(vc.get("patch_size", 14)),
        num_channels=int(vc.get("num_channels", 3)),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
        hidden_act=vc.get("hidden_act", "quick_gelu"),
    )


def parse_llava_config(raw: dict[str, Any]) -> LlavaConfig:
    if raw.get("model_type") != "llava":
        raise ModelConfigError(f"expected a llava checkpoint, config.json has model_type {raw.get('model_type')!r}")
    text = parse_text_config(raw["text_config"])
    vision = parse_vision_config(raw.get("vision_config") or {})
    layers = raw.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    n_states = vision.num_layers + 1
    absolute = tuple(l % n_states for l in layers)
    eos = raw["text_config"].get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return LlavaConfig(
        text=text,
        vision=vision,
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
        vision_feature_layers=absolute,
        vision_feature_select_strategy=raw.get("vision_feature_select_strategy", "default"),
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        eos_token_ids=eos_ids,
        raw=raw,
    )


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict, unvalidated (what `strata ops` inspects)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json in {model_dir}: is this a Hugging Face checkpoint directory?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return raw


def load_llava_config(model_dir: str | Path) -> LlavaConfig:
    """Read and validate ``model_dir/config.json`` (works before the weights arrive)."""
    return parse_llava_config(read_config_json(model_dir))
