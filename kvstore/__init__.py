"""Strata KV store: model-agnostic paged KV cache (device tier)."""

from .block_pool import BlockPool, NoFreeBlocksError
from .block_table import BlockTable
from .hashing import (
    DIGEST_SIZE,
    ImageSpan,
    block_extras,
    hash_block,
    hash_chain,
    model_fingerprint,
)
from .handle import HANDLE_VERSION, HandleError, KVHandle
from .layout import KVLayout, dtype_from_name, dtype_name

__all__ = [
    "BlockPool",
    "BlockTable",
    "HANDLE_VERSION",
    "HandleError",
    "KVHandle",
    "DIGEST_SIZE",
    "ImageSpan",
    "KVLayout",
    "NoFreeBlocksError",
    "block_extras",
    "dtype_from_name",
    "dtype_name",
    "hash_block",
    "hash_chain",
    "model_fingerprint",
]
