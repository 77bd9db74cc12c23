"""Compute kernels behind one interface: paged attention, LSE merge, norms, RoPE, MoE.

Imports torch only. Backends are chosen at run time through
:func:`strata.kernels.backends.get_attention_backend`; the torch backend is the exact
reference every other backend is tested against.
"""

from strata.kernels.attention_metadata import AttentionMetadata, SpilledKV
from strata.kernels.attention_tiers import attend_spilled
from strata.kernels.attention_torch import TorchAttentionBackend, dense_attention, segment_attention
from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.backends import available_backends, get_attention_backend
from strata.kernels.cache_ops import write_cache, write_kv
from strata.kernels.linear import linear
from strata.kernels.merge import merge_attention_states
from strata.kernels.moe import moe_experts, moe_route, moe_route_grouped
from strata.kernels.norm import layer_norm, rms_norm
from strata.kernels.rope import RotaryEmbedding, apply_rope, rotate_fp32, rotate_heads, signed_sin

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "SpilledKV",
    "RotaryEmbedding",
    "TorchAttentionBackend",
    "apply_rope",
    "attend_spilled",
    "available_backends",
    "dense_attention",
    "get_attention_backend",
    "layer_norm",
    "linear",
    "merge_attention_states",
    "moe_experts",
    "moe_route",
    "moe_route_grouped",
    "rms_norm",
    "rotate_fp32",
    "rotate_heads",
    "segment_attention",
    "signed_sin",
    "write_cache",
    "write_kv",
]
