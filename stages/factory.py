"""Builds the four stages for one process and composes them into the in-process engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from strata.kernels import get_attention_backend
from strata.kernels.threads import apply_threads
from strata.kvstore import BlockPool, KVLayout, LowerTiers, TieredKVCache
from strata.kvstore.state_cache import StateCache
from strata.kvstore.state_pool import StatePool
from strata.kvstore.state_tiers import StateTiers
from strata.kvstore.window_slots import window_slot_counts
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.core.compiled import compile_model
from strata.pipeline.core.engine import Engine
from strata.pipeline.core.engine_core import EngineCore
from strata.pipeline.core.grammar import GrammarRunner
from strata.pipeline.core.model_runner import ModelRunner
from strata.pipeline.core.scheduler import Scheduler
from strata.pipeline.core.tp_runner import ShardedDeviceBlocks, TPModelRunner, calibrate_group, share_kv_scales
from strata.pipeline.core.tp_states import ShardedStatePool, StateShard
from strata.pipeline.core.tp_workers import Launcher
from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.models.cache_groups import mirrored_groups
from strata.pipeline.models.fallback_config import check_fallback_engine
from strata.pipeline.models.linear_mixer import state_kinds, state_slot_counts
from strata.pipeline.models.model_config import load_model_config, with_model_impl
from strata.pipeline.models.text_config import TextConfig
from strata.pipeline.models.kv_scales import (CALIBRATION_TEXT, calibration_amax, scales_from_amax, set_kv_scales,
                                              shared_scales)
from strata.pipeline.models.model_identity import kv_fingerprint
from strata.pipeline.models.model_loader import load_language_model, resolve_dtype
from strata.pipeline.models.mtp import check_mtp_engine, with_mtp
from strata.pipeline.parallel.shard_plan import ShardPlan
from strata.pipeline.parallel.tp_group import TPGroup
from strata.stages.decode_service import DecodeService
from strata.stages.decoder import Decoder
from strata.stages.prefill_service import PrefillService
from strata.stages.prefiller import Prefiller
from strata.stages.image_preprocessing import image_preprocessor
from strata.stages.kv_budget import kv_dtype, kv_layout, with_kv_budget
from strata.kvstore.layer_mirror import SpilledLayerMirror, mirror_bytes
from strata.kvstore.sparse_reads import SparseReads
from strata.stages.preflight import check_model_engine
from strata.stages.tensor_parallel import TPGroupHandle, open_group
from strata.stages.vision_encoder import VisionEncoder


def build_kv_cache(config: EngineConfig, layout: KVLayout, fingerprint: bytes, group: TPGroup | None = None,
                   kv_replicas: int = 1) -> TieredKVCache:
    """The device pool plus whichever lower tiers the config gives capacity to. In a tensor-parallel
    group the pool holds this rank's KV heads, and whole blocks cross to the tiers through the group."""
    lower = LowerTiers.open(
        layout,
        fingerprint,
        host_dir=config.resolved_host_kv_dir() if config.host_kv_blocks else None,
        host_blocks=config.host_kv_blocks,
        disk_dir=config.resolved_disk_kv_dir() if config.disk_kv_blocks else None,
        disk_blocks=config.disk_kv_blocks,
        write_queue_blocks=config.kv_write_queue_blocks,
        prefetch_blocks=config.kv_prefetch_blocks,
    )
    slots = window_slot_counts(layout, config.num_kv_blocks, config.max_num_seqs, config.max_num_batched_tokens)
    if group is None or group.size == 1:
        pool = BlockPool(layout, config.num_kv_blocks, config.device, slots)
        return TieredKVCache(pool, lower, config.kv_staging_blocks, fingerprint)
    pool = BlockPool(layout.per_rank(group.size), config.num_kv_blocks, config.device, slots)  # rank 0's KV heads
    return TieredKVCache(pool, lower, config.kv_staging_blocks, fingerprint, layout,
                         ShardedDeviceBlocks(pool, group, layout, kv_replicas))


class LanguageStage:
    """What an LLM stage process loads: tokenizer, model runner over its own tiered KV cache; with
    ``config.tp`` > 1 this process is rank 0 of a tensor-parallel group ``launcher`` starts the rest of."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, launcher: Launcher | None = None,
                 group_host: str = "127.0.0.1") -> None:
        self._restore_threads = apply_threads(config.num_threads, config.tp)  # undone on close (an engine inside a test process)
        self.model_dir = Path(model_dir)
        spec = config.speculative.method if config.speculative is not None else None
        if spec == "mtp":
            check_mtp_engine(config.tp, config.kv_cache_dtype)
        self.model_config = with_mtp(with_model_impl(load_model_config(self.model_dir), config.model_impl), spec)
        cfg = self.model_config
        if cfg.arch.fallback:
            check_fallback_engine(config)
        check_model_engine(cfg.text, config)
        dtype = resolve_dtype(config.dtype)
        self.tokenizer = PromptTokenizer(self.model_dir, cfg)
        layout = kv_layout(cfg.text, config.block_size, kv_dtype(config))
        config = with_kv_budget(config, self.model_dir, cfg.text)  # before tensor-parallel workers take it
        self.config = config
        backend = get_attention_backend(config.attention_backend, config.device, dtype, kv_dtype=layout.dtype)
        self.tp: TPGroupHandle | None = None
        fp8 = layout.dtype == torch.float8_e4m3fn
        if config.tp > 1:
            self.tp = open_group(self.model_dir, config, cfg, launcher, group_host)
            scales = None
            if fp8:
                group, shard = self.tp.group, self.tp.model
                scales = self._kv_scales(config.dtype, layout, lambda: calibrate_group(
                    group, shard, self._calibration_ids(), config.block_size, backend, config.device))
                share_kv_scales(group, shard, scales)
            self.fingerprint = kv_fingerprint(self.model_dir, self.model_kind, config.dtype, layout, scales)
            self.kv = build_kv_cache(config, layout, self.fingerprint, self.tp.group, self.tp.model.plan.kv_replicas)
            if fp8:
                self.kv.model_key = kv_fingerprint(self.model_dir, self.model_kind, config.dtype, layout)
            if cfg.text.dsa is not None or cfg.text.compressed is not None:
                self._sparse_attention(layout, cfg.text)
            if cfg.text.linear is not None:  # its heads' part of each state here, the rest on the workers
                self.kv.states = linear_state_cache(config, cfg.text, dtype, self.kv, self.tp.group, self.tp.model.plan)
            self.runner: ModelRunner = TPModelRunner(self.tp.model, self.kv, backend, self.tp.group, config.device)
            self.runner.load_stats = self.tp.load_stats
            return
        model, _ = load_language_model(self.model_dir, dtype, config.device, cfg)
        scales = None
        if fp8:
            scales = self._kv_scales(config.dtype, layout, lambda: scales_from_amax(calibration_amax(
                model, self._calibration_ids(), config.block_size, backend, config.device)))
            set_kv_scales(model, scales)
        # after the load: a manifest check there already read each shard, so this costs no second read
        self.fingerprint = kv_fingerprint(self.model_dir, self.model_kind, config.dtype, layout, scales)
        self.kv = build_kv_cache(config, layout, self.fingerprint)
        if fp8:  # a hand-off over another node's scales is then recomputed, not refused (``Decoder.admit``)
            self.kv.model_key = kv_fingerprint(self.model_dir, self.model_kind, config.dtype, layout)
        if cfg.text.dsa is not None or cfg.text.compressed is not None:
            self._sparse_attention(layout, cfg.text)
        if cfg.text.linear is not None:  # linear-attention layers: state slots per running sequence, snapshots
            self.kv.states = linear_state_cache(config, cfg.text, dtype, self.kv)
        self.runner = ModelRunner(model, self.kv, backend, config.device)
        if config.compile:
            self.runner.compile_seconds = compile_model(model, torch.device(config.device), config.max_num_seqs,
                                                       config.max_num_batched_tokens)

    def _sparse_attention(self, layout: KVLayout, text: TextConfig) -> None:
        """Sparse attention's cache settings (DSA, DeepSeek-V4's indexer): under its top-k ties a prefix's KV
        depends on its prompt's length, so blocks are named by it; its reads are counted; what every step reads
        whole of spilled blocks (indexer keys; V4's 128:1 entries) stays on the device while it fits
        (``kvstore.layer_mirror``; a tensor-parallel worker keeps the same copies, following the driver)."""
        self.kv.prompt_keyed, self.kv.sparse_reads = True, SparseReads()
        self.kv.layer_mirror = SpilledLayerMirror(mirror_bytes(layout, mirrored_groups(text), self.config.max_model_len))

    @property
    def model_kind(self) -> str:
        """What computes the cache's keys and values, in its fingerprint: the family, and the transformers
        fallback apart from Strata's own code for it (their blocks are not each other's)."""
        cfg = self.model_config
        return cfg.text.model_type + ("+transformers" if cfg.arch.fallback else "")

    def _kv_scales(self, dtype: str, layout: KVLayout, calibrate: Callable[[], list[tuple[float, float]]]
                   ) -> list[tuple[float, float]]:
        """An FP8 cache's scales: this node's for the model if a process calibrated it, else ``calibrate()``."""
        key = kv_fingerprint(self.model_dir, self.model_kind, dtype, layout)
        return shared_scales(key, layout.num_layers, calibrate)

    def _calibration_ids(self) -> list[int]:
        """The fixed calibration text in this model's tokens (an FP8 cache's scales come from them)."""
        ids = self.tokenizer.tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
        return [i for i in ids if i < self.model_config.text.vocab_size]

    def alive(self) -> bool:
        """False once a tensor-parallel worker died or the group broke (the replica must then be replaced whole)."""
        return self.tp is None or (self.tp.workers.alive() and self.tp.group.broken is None)

    def close(self) -> None:
        """Land queued tier writes, stop the tensor-parallel workers, give the process its thread count back."""
        if self.kv.lower is not None:
            self.kv.lower.flush()
        self._restore_threads()
        if self.tp is not None:
            assert isinstance(self.runner, TPModelRunner)
            self.runner.close()
            self.tp.close()
            self.tp = None

    def core(self, warm_grammar: bool = False) -> EngineCore:
        """A scheduler + sampler loop over this stage's runner and KV cache (``warm_grammar``: a serving stage
        builds the structured-output tokenizer now, in the background, not beside its first request)."""
        scheduler = Scheduler(self.config, self.kv)
        tokenizer = self.tokenizer
        grammar = GrammarRunner(lambda: tokenizer.tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
        if warm_grammar:
            grammar.warm()
        return EngineCore(scheduler, self.runner, tokenizer.decode, tokenizer.eos_token_ids,
                          self.config.request_timeout_s, grammar)


def build_engine(model_dir: str | Path, config: EngineConfig | None = None, launcher: Launcher | None = None,
                 group_host: str = "127.0.0.1") -> Engine:
    """Load a checkpoint and wire Preprocessor -> VisionEncoder -> one engine core in this process: prefill
    and decode share one model, one block pool and one step loop, so nothing is handed off."""
    config = config or EngineConfig()
    stage = LanguageStage(model_dir, config, launcher, group_host)
    preprocessor, encoder = None, None
    if stage.model_config.takes_images:  # a text-only model has no image stages: intake refuses images
        preprocessor = image_preprocessor(stage.model_dir, stage.model_config,
                                          max_pixels=config.max_image_pixels)
        encoder = VisionEncoder(stage.model_dir, config, stage.model_config)
    engine = Engine(
        config, stage.model_config, stage.tokenizer, preprocessor, encoder, stage.core()
    )
    engine.on_close.append(stage.close)
    engine.healthy = stage.alive
    return engine


def build_prefill_service(model_dir: str | Path, config: EngineConfig, launcher: Launcher | None = None,
                          group_host: str = "127.0.0.1") -> PrefillService:
    """A prefill stage for its own process: it hands off to decoders on other pools (host tier)."""
    _require_shared_tier(config)
    stage = LanguageStage(model_dir, config, launcher, group_host)
    service = PrefillService(Prefiller(stage.core(warm_grammar=True), release_on_handoff=True))
    service.on_close = stage.close
    service.healthy = stage.alive
    return service


def build_decode_service(model_dir: str | Path, config: EngineConfig, launcher: Launcher | None = None,
                         group_host: str = "127.0.0.1") -> DecodeService:
    """A decode stage for its own process: adopts handles from any prefill replica via the host tier."""
    _require_shared_tier(config)
    stage = LanguageStage(model_dir, config, launcher, group_host)
    service = DecodeService(Decoder(stage.core(warm_grammar=True)))
    service.on_close = stage.close
    service.healthy = stage.alive
    return service


def linear_state_cache(config: EngineConfig, text: TextConfig, dtype: torch.dtype, kv: TieredKVCache,
                       group: TPGroup | None = None, plan: ShardPlan | None = None) -> StateCache:
    """Two slots per running sequence (the one a step reads, the one it writes) and, with prefix caching,
    one snapshot slot per sequence that may run (``kvstore.state_cache``), the snapshots they evict kept in
    ``kv``'s lower tiers if it has them; under tensor parallelism (``group``, ``plan``: the driver's) the
    driver's heads' part, its changes replayed on the workers (``core.tp_states``)."""
    running, snapshots = state_slot_counts(config)
    layers = sum(text.linear_layers)
    if group is None or plan is None:
        pool = StatePool(state_kinds(text, dtype), layers, running, config.device, snapshots)
    else:
        shard = StateShard(state_kinds(text, dtype), layers, text.linear, plan.rank, plan.size)
        pool = ShardedStatePool(state_kinds(plan.local_config(), dtype), layers, running, config.device, snapshots,
                                group, shard)
    below = StateTiers(kv.lower, kv.layout.bytes_per_block(), pool.bytes_per_sequence()) \
        if kv.lower is not None else None
    return StateCache(pool, snapshots=config.enable_prefix_caching, below=below)


def _require_shared_tier(config: EngineConfig) -> None:
    if not (config.host_kv_blocks > 0 or config.disk_kv_blocks > 0) or not config.enable_prefix_caching:
        raise ValueError("prefill and decode in separate processes share KV through the host tier: "
                         "set host_kv_blocks > 0 and keep prefix caching on")
