"""Which part of a linear-attention layer (Gated DeltaNet, KDA) and of its per-sequence state a tensor-parallel
rank holds: arithmetic on the config only, like ``shard_plan`` (which asks this file for those layers).

A rank holds key heads ``[k0, k1)`` and the value heads they serve (``[k0 * r, k1 * r)``, r value heads per
key head; KDA has one of each), so its delta rule, convolution, gated norm and the state they keep need
nothing from another rank, and only ``out_proj`` (split by its input columns) is summed over the group, as
an attention layer's ``o_proj`` is. The convolution runs over q|k|v, so its weight, the fused q|k|v
projection (Qwen3.5) and the convolution's state are cut in three ranges, one per part; Qwen3-Next's fused
projections group q, k, v and z per key head, so a key-head range is one range of rows.

A cut is ``(dim, ((start, stop), ...))``: the ranges along ``dim``, read and concatenated in order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from strata.pipeline.parallel.shard_range import shard_range

Cut = tuple[int, tuple[tuple[int, int], ...]]


class LinearShards:
    """What rank ``rank`` of ``size`` holds of every linear-attention layer (``lin``: the whole model's
    ``GatedDeltaNetConfig``)."""

    def __init__(self, lin: Any, rank: int, size: int) -> None:
        self.lin = lin
        self.key_heads = shard_range(lin.num_k_heads, size, rank)
        per_key = lin.num_v_heads // lin.num_k_heads
        self.value_heads = (self.key_heads[0] * per_key, self.key_heads[1] * per_key)

    def _heads(self, which: tuple[int, int], width: int, offset: int = 0) -> tuple[int, int]:
        return offset + which[0] * width, offset + which[1] * width

    @property
    def conv_channels(self) -> tuple[tuple[int, int], ...]:
        """This rank's channels of the convolution over q|k|v: its q, its k, its v."""
        lin, keys = self.lin, self.lin.num_k_heads * self.lin.k_head_dim
        return (self._heads(self.key_heads, lin.k_head_dim), self._heads(self.key_heads, lin.k_head_dim, keys),
                self._heads(self.value_heads, lin.v_head_dim, 2 * keys))

    def cut(self, name: str) -> Cut | None:
        """The cut of a linear layer's tensor (its name inside the layer: ``in_proj_qkvz.weight``); None: whole
        on every rank (the gated norm's weight, KDA's low-rank down-projections)."""
        lin, kh, vh = self.lin, self.key_heads, self.value_heads
        proj = name.removesuffix(".weight")
        values = (self._heads(vh, lin.v_head_dim),)
        if lin.kda:  # q, k, v, their convolutions, the decay's and gate's up-projections: per head and channel
            rows = {"q_proj": values, "k_proj": values, "v_proj": values, "q_conv1d": values, "k_conv1d": values,
                    "v_conv1d": values, "f_b_proj": values, "g_b_proj": values, "dt_bias": values, "b_proj": (vh,)}
            if proj in rows:
                return 0, rows[proj]
            if proj == "A_log":  # stored [1, 1, heads, 1]
                return 2, (vh,)
            return (1, values) if proj == "o_proj" else None
        per_key = lin.num_v_heads // lin.num_k_heads
        rows = {"in_proj_qkvz": (self._heads(kh, 2 * lin.k_head_dim + 2 * per_key * lin.v_head_dim),),
                "in_proj_ba": (self._heads(kh, 2 * per_key),), "in_proj_qkv": self.conv_channels,
                "conv1d": self.conv_channels, "in_proj_z": values, "in_proj_b": (vh,), "in_proj_a": (vh,),
                "dt_bias": (vh,), "A_log": (vh,)}
        if proj in rows:
            return 0, rows[proj]
        return (1, values) if proj == "out_proj" else None

    def state_cuts(self) -> dict[str, Cut]:
        """This rank's part of one layer's state of each kind (``linear_mixer.state_kinds``), along its own
        shape: the convolution's channels, the recurrent matrix's value heads."""
        return {"conv": (0, self.conv_channels), "recurrent": (0, (self.value_heads,))}

    def local(self) -> Any:
        """The layer geometry this rank's modules are built with."""
        (k0, k1), (v0, v1) = self.key_heads, self.value_heads
        return replace(self.lin, num_k_heads=k1 - k0, num_v_heads=v1 - v0)
