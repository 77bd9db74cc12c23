"""Memory planning from ``config.json`` alone, so a deployment can be sized before the weights arrive.

Everything here is arithmetic on the parsed config: no tensors, no safetensors, no torch.
Byte sizes are binary throughout (KiB = 1024 bytes, GiB = 2^30 bytes).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from strata.pipeline.models.model_config import (
    ModelConfig,
    ModelConfigError,
    MoonViTConfig,
    QwenVisionConfig,
    parse_model_config,
)
from strata.pipeline.parallel.shard_plan import ShardingError, ShardPlan
from strata.planning.kv_bytes import (compressed_windows, kv_bytes_per_block, kv_bytes_per_token, linear_state_bytes,
                                      sliding_layers, sparse_read_bytes, window_kv_bytes)
from strata.planning.model_shapes import BUILTIN_SHAPES
from strata.planning.param_counts import count_params, image_tokens, text_params

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_COUNT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KM]?)\s*$", re.IGNORECASE)
ModelShape = ModelConfig


def parse_count(text: str) -> int:
    """Token counts for "8192", "128K" or "1M": K = 1,000 and M = 1,000,000 (decimal, as in "1M context")."""
    match = _COUNT_RE.match(str(text))
    if not match:
        raise ValueError(f"invalid token count {text!r}: expected an integer, optionally with K (x1000) or M (x1000000), e.g. 8192, 128K, 1M")
    value = Fraction(match.group(1)) * {"": 1, "K": 1000, "M": 1_000_000}[match.group(2).upper()]
    if value.denominator != 1:
        raise ValueError(f"invalid token count {text!r}: not a whole number of tokens")
    return int(value)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # as EngineConfig.kv_cache_dtype


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def load_model_shape(path: str | Path) -> tuple[Path, ModelShape]:
    """Parse ``config.json`` (a path to it, or its directory) of any registered architecture, or a named
    shape from :data:`BUILTIN_SHAPES` (``kimi-k2``, ``deepseek-v3``)."""
    if str(path) in BUILTIN_SHAPES:
        return Path(f"builtin:{path}"), parse_model_config(BUILTIN_SHAPES[str(path)])
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ModelConfigError(f"no config.json at {path}: pass a checkpoint directory or the config.json file")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {config_path} as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{config_path} is not a JSON object")
    try:
        return config_path, parse_model_config(raw)
    except KeyError as exc:
        raise ModelConfigError(f"{config_path} is missing required field {exc}") from exc
    except ModelConfigError:
        raise
    except (AttributeError, TypeError, ValueError) as exc:
        raise ModelConfigError(f"{config_path} has an invalid value: {exc}") from exc


# A checkpoint name for each role of ShardPlan.params_by_role that a quantization_config may store quantized;
# the other roles stay in the compute dtype (embeddings, LM head and routers as releases keep them; MLA's
# kv_b_proj because Strata expands it at load for the absorbed attention).
ROLE_MODULES = {"attention": "model.layers.0.self_attn.o_proj", "dense_mlp": "model.layers.0.mlp.down_proj",
                "shared_experts": "model.layers.0.mlp.shared_experts.down_proj",
                "experts": "model.layers.0.mlp.experts.0.down_proj"}


def decoder_weight_bytes(shape: ModelShape, plan: ShardPlan, elem: int) -> int:
    """Bytes of one rank's decoder weights: each role in the format the checkpoint stores it in."""
    total = 0
    for role, count in plan.params_by_role().items():
        fmt = shape.quant.format_for(ROLE_MODULES[role]) if shape.quant is not None and role in ROLE_MODULES else None
        total += round(count * (fmt.bytes_per_weight(shape.text.hidden_size) if fmt is not None else elem))
    return total


def weight_formats(shape: ModelShape, dtype: str) -> str:
    """Which roles are stored in which format, in words ("" for a dense checkpoint)."""
    if shape.quant is None:
        return ""
    by_format: dict[str, list[str]] = {}
    for role, module in ROLE_MODULES.items():
        fmt = shape.quant.format_for(module)
        if fmt is not None:
            by_format.setdefault(fmt.name(), []).append(role.replace("_", " "))
    stored = "; ".join(f"{', '.join(roles)} in {name}" for name, roles in by_format.items())
    return f"{stored}; the rest in {dtype}" if stored else f"nothing quantized that the planner sizes; all in {dtype}"


def activation_bytes(shape: ModelShape, elem_bytes: int, chunk_tokens: int, staging_tokens: int, concurrency: int) -> int:
    """Estimate (not a measurement) of the peak transient memory of one step.

    Prefill chunk: ``chunk_tokens x (4 x hidden + 3 x intermediate x k) x dtype bytes`` for the
    residual / normed / attention-output / q buffers and the gate / up / product MLP buffers
    (k = experts per token for MoE, else 1), plus fp32 attention scores for the chunk against
    the staged KV, ``chunk_tokens x num_heads x staging_tokens x 4``, plus one fp32 logits row
    per running sequence, ``concurrency x vocab x 4``. For LLaVA, the vision encoder runs one
    image at a time: ``(patches + 1) x (4 x hidden + intermediate) x dtype bytes`` plus its fp32
    scores ``heads x (patches + 1)^2 x 4``; the larger of the two phases is taken. Allocator
    fragmentation and framework workspaces are not modelled: keep some slack.
    """
    tc = shape.text
    ffn = tc.intermediate_size
    if tc.moe is not None:
        ffn = max(ffn, tc.moe.intermediate_size * (tc.moe.experts_per_tok + tc.moe.n_shared_experts))
    prefill = chunk_tokens * (4 * tc.hidden_size + 3 * ffn) * elem_bytes
    prefill += chunk_tokens * tc.num_heads * staging_tokens * 4 + concurrency * tc.vocab_size * 4
    if shape.vision is None:
        return prefill
    vc = shape.vision
    n = image_tokens(shape) * vc.merge_group if isinstance(vc, (MoonViTConfig, QwenVisionConfig)) \
        else vc.num_patches + vc.class_token
    encode = n * (4 * vc.hidden_size + vc.intermediate_size) * elem_bytes + vc.num_heads * n * n * 4
    return max(prefill, encode)


@dataclass(frozen=True)
class MemoryPlan:
    """Where weights, activations and KV blocks go for ``concurrency`` sequences of ``context_tokens``."""

    config_path: str
    model_type: str
    multimodal: bool
    num_params: int
    dtype: str
    context_tokens: int
    concurrency: int
    block_size: int
    chunk_tokens: int
    staging_blocks: int
    weights_bytes: int
    kv_bytes_per_token: int
    bytes_per_block: int
    blocks_needed: int
    kv_bytes_needed: int
    activation_bytes: int
    staging_bytes: int
    working_set_blocks: int
    device_mem_bytes: int
    host_mem_bytes: int
    disk_bytes: int
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    fits: bool
    reason: str
    tp: int = 1  # tensor-parallel ranks of the language stage; the sizes above are per rank
    nodes: int = 1
    encoder_weights_bytes: int = 0  # tp > 1: the vision encoder and projector, in their own replica
    rank_bytes_per_block: int = 0  # one rank's KV heads of a block (bytes_per_block when tp is 1)
    nodes_needed: int | None = None  # when it does not fit: fewest nodes (same ranks per node) that fit
    tp_needed: int | None = None
    image_tokens: int = 0  # tokens of one image (at native resolution: the largest the processor allows)
    kv_kind: str = ""  # what a token caches, in words ("K+V of 8 heads x 128", "MLA latent 512+64")
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_rank: int = 0  # routed experts one rank holds (experts split whole: expert parallelism)
    weight_formats: str = ""  # which roles a quantized checkpoint stores in which format ("" when dense)
    kv_cache_dtype: str = "auto"  # auto: the KV cache stores ``dtype``; fp8: e4m3, one byte a value
    window_kv_bytes: int = 0  # sliding-window layers' device slots, all sequences (fixed; in kv_bytes_needed)
    state_bytes_per_sequence: int = 0  # linear-attention layers' state, one sequence (fixed, on the device)
    rank_state_bytes: int = 0  # one rank's part of it (its heads'; the whole when tp is 1)
    sparse_step: tuple[int, int] = (0, 0)  # DSA, per sequence: (indexer keys kept on device, latents read a step)
    index_mirror_bytes: int = 0  # DSA with lower tiers: device room for spilled blocks' indexer keys (per rank)
    nodes_without_tiers: int | None = None  # with host or disk given: fewest nodes that hold all KV on device

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nodes

    @property
    def total_blocks(self) -> int:
        return self.device_blocks + self.host_blocks + self.disk_blocks

    @property
    def fixed_device_bytes(self) -> int:
        """Device memory that is not KV blocks: weights, activations and the staging buffer."""
        return self.weights_bytes + self.activation_bytes + self.staging_bytes


def _verdict(p: dict[str, Any]) -> str:
    """Empty when the plan fits, else the first reason it does not."""
    fixed = p["weights_bytes"] + p["activation_bytes"] + p["staging_bytes"]
    if fixed > p["device_mem_bytes"]:
        return (f"weights + activations + staging need {format_bytes(fixed)} but the device has "
                f"{format_bytes(p['device_mem_bytes'])}")
    if p["device_blocks"] < p["working_set_blocks"]:
        return (f"device holds {p['device_blocks']:,} KV blocks, fewer than the working set of "
                f"{p['working_set_blocks']:,} ({p['working_set_blocks'] // p['concurrency']:,} per sequence x {p['concurrency']})")
    total = p["device_blocks"] + p["host_blocks"] + p["disk_blocks"]
    if total < p["blocks_needed"]:
        short = (p["blocks_needed"] - total) * p["bytes_per_block"]
        return (f"KV needs {p['blocks_needed']:,} blocks ({format_bytes(p['kv_bytes_needed'])}) but device + host + disk hold "
                f"{total:,}; add at least {format_bytes(short)} of host or disk")
    if p["blocks_needed"] > p["device_blocks"] and p["staging_blocks"] < 1:
        return "KV spills past the device but staging is 0 blocks: spilled blocks could not be attended to"
    return ""


def plan_memory(
    config: str | Path, context_tokens: int, concurrency: int, device_mem_bytes: int, host_mem_bytes: int = 0,
    disk_bytes: int = 0, dtype: str = "bfloat16", block_size: int = 16, chunk_tokens: int = 512, staging_blocks: int = 64,
    tp: int = 1, nodes: int = 1, kv_cache_dtype: str = "auto",
) -> MemoryPlan:
    """Plan memory for ``concurrency`` sequences of ``context_tokens`` from ``config`` (config.json or its
    directory, or a built-in shape name).

    With ``tp`` > 1 the language stage is a tensor-parallel group of ``tp`` ranks over ``nodes`` nodes:
    ``device_mem_bytes`` is one rank's device, the weights, activations and KV per block are one rank's
    share (the largest), and the host and disk tiers (whole blocks, on the driver's node) are as given.
    When the plan does not fit, :attr:`MemoryPlan.nodes_needed` is the fewest nodes, at the same ranks
    per node, whose group would. ``kv_cache_dtype`` fp8 counts a KV value as one byte in every tier.
    """
    def fewest_nodes(host: int, disk: int) -> int | None:
        """The fewest nodes, at this plan's ranks per node, whose group fits with these tiers."""
        per_node = tp // nodes
        for n in range(1, MAX_NODES + 1):
            try:
                bigger = _plan(config, context_tokens, concurrency, device_mem_bytes, host, disk, dtype, block_size,
                               chunk_tokens, staging_blocks, n * per_node, n, kv_cache_dtype)
            except ShardingError:
                continue  # that many ranks do not split the model
            if bigger.fits:
                return n
        return None

    plan = _plan(config, context_tokens, concurrency, device_mem_bytes, host_mem_bytes, disk_bytes, dtype,
                 block_size, chunk_tokens, staging_blocks, tp, nodes, kv_cache_dtype)
    if tp == 1 and nodes == 1:
        return plan
    if not plan.fits and (needed := fewest_nodes(host_mem_bytes, disk_bytes)) is not None:
        plan = replace(plan, nodes_needed=needed, tp_needed=needed * (tp // nodes))
    if host_mem_bytes or disk_bytes:
        plan = replace(plan, nodes_without_tiers=fewest_nodes(0, 0))
    return plan


MAX_NODES = 64  # how far the planner looks for a group that fits


def _plan(
    config: str | Path, context_tokens: int, concurrency: int, device_mem_bytes: int, host_mem_bytes: int,
    disk_bytes: int, dtype: str, block_size: int, chunk_tokens: int, staging_blocks: int, tp: int, nodes: int,
    kv_cache_dtype: str = "auto",
) -> MemoryPlan:
    for name, value in (("context_tokens", context_tokens), ("concurrency", concurrency),
                        ("block_size", block_size), ("chunk_tokens", chunk_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (("staging_blocks", staging_blocks), ("device memory", device_mem_bytes),
                        ("host memory", host_mem_bytes), ("disk", disk_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if tp < 1 or nodes < 1 or tp % nodes:
        raise ValueError(f"tp ({tp}) must be a multiple of nodes ({nodes}), both >= 1")
    elem = dtype_bytes(dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    config_path, shape = load_model_shape(config)
    tc = shape.text
    num_params = count_params(shape)
    kv_elem = elem if kv_cache_dtype == "auto" else 1
    per_block = kv_bytes_per_block(tc, kv_elem, block_size)
    per_token = per_block // block_size if tc.compressed is not None else kv_bytes_per_token(tc, kv_elem)
    encoder = (num_params - text_params(tc)) * elem  # vision tower and projector, never quantized here
    weights, worker_shape, rank_block = decoder_weight_bytes(shape, ShardPlan(tc, 0, 1), elem) + encoder, shape, per_block
    states = linear_state_bytes(tc, elem)  # one sequence's; the device holds them for every running one
    rank_states = states  # a rank's part of them (its heads')
    if tp > 1:
        rank0 = ShardPlan(tc, 0, tp)  # raises ShardingError for a tp the model does not split into
        weights = max(decoder_weight_bytes(shape, ShardPlan(tc, r, tp), elem) for r in range(tp))
        worker_shape = replace(shape, text=replace(rank0.local_config(), vocab_size=tc.vocab_size), vision=None)
        rank_block = per_block * (rank0.kv_heads[1] - rank0.kv_heads[0]) // tc.kv_cache_heads
        rank_states = linear_state_bytes(rank0.local_config(), elem)
    blocks_needed = concurrency * math.ceil(context_tokens / block_size)
    windowed = window_kv_bytes(tc, kv_elem, block_size, concurrency, chunk_tokens, blocks_needed)
    rank_windowed = windowed * rank_block // per_block if per_block else windowed
    p: dict[str, Any] = dict(
        config_path=str(config_path), model_type=tc.model_type, multimodal=shape.vision is not None,
        num_params=num_params, dtype=dtype, context_tokens=context_tokens, concurrency=concurrency,
        block_size=block_size, chunk_tokens=chunk_tokens, staging_blocks=staging_blocks,
        weights_bytes=weights, kv_bytes_per_token=per_token, bytes_per_block=per_block,
        blocks_needed=blocks_needed, kv_bytes_needed=blocks_needed * per_block + windowed + concurrency * states,
        window_kv_bytes=windowed, state_bytes_per_sequence=states, sparse_step=sparse_read_bytes(tc, kv_elem, context_tokens),
        activation_bytes=activation_bytes(worker_shape, elem, chunk_tokens, staging_blocks * block_size, concurrency),
        staging_bytes=staging_blocks * per_block,
        working_set_blocks=(math.ceil(chunk_tokens / block_size) + 1) * concurrency,
        device_mem_bytes=device_mem_bytes, host_mem_bytes=host_mem_bytes, disk_bytes=disk_bytes,
        host_blocks=host_mem_bytes // per_block, disk_blocks=disk_bytes // per_block,
    )
    # DSA with lower tiers: the device keeps spilled blocks' indexer keys, one context's (``kvstore.layer_mirror``)
    p["index_mirror_bytes"] = p["sparse_step"][0] if host_mem_bytes or disk_bytes else 0
    free = device_mem_bytes - p["weights_bytes"] - p["activation_bytes"] - p["staging_bytes"] - rank_windowed \
        - concurrency * rank_states - p["index_mirror_bytes"]
    p["device_blocks"] = max(0, free) // rank_block  # every rank holds every block id, its heads of each
    reason = _verdict(p)
    if tc.mla is not None:
        kv_kind = f"MLA latent {tc.mla.kv_lora_rank}+{tc.mla.qk_rope_head_dim}" + \
            (f" + DSA indexer key {tc.dsa.head_dim}" if tc.dsa is not None else "") + " per layer"
    elif tc.compressed is not None:
        c = tc.compressed
        kv_kind = "pooled entries: " + ", ".join(
            f"{len(c.layers_at(r))} layers {r}:1 of {c.head_dim}" + (f" + an indexer key of {c.index_dim}"
                                                                     if c.is_sparse(r) else "")
            for r in c.rates) + \
            "; windows of K=V and projections (" + "/".join(str(w) for w, _, _ in compressed_windows(tc)) + " tokens)"
    else:
        kv_kind = f"K+V of {tc.num_kv_heads} heads x {tc.head_dim} per layer"
    if windowed and tc.compressed is None:
        sliding = sliding_layers(tc)
        kv_kind += f", on {tc.num_layers - len(sliding)} of {tc.num_layers} layers ({len(sliding)} slide over " \
                   f"{'/'.join(str(w) for w in sorted(set(sliding)))} tokens)"
    if states:
        kv_kind += f", on {tc.num_layers - sum(tc.linear_layers)} of {tc.num_layers} layers (the others linear)"
    experts_per_rank = 0
    if tc.num_experts:
        lo, hi = ShardPlan(tc, 0, tp).experts
        experts_per_rank = hi - lo
    return MemoryPlan(**p, fits=not reason, reason=reason, tp=tp, nodes=nodes, encoder_weights_bytes=encoder if tp > 1 else 0,
                      weight_formats=weight_formats(shape, dtype), kv_cache_dtype=kv_cache_dtype,
                      rank_bytes_per_block=rank_block, rank_state_bytes=rank_states, kv_kind=kv_kind, num_experts=tc.num_experts,
                      image_tokens=image_tokens(shape) if shape.vision is not None else 0,
                      experts_per_rank=experts_per_rank)


def format_bytes(n: int) -> str:
    """Binary human units: 131072 -> "128.00 KiB"."""
    if n < 1024:
        return f"{n} B"
    for exp, unit in ((5, "PiB"), (4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**exp:
            return f"{n / 1024**exp:.2f} {unit}"
    return f"{n} B"  # unreachable
