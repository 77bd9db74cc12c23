"""Compute kernels behind one interface: paged attention, LSE merge, norms, RoPE, MoE.

Imports torch only. Backends are chosen at run time through
:func:`kernels.backends.get_attention_backend`; the torch backend is the exact
reference every other backend is tested against.
"""

from kernels.attention_metadata import AttentionMetadata, OffloadedKV
from kernels.attention_tiers import attend_offloaded
from kernels.attention_torch import TorchAttentionBackend, dense_attention
from kernels.backends import AttentionBackend, available_backends, get_attention_backend
from kernels.cache_ops import write_kv
from kernels.merge import merge_attention_states
from kernels.moe import moe_experts, moe_route
from kernels.norm import layer_norm, rms_norm
from kernels.rope import RotaryEmbedding, apply_rope

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "OffloadedKV",
    "RotaryEmbedding",
    "TorchAttentionBackend",
    "apply_rope",
    "attend_offloaded",
    "available_backends",
    "dense_attention",
    "get_attention_backend",
    "layer_norm",
    "merge_attention_states",
    "moe_experts",
    "moe_route",
    "rms_norm",
    "write_kv",
]
