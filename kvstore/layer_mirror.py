"""A device copy of some layers' spilled blocks, for layers small enough to keep: DSA's indexer keys, DeepSeek-V4's
indexer keys and its 128:1 entries.

Sparse attention reads every indexer key of a context each step, but only the latents it chooses. A
sequence whose older blocks spilled would stream all of its indexer keys back from the host tier every step,
block by block; this keeps them on the device instead, as long as they fit. A copy is one layer's values
over a sequence's first n spilled blocks, named by the hash of block n-1 (which commits to every token before
it, the model and the prompt seed: ``kvstore.hashing``), so it never answers for another prefix. A later step
whose spilled prefix grew extends its copy with the new blocks alone. Copies past ``capacity_bytes`` are
dropped least recently used first; a dropped one is read from the tiers again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


def mirror_bytes(layout: Any, groups: tuple[int, ...], max_model_len: int) -> int:
    """The device budget for spilled blocks' copies: one ``max_model_len`` context of every layer of ``groups``."""
    blocks = -(-max_model_len // layout.block_size)
    return sum(blocks * layout.groups[g].num_layers * layout.groups[g].layer_nbytes(layout.block_size) for g in groups)


class SpilledLayerMirror:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._copies: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()  # (last block's hash, layer)
        self._blocks: dict[tuple[bytes, int], int] = {}  # the spilled blocks each copy spans
        self.nbytes = 0
        self.hits = self.extensions = 0

    def tokens(self, source: Any, layer: int, num_blocks: int) -> tuple[torch.Tensor, int]:
        """KV-layout ``layer``'s values [num_blocks * rows, heads, dim] over the first ``num_blocks``
        spilled blocks of ``source`` (a ``kvstore.spilled_reads.SpilledBlocks``), and the bytes this call
        read from the tiers. A tensor-parallel rank's source (``core.tp_runner``) knows no block hashes but
        can ``agree``: every rank then takes the driver's decision, so their copies stay the same and each
        load is made by every rank at once (a load is a collective there)."""
        agree = getattr(source, "agree", None)
        decision = self._decide(source, layer, num_blocks) if hasattr(source, "hashes") else None
        if agree is not None:
            decision = agree(decision)
        key, base_key, have = decision
        if base_key is None and have:  # the copy itself: a hit
            self._copies.move_to_end(key)
            self.hits += 1
            return self._copies[key], 0
        parts, loaded = [], 0
        if base_key is not None:  # the extended copy replaces it
            parts.append(self._copies[base_key])
            self._drop(base_key)
            self.extensions += 1
        for first in range(have, num_blocks, source.segment_blocks):
            count = min(source.segment_blocks, num_blocks - first)
            k, _ = source.load(layer, first, count)  # [count, bs, heads, dim], valid until the next load
            parts.append(k.reshape(-1, *k.shape[2:]).clone())
            loaded += k.numel() * k.element_size()
        copy = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._keep(key, copy, num_blocks)
        return copy, loaded

    def _decide(self, source: Any, layer: int, num_blocks: int) -> tuple[tuple[bytes, int], tuple[bytes, int] | None, int]:
        """(the copy's key, the key of the copy it extends or None, the blocks already held): the whole copy
        held is (key, None, num_blocks); nothing held is (key, None, 0)."""
        key = (source.hashes[num_blocks - 1], layer)
        if key in self._copies:
            return key, None, num_blocks
        best, base = 0, None
        for (last, held_layer), n in self._blocks.items():  # the longest copy over a prefix of these blocks
            if held_layer == layer and best < n < num_blocks and source.hashes[n - 1] == last:
                best, base = n, (last, held_layer)
        return key, base, best

    def _keep(self, key: tuple[bytes, int], copy: torch.Tensor, num_blocks: int) -> None:
        if key in self._copies:  # rebuilt (a rank told to build what it still held): counted once
            self._drop(key)
        self._copies[key], self._blocks[key] = copy, num_blocks
        self.nbytes += copy.numel() * copy.element_size()
        while self.nbytes > self.capacity_bytes and len(self._copies) > 1:
            self._drop(next(iter(self._copies)))
        if self.nbytes > self.capacity_bytes:  # a copy larger than the whole budget is not kept
            self._drop(key)

    def _drop(self, key: tuple[bytes, int]) -> None:
        copy = self._copies.pop(key)
        del self._blocks[key]
        self.nbytes -= copy.numel() * copy.element_size()

    def stats(self) -> dict[str, int]:
        return {"copies": len(self._copies), "bytes": self.nbytes, "capacity_bytes": self.capacity_bytes,
                "hits": self.hits, "extensions": self.extensions}
