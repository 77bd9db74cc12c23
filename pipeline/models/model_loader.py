"""Build our modules for one stage on the meta device, then stream exactly their weights in."""

from __future__ import annotations

from pathlib import Path

import torch

from strata.pipeline.models.decoder import LanguageModel
from strata.pipeline.models.deepseek_v4 import V4LanguageModel
from strata.pipeline.models.deepseek_v4_parallel import ParallelV4LanguageModel
from strata.pipeline.models.fallback_model import TransformersLanguageModel, load_transformers_model
from strata.pipeline.models.image_encoder import ImageEncoderModel
from strata.pipeline.models.model_config import ModelConfig, ModelConfigError, load_model_config
from strata.pipeline.models.text_config import TextConfig
from strata.pipeline.models.quant_loading import check_tp_split, quantized_modules
from strata.pipeline.models.tensor_parallel import ParallelLanguageModel
from strata.pipeline.models.weight_formats import WeightFormatError
from strata.pipeline.models.load_plan import LoadPlan, plan_load
from strata.pipeline.models.weights import (LoadStats, load_weights, quant_collector, text_tensor_names,
                                           weight_map)
from strata.pipeline.parallel.shard_plan import ShardingError, ShardPlan
from strata.pipeline.parallel.tp_group import TPGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> torch.dtype:
    """What the KV cache stores: the model's ``dtype`` (``auto``), or e4m3 for ``fp8``/``fp8_e4m3``."""
    return torch.float8_e4m3fn if kv_cache_dtype in ("fp8", "fp8_e4m3") else resolve_dtype(dtype)


def check_tensor_parallel_split(model_dir: str | Path, cfg: ModelConfig, tp: int) -> None:
    """``tp`` splits the model (:class:`ShardingError` otherwise), and every rank's slice of every quantized
    tensor starts on a block or group boundary, named when it does not: checked before any rank starts."""
    if cfg.arch.fallback and tp > 1:
        raise ShardingError(f"{cfg.arch.name} runs on the transformers fallback, which does not split across "
                            "tensor-parallel ranks: use tp 1")
    ShardPlan(cfg.text, 0, tp)
    if cfg.quant is None or tp == 1:
        return
    formats = quantized_modules(cfg.quant, text_tensor_names(weight_map(Path(model_dir)), cfg.arch))
    try:
        check_tp_split(formats, [ShardPlan(cfg.text, rank, tp) for rank in range(tp)])
    except WeightFormatError as exc:
        raise ShardingError(str(exc)) from None


def check_layers_in_weights(model_dir: str | Path, cfg: ModelConfig) -> None:
    """The decoder's layer count is one the checkpoint's tensors hold (read from the index or the shard
    headers, before anything is built): a config that asks for more layers than were shipped is refused by
    name. More is fine: DeepSeek's multi-token-prediction layer sits past ``num_hidden_layers``. The
    transformers fallback's names are transformers' to map: its loader refuses a missing tensor itself."""
    if cfg.arch.fallback:
        return
    held: set[int] = set()
    for name in weight_map(Path(model_dir)):
        target = cfg.arch.map_name(name)
        if target is not None and target[0] == "text" and target[1].startswith("layers."):
            index = target[1].split(".", 2)[1]
            if index.isdigit():
                held.add(int(index))
    missing = next((i for i in range(cfg.text.num_layers) if i not in held), None)
    if missing is not None:
        raise ModelConfigError(f"config.json says {cfg.text.num_layers} decoder layers, but the weights hold "
                               f"{len(held)} (layer {missing} is missing)")
    mtp = next((i for i in range(cfg.text.num_layers, cfg.text.cached_layers) if i not in held), None)
    if mtp is not None:
        raise ModelConfigError(f"config.json says num_nextn_predict_layers, but the weights hold no layer {mtp} "
                               "(its multi-token-prediction layer): speculative method mtp cannot run")


def language_model(text: TextConfig) -> LanguageModel:
    """The decoder of a text config: DeepSeek-V4's own (mHC streams, compressed attention), or the shared one."""
    return V4LanguageModel(text) if text.compressed is not None else LanguageModel(text)


def plan_model_load(model_dir: str | Path, cfg: ModelConfig | None = None) -> LoadPlan:
    """The load of every part of the model, planned against the checkpoint's tensor names with the
    modules built on the meta device (nothing allocated, nothing read): what ``strata ops`` reports."""
    cfg = cfg or load_model_config(model_dir)
    if cfg.arch.fallback:
        raise ModelConfigError(f"{cfg.arch.name} loads through transformers (the fallback), which maps its own "
                               "tensor names")
    mapping = weight_map(Path(model_dir))
    with torch.device("meta"):
        modules: dict[str, torch.nn.Module] = {"text": language_model(cfg.text)}
        if cfg.takes_images:
            encoder = ImageEncoderModel(cfg)
            modules.update(vision=encoder.vision_tower, projector=encoder.projector)
        quantized = quant_collector(cfg.quant, modules, mapping, cfg.arch, None)
    return plan_load(mapping, modules, cfg.arch, quantized)


def load_language_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", cfg: ModelConfig | None = None
) -> tuple[LanguageModel | TransformersLanguageModel, LoadStats]:
    """The prefill/decode stages' model: the decoder only, never the vision tower. An architecture on the
    transformers fallback (``cfg.arch.fallback``) is transformers' model with Strata's paged attention."""
    cfg = cfg or load_model_config(model_dir)
    if cfg.arch.fallback:
        return load_transformers_model(model_dir, cfg, dtype, device)
    check_layers_in_weights(model_dir, cfg)
    with torch.device("meta"):
        model = language_model(cfg.text)
    stats = load_weights(model_dir, {"text": model}, dtype=dtype, device=device, arch=cfg.arch, quant=cfg.quant)
    model.fuse_projections()
    return model.eval(), stats


def load_parallel_language_model(
    model_dir: str | Path, group: TPGroup, dtype: torch.dtype = torch.float32, device: str = "cpu",
    cfg: ModelConfig | None = None,
) -> tuple[ParallelLanguageModel, LoadStats]:
    """This rank's shard of the decoder, reading only its slices of the checkpoint. Rank 0 checks
    the SHA-256 manifest (which reads whole shard files); the other ranks trust it."""
    cfg = cfg or load_model_config(model_dir)
    check_layers_in_weights(model_dir, cfg)
    plan = ShardPlan(cfg.text, group.rank, group.size)
    with torch.device("meta"):
        model = (ParallelV4LanguageModel(plan, group) if cfg.text.compressed is not None
                 else ParallelLanguageModel(plan, group))
    stats = load_weights(model_dir, {"text": model}, dtype=dtype, device=device, verify=group.is_driver, shard=plan,
                         arch=cfg.arch, quant=cfg.quant)
    model.fuse_projections()
    return model.eval(), stats


def load_image_encoder(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", cfg: ModelConfig | None = None
) -> tuple[ImageEncoderModel, LoadStats]:
    """The encoder stage's model: vision tower + projector, never the decoder."""
    cfg = cfg or load_model_config(model_dir)
    if not cfg.takes_images:
        raise ValueError(f"{cfg.arch.name} is a text-only model: it has no vision encoder")
    with torch.device("meta"):
        model = ImageEncoderModel(cfg)
    stats = load_weights(model_dir, {"vision": model.vision_tower, "projector": model.projector}, dtype=dtype,
                         device=device, arch=cfg.arch)
    return model.eval(), stats
