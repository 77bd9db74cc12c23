"""Strata KV store: model-agnostic paged KV cache in tiers (device pool, host files, disk files)."""

from .block_file import BlockFileError
from .block_pool import BlockPool, NoFreeBlocksError
from .device_blocks import DeviceBlocks
from .device_kv import DeviceKV
from .file_store import FileBlockStore
from .lower_tiers import LowerTiers
from .spilled_reads import KVBlockLostError, SpilledBlocks
from .prefix_match import PrefixMatch
from .tiered_cache import TieredKVCache
from .block_table import BlockTable, blocks_for_tokens, chunk_working_set_blocks
from .hashing import (
    DIGEST_SIZE,
    ImageSpan,
    block_extras,
    hash_block,
    hash_chain,
    model_fingerprint,
)
from .handle import HANDLE_VERSION, HandleError, KVHandle
from .layout import CacheGroup, KVLayout, dtype_from_name, dtype_name

__all__ = [
    "BlockFileError",
    "BlockPool",
    "CacheGroup",
    "DeviceBlocks",
    "DeviceKV",
    "FileBlockStore",
    "KVBlockLostError",
    "LowerTiers",
    "SpilledBlocks",
    "TieredKVCache",
    "PrefixMatch",
    "BlockTable",
    "blocks_for_tokens",
    "chunk_working_set_blocks",
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
