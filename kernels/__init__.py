"""Compute kernels behind one interface: paged attention, LSE merge, norms, RoPE, MoE.

Imports torch only. Backends are chosen at run time through
:func:`strata.kernels.backends.get_attention_backend`; the torch backend is the exact
reference every other backend is tested against.
"""


def _hand_the_name_to_hugging_faces_kernels() -> None:
    """Give the top-level name ``kernels`` to Hugging Face's package when this room took it.

    This room is ``strata.kernels``; it is imported as plain ``kernels`` only when a checkout's root is
    on ``sys.path`` (``python -m`` run there, or a Ray worker started from there). transformers >= 5.25
    depends on Hugging Face's ``kernels`` distribution and imports it; finding this room instead, it
    fails (``cannot import name 'CUDAProperties'``). So load the installed package under its own name;
    the import system returns ``sys.modules["kernels"]``, which is then that package. Without it
    installed there is nothing to hand over, and transformers finds no version here, so no kernels.
    """
    import importlib.machinery
    import importlib.util
    import os
    import sys

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return
    package = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = package
    spec.loader.exec_module(package)


if __name__ == "kernels":
    _hand_the_name_to_hugging_faces_kernels()

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
