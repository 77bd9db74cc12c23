"""Attention over keys that are not on the device, merged exactly into the device result.

A sequence whose oldest blocks were moved to the host or disk tier attends to them
segment by segment: each segment (at most the staging buffer) is loaded for this one
layer, attended with log-sum-exp, and merged into the running result. Device memory is
the staging buffer plus one segment's scores, whatever the context length.
"""

from __future__ import annotations

import torch

from strata.kernels.attention_metadata import AttentionMetadata
from strata.kernels.attention_torch import attend_with_positions
from strata.kernels.merge import merge_attention_states


def attend_spilled(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Fold the spilled keys of every sequence into ``out`` (device part, with ``lse``).

    q/out: [T, Hq, D], lse: [T, Hq]. Returns the merged output (same shape and dtype as out).
    """
    if meta.spilled is None:
        return out
    starts = meta.query_start_loc.tolist()
    bs = meta.block_size
    for i, source in enumerate(meta.spilled):
        if source is None or source.num_blocks == 0:
            continue
        lo, n = starts[i], meta.query_lens[i]
        first_q = meta.seq_lens_list[i] - n
        q_pos = torch.arange(first_q, first_q + n, device=q.device).unsqueeze(0)
        seq_out, seq_lse = out[lo : lo + n], lse[lo : lo + n]
        # With a sliding window, blocks wholly before the first query's window are never seen.
        first_block = max(0, first_q - sliding_window + 1) // bs if sliding_window is not None else 0
        prefetch = getattr(source, "prefetch", None)
        for b in range(first_block, source.num_blocks, source.segment_blocks):
            count = min(source.segment_blocks, source.num_blocks - b)
            k, v = source.load(layer, b, count)
            nxt = b + source.segment_blocks
            if prefetch is not None and nxt < source.num_blocks:  # stage the next segment while this one computes
                prefetch(layer, nxt, min(source.segment_blocks, source.num_blocks - nxt))
            k = k.reshape(1, count * bs, *k.shape[2:])
            v = v.reshape(1, count * bs, *v.shape[2:])
            k_pos = torch.arange(b * bs, (b + count) * bs, device=q.device).unsqueeze(0)
            valid = torch.ones_like(k_pos, dtype=torch.bool)
            o, l = attend_with_positions(q[lo : lo + n].unsqueeze(0), k, v, q_pos, k_pos, valid, scale, sliding_window)
            seq_out, seq_lse = merge_attention_states(seq_out, seq_lse, o[0], l[0])  # type: ignore[index]
        out[lo : lo + n] = seq_out
        lse[lo : lo + n] = seq_lse
    return out
