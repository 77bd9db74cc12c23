"""The attention backend interface: one metadata (:class:`AttentionMetadata`), many implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from strata.kernels.attention_metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Attention of a flattened batch of new queries over the paged KV cache."""

    name: ClassVar[str]
    reads_fp8_kv: ClassVar[bool] = False  # attends over an e4m3 cache (``kv_cache_dtype: fp8``), widening as it reads

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
        """Whether this backend runs on ``device`` with KV and queries of ``dtype``."""
        return True

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: [T, Hq, D]; caches: [blocks, block_size, Hkv, D]. Returns (out [T, Hq, D], lse [T, Hq] | None).

        Causal over absolute positions; with ``sliding_window`` = W a query at position p
        sees keys at positions p-W+1 .. p (the transformers convention).
        """
