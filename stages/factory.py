"""Builds the four stages for one process and composes them into the in-process engine."""

from __future__ import annotations

from pathlib import Path

from kernels import get_attention_backend
from kvstore import BlockPool, KVLayout, LowerTiers, TieredKVCache, model_fingerprint
from pipeline.config import EngineConfig
from pipeline.engine import Engine
from pipeline.engine_core import EngineCore
from pipeline.model_config import load_llava_config
from pipeline.model_loader import load_language_model, resolve_dtype
from pipeline.model_runner import ModelRunner
from pipeline.scheduler import Scheduler
from pipeline.tokenizer import PromptTokenizer
from pipeline.weights import weights_digest
from stages.decoder import Decoder
from stages.prefiller import Prefiller
from stages.preprocessor import Preprocessor
from stages.vision_encoder import VisionEncoder


def build_kv_cache(config: EngineConfig, layout: KVLayout, fingerprint: bytes) -> TieredKVCache:
    """The device pool plus whichever lower tiers the config gives capacity to."""
    lower = LowerTiers.open(
        layout,
        fingerprint,
        host_dir=config.resolved_host_kv_dir() if config.host_kv_blocks else None,
        host_blocks=config.host_kv_blocks,
        disk_dir=config.resolved_disk_kv_dir() if config.disk_kv_blocks else None,
        disk_blocks=config.disk_kv_blocks,
    )
    pool = BlockPool(layout, config.num_kv_blocks, config.device)
    return TieredKVCache(pool, lower, config.kv_staging_blocks)


def build_engine(model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
    """Load a checkpoint and wire Preprocessor -> VisionEncoder -> Prefiller -> Decoder in this process.

    Prefiller and Decoder share one model and one device block pool here, so a hand-off is
    just a KVHandle naming blocks already in place.
    """
    config = config or EngineConfig()
    config.validate()
    model_dir = Path(model_dir)
    cfg = load_llava_config(model_dir)
    dtype = resolve_dtype(config.dtype)
    tokenizer = PromptTokenizer(model_dir, cfg)
    preprocessor = Preprocessor.from_model_dir(model_dir, max_pixels=config.max_image_pixels)
    encoder = VisionEncoder(model_dir, config, cfg)
    model, _ = load_language_model(model_dir, dtype, config.device, cfg)
    layout = KVLayout(cfg.text.num_layers, cfg.text.num_kv_heads, cfg.text.head_dim, config.block_size, dtype)
    fingerprint = model_fingerprint(cfg.text.model_type, weights_digest(model_dir), config.dtype, config.block_size)
    kv = build_kv_cache(config, layout, fingerprint)
    runner = ModelRunner(model, kv, get_attention_backend(config.attention_backend, config.device), config.device)

    def core() -> EngineCore:
        return EngineCore(Scheduler(config, kv, fingerprint), runner, tokenizer.decode, tokenizer.eos_token_ids)

    return Engine(
        config,
        cfg,
        tokenizer,
        preprocessor,
        encoder,
        Prefiller(core()),
        Decoder(core()),
    )
