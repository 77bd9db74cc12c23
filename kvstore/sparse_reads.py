"""What sparse attention read, counted: the figures `strata bench sparse` and ``/strata/stats`` report.

A DSA layer (``models.attention_dsa``) reads every indexer key of a sequence's context, then the latents of
the tokens its queries chose: from the device blocks, or from the lower tiers one spilled block at a time,
only the blocks holding a chosen token. Counted per layer and sequence of every step, cumulatively.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SparseReads:
    reads: int = 0  # (layer, sequence) selections made
    index_key_bytes_device: int = 0
    index_key_bytes_spilled: int = 0  # indexer keys streamed back from the host or disk tier
    latent_bytes_device: int = 0  # the chosen tokens' latents on the device
    latent_bytes_spilled: int = 0  # whole spilled blocks of latents loaded for a chosen token
    spilled_blocks_seen: int = 0  # spilled blocks the selections could have read
    spilled_blocks_read: int = 0  # ... and those they did (the share touched)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
