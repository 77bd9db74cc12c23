"""Typed view of a checkpoint's ``config.json``: what our model code needs, nothing more.

Which fields mean what is the registry's business (``models.architectures``); this module puts a
config's parts together as :class:`ModelConfig`: the decoder's :class:`TextConfig` (``text_config``),
the vision side (``vision_config``: CLIP/SigLIP, MoonViT or a Qwen-VL ViT; None for a text-only LLM)
and the composite's own settings (image token, feature layers, anyres tiling, LM-head tying).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from strata.pipeline.models.architectures import ModelArchitecture, UnknownArchitecture, resolve_architecture
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.fallback_config import MODEL_IMPLS, fallback_architecture, fallback_text_config
from strata.pipeline.models.weight_formats import QuantScheme, parse_quantization
from strata.pipeline.models.text_config import (  # re-exported: the config's types live in one import
    TEXT_MODEL_TYPES,
    MLAConfig,
    MoEConfig,
    TextConfig,
    parse_text_config,
)
from strata.pipeline.models.vision_config import (
    MoonViTConfig,
    QwenVisionConfig,
    VisionConfig,
    parse_moonvit_config,
    parse_qwen_vision_config,
    parse_vision_config,
)

__all__ = ["TEXT_MODEL_TYPES", "MLAConfig", "ModelConfig", "ModelConfigError", "MoEConfig", "MoonViTConfig",
           "QwenVisionConfig", "TextConfig", "VisionConfig", "load_model_config", "parse_model_config",
           "parse_moonvit_config", "parse_qwen_vision_config", "parse_text_config", "parse_vision_config",
           "read_config_json"]


@dataclass(frozen=True)
class ModelConfig:
    """A servable checkpoint: its registered architecture, the decoder and, for a VLM, the vision side."""

    arch: ModelArchitecture
    text: TextConfig
    vision: VisionConfig | MoonViTConfig | QwenVisionConfig | None = None  # None: a text-only LLM (requests skip the image stages)
    image_token_id: int | None = None
    vision_feature_layers: tuple[int, ...] = ()  # absolute hidden-state indices (0 = embeddings)
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # LLaVA-OneVision's anyres: tiles at the best of these (height, width) resolutions, after the base image
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()
    anyres_max_tiles: int = 0  # "anyres_max_N": an image's unpadded features are downsampled past N tiles' worth
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    quant: QuantScheme | None = None  # how the checkpoint's linears are stored, when quantized

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    @property
    def native_resolution(self) -> bool:
        """Images keep their size: how many tokens one costs is known once it is preprocessed."""
        return isinstance(self.vision, (MoonViTConfig, QwenVisionConfig))

    @property
    def anyres(self) -> bool:
        """LLaVA-OneVision: fixed-size tiles of the image at its best grid resolution, a count per image."""
        return bool(self.image_grid_pinpoints)

    @property
    def image_tokens_vary(self) -> bool:
        """An image's token count is known once it is preprocessed (native resolution or anyres tiling)."""
        return self.native_resolution or self.anyres

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens one image expands to (CLS dropped for the default strategy); 0 without
        vision or when the count depends on the image (native resolution)."""
        if self.vision is None or self.image_tokens_vary:
            return 0
        n = self.vision.num_patches + self.vision.class_token
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    @property
    def vision_layers_needed(self) -> int:
        """Encoder layers to run: hidden state k is the output of layer k-1, later layers are unused
        (LLaVA); every layer (MoonViT, which reads the last)."""
        if isinstance(self.vision, (MoonViTConfig, QwenVisionConfig)):
            return self.vision.num_layers
        return max(self.vision_feature_layers, default=0)

    @property
    def spatial_merge_size(self) -> int:
        """Patches per side merged into one language-model token (native-resolution towers; 1 otherwise)."""
        return self.vision.spatial_merge_size if isinstance(self.vision, QwenVisionConfig) else (
            self.vision.merge_kernel[0] if isinstance(self.vision, MoonViTConfig) else 1)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json of any registered architecture (``models.architectures``), with its weight format:
    a quantization Strata does not implement is refused here, before any weight is read."""
    cfg = _parse_model_config(raw)  # an unknown architecture is named first, whatever its weights' format
    quant = parse_quantization(raw)
    return replace(cfg, quant=quant) if quant is not None else cfg


def _parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    try:
        arch = resolve_architecture(raw)
    except UnknownArchitecture as exc:
        fallback = fallback_architecture(raw)  # a causal LM transformers implements: its modules, our attention
        if fallback is None:
            raise ModelConfigError(str(exc)) from None
        return fallback_model_config(raw, fallback)
    tc = arch.text_config(raw)
    # The config's own model_type names the decoder family (a Kimi-K2 config says DeepseekV3ForCausalLM
    # with model_type kimi_k2); one we do not know is refused, never read as the class's family.
    flat = tc is raw and arch.text_config_key is not None  # a composite's decoder fields at the top level
    family = arch.text_family if flat else (tc.get("model_type") or arch.text_family)
    family = dict(arch.family_by_type).get(family, family)
    text = parse_text_config(tc, family)
    if tc is not raw:  # a composite: its own setting decides too (saved with no lm_head when true)
        top = bool(raw.get("tie_word_embeddings", arch.tie_default))
        text = replace(text, tie_word_embeddings=top if arch.tie == "top" else top or text.tie_word_embeddings)
    eos = tc.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if not arch.takes_images:
        return ModelConfig(arch=arch, text=text, eos_token_ids=eos_ids, raw=raw)
    settings = arch.vision.settings(raw, arch.projector)
    out_hidden = getattr(settings["vision"], "out_hidden_size", text.hidden_size)  # a tower ending in the decoder's width
    if out_hidden != text.hidden_size:
        raise ModelConfigError(f"vision out_hidden_size {out_hidden} must equal the text hidden size {text.hidden_size}")
    return ModelConfig(arch=arch, text=text, eos_token_ids=eos_ids, raw=raw, **settings)


def fallback_model_config(raw: dict[str, Any], arch: ModelArchitecture) -> ModelConfig:
    """A text-only causal LM on the transformers fallback (``models.fallback_config``)."""
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(arch=arch, text=fallback_text_config(raw), eos_token_ids=eos_ids, raw=raw)


def with_model_impl(cfg: ModelConfig, model_impl: str) -> ModelConfig:
    """``cfg`` under vLLM's ``--model-impl``: ``auto`` keeps Strata's own family where there is one, else
    the transformers fallback; ``strata`` refuses the fallback; ``transformers`` runs a text-only causal LM
    on transformers' modules even when Strata has its family (to compare the two, or to work around ours)."""
    if model_impl not in MODEL_IMPLS:
        raise ModelConfigError(f"model_impl {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    if model_impl == "strata" and cfg.arch.fallback:
        raise ModelConfigError(f"{cfg.arch.name} has no Strata implementation (model_impl strata): use "
                               "model_impl auto or transformers for transformers' modules")
    if model_impl != "transformers" or cfg.arch.fallback:
        return cfg
    if cfg.takes_images or cfg.arch.text_config_key is not None:
        raise ModelConfigError(f"{cfg.arch.name} is a composite model: model_impl transformers serves text-only "
                               "causal LMs")
    arch = fallback_architecture(cfg.raw)
    if arch is None:
        raise ModelConfigError(f"transformers has no causal LM for model_type {cfg.raw.get('model_type')!r}")
    return fallback_model_config(cfg.raw, arch)


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


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate ``model_dir/config.json`` (works before the weights arrive)."""
    raw = read_config_json(model_dir)
    try:
        return parse_model_config(raw)
    except KeyError as exc:
        raise ModelConfigError(f"config.json is missing required field {exc}") from None
