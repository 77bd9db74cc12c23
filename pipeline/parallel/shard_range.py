"""How a count of heads, columns, experts or vocab rows splits over a tensor-parallel group: one rule, shared by
the shard plan and the linear-attention layers' cuts (``linear_shards``), which the plan imports."""

from __future__ import annotations


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """The [start, stop) of part ``index`` when ``total`` items are split as evenly as possible."""
    return total * index // parts, total * (index + 1) // parts
