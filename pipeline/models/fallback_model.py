"""The transformers fallback: any causal LM transformers implements, in Strata's engine.

transformers' own modules run every layer (norms, RoPE, MLP or MoE, whatever the architecture does); its
attention modules call the function registered here under transformers' attention interface
(``AttentionInterface``), which writes each step's keys and values into Strata's paged pool and attends
with Strata's backend (``models.paged_attend``). So chunked prefill, continuous batching, prefix reuse,
the KV tiers and the prefill→decode hand-off work as they do for Strata's own families: the engine sees
the same ``embed`` / ``forward`` / ``logits`` a :class:`~strata.pipeline.models.decoder.LanguageModel` has.

The attention function finds the step's pool, metadata and backend in a context variable the model's
``forward`` sets, so the modules need no change. A model this cannot serve exactly is refused at load,
in one line, by a two-token probe forward: layers that never call the interface (linear attention, a
custom kernel), keys and values of another shape than the config's, a logit softcap, an LM head that
does more than its matrix.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strata.kernels import AttentionBackend, AttentionMetadata
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.model_config import ModelConfig
from strata.pipeline.models.paged_attend import paged_attend
from strata.pipeline.models.text_config import TextConfig
from strata.pipeline.models.weights import LoadStats, WeightsError, checked_shard, read_manifest, shard_files

ATTN_IMPLEMENTATION = "strata_paged"  # the name the modules look the function up by


@dataclass
class _Step:
    """What one forward's attention calls write into and read from."""

    kv: list[torch.Tensor]  # each layer's view of its cache group (``kvstore.DeviceKV.layers``)
    meta: AttentionMetadata
    backend: AttentionBackend


@dataclass
class _AttentionCall:
    module: str
    layer_idx: int | None
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    softcap: float | None


@dataclass
class _Probe:
    """The load-time probe: records every attention call's shapes and answers zeros."""

    calls: list[_AttentionCall] = field(default_factory=list)


_STEP: ContextVar[_Step | _Probe | None] = ContextVar("strata_fallback_step", default=None)


def strata_paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           sliding_window: int | None = None, softcap: float | None = None,
                           s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over Strata's paged pool: q [1, Hq, T, D], k/v [1, Hkv, T, D] in,
    [1, T, Hq, D] out. The mask is unused (transformers builds none for this implementation): causality,
    windows and the sequences' boundaries are the paged metadata's. ``s_aux`` is gpt-oss's sink logits."""
    step = _STEP.get()
    if isinstance(step, _Probe):
        step.calls.append(_AttentionCall(type(module).__name__, getattr(module, "layer_idx", None),
                                         tuple(query.shape), tuple(key.shape), tuple(value.shape), softcap))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    if step is None:
        raise RuntimeError("the strata_paged attention runs inside a Strata step only")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attend(q, k, v, step.kv, module.layer_idx, step.meta, step.backend, scale, sliding_window, s_aux)
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, strata_paged_attention)


class TransformersLanguageModel(nn.Module):
    """A transformers causal LM behind the engine's model interface (``embed``, ``forward``, ``logits``)."""

    compute_dtype: torch.dtype = torch.float32

    def __init__(self, hf: nn.Module, cfg: TextConfig) -> None:
        super().__init__()
        self.hf = hf
        self.cfg = cfg
        self.base = getattr(hf, hf.base_model_prefix)
        self.layers = decoder_layers(self.base)
        self.lm_head = hf.get_output_embeddings()

    def fuse_projections(self) -> None:
        """Nothing to fuse: the layers are transformers' own."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(token_ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Every layer over the step's flattened tokens [T, hidden] as one batch of one: the final-normed
        hidden [T, hidden]. Each attention call pages through ``kv`` with ``meta``."""
        token = _STEP.set(_Step(kv, meta, backend))
        try:
            out = self.base(inputs_embeds=embeds[None], position_ids=positions[None], use_cache=False)
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def decoder_layers(base: nn.Module) -> nn.ModuleList:
    """The base model's decoder layers, where transformers' causal LMs keep them."""
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ModelConfigError(f"{type(base).__name__} keeps no decoder layers where transformers' causal LMs do "
                           "(layers, h, blocks): the transformers fallback cannot run it")


def load_transformers_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                            device: str = "cpu") -> tuple[TransformersLanguageModel, LoadStats]:
    """transformers' model of the checkpoint, its attention on Strata's pool, checked by the probe. The
    shards are checked against the SHA-256 manifest first, as Strata's own loader does."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    stats = LoadStats()
    sums = read_manifest(model_dir)
    for shard in shard_files(model_dir):
        checked_shard(model_dir, shard, sums)
        stats.shards_opened.append(shard)
    _register()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report is read below, not printed
    hf_logging.disable_progress_bar()
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                        output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or []) + sorted(str(m) for m in info.get("mismatched_keys") or [])
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"the checkpoint lacks or misshapes {missing[0]}{more}: transformers would initialise it "
                           "at random")
    unread = sorted(k for k in info.get("unexpected_keys") or [] if not _past_decoder(k, cfg.text.num_layers))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise WeightsError(f"transformers' {cfg.arch.name} loads no tensor {unread[0]}{more}: the checkpoint is not "
                           "the model its config describes")
    hf = hf.to(device).eval()
    model = TransformersLanguageModel(hf, cfg.text)
    model.compute_dtype = dtype
    probe(model)
    return model, stats


@torch.inference_mode()
def probe(model: TransformersLanguageModel) -> None:
    """Two tokens through the model with the attention answering zeros: every layer must call the interface
    once, with keys and values of the config's KV shape and no softcap, and the LM head must be its matrix
    alone (what the engine's ``logits`` computes). Refused in one line otherwise."""
    cfg, hf = model.cfg, model.hf
    name = type(hf).__name__
    record = _Probe()
    token = _STEP.set(record)
    try:
        ids = torch.arange(2, device=model.lm_head.weight.device) % cfg.vocab_size
        embeds = model.embed(ids)[None]
        positions = torch.arange(2, device=ids.device)[None]
        hidden = model.base(inputs_embeds=embeds, position_ids=positions, use_cache=False).last_hidden_state
        full = hf(inputs_embeds=embeds, position_ids=positions, use_cache=False).logits
    finally:
        _STEP.reset(token)
    calls = record.calls[: len(record.calls) // 2]  # the base model's pass (the second is the full model's)
    nameless = next((c for c in calls if c.layer_idx is None), None)
    if nameless is not None:
        raise ModelConfigError(f"{name}: {nameless.module} has no layer_idx, so its keys and values have no layer "
                               "of the KV cache")
    seen = [c.layer_idx for c in calls]
    silent = [i for i in range(cfg.num_layers) if i not in seen]
    if silent:
        layer = model.layers[silent[0]]
        parts = ", ".join(f"{n} {type(m).__name__}" for n, m in layer.named_children()
                          if any(w in n.lower() for w in ("attn", "attention", "mixer", "mamba", "conv"))
                          and "norm" not in n.lower())
        raise ModelConfigError(f"{name}: layers {_ranges(silent)} never call transformers' attention interface "
                               f"({type(layer).__name__}: {parts or 'no attention module'}); linear attention and "
                               "custom kernels keep their own state, which the paged KV cache cannot hold")
    if len(seen) != len(set(seen)):
        raise ModelConfigError(f"{name}: a layer attends more than once per step; the fallback pages one attention "
                               "per layer")
    for c in calls:
        if c.softcap:
            raise ModelConfigError(f"{name}: {c.module} caps its attention logits (softcap {c.softcap:g}), which "
                                   "Strata's paged attention does not")
        shape = (cfg.num_kv_heads, cfg.head_dim)
        if (c.k[1], c.k[3]) != shape or (c.v[1], c.v[3]) != shape or c.q[3] != cfg.head_dim:
            raise ModelConfigError(f"{name}: layer {c.layer_idx}'s {c.module} attends with q {c.q[1]}x{c.q[3]}, k "
                                   f"{c.k[1]}x{c.k[3]}, v {c.v[1]}x{c.v[3]} (heads x size), not the config's "
                                   f"{shape[0]}x{shape[1]} KV heads the paged cache is laid out for")
    head = model.logits(hidden)
    if not torch.allclose(head, full.float(), rtol=1e-5, atol=1e-6):
        raise ModelConfigError(f"{name}'s forward changes the logits after its LM head (a scale or a softcap): the "
                               "transformers fallback computes the head's matrix alone")


def _past_decoder(name: str, num_layers: int) -> bool:
    """A tensor of a layer past ``num_hidden_layers`` (multi-token prediction), which serving does not run."""
    match = _LAYER.search(name)
    return match is not None and int(match.group(1)) >= num_layers


_LAYER = re.compile(r"\blayers\.(\d+)\.")


def _ranges(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:8])) + (f" (and {len(layers) - 8} more)" if len(layers) > 8 else "")
