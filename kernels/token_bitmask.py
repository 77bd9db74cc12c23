"""A grammar's token bitmask applied to logits: -inf for every token it disallows, in place.

The bitmask is llguidance's layout (int32 words, bit t % 32 of word t // 32 allows token t; a logits row
wider than the mask disallows the rest). ``apply_token_bitmask`` runs the C++ kernel (``csrc/
token_bitmask_cpu.cpp``: one pass, whole words at a time) on CPU tensors and the torch reference
otherwise; llguidance's own applier is a ``torch.compile`` kernel whose first call compiles for seconds.
"""

from __future__ import annotations

import torch

from strata.kernels.cpu_kernels import cpu_kernels

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """The bitmask [rows, words] as booleans [rows, width] (tokens past its words are not allowed)."""
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1).reshape(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= width:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], width - bits.shape[1])], dim=1)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The reference: row ``rows[i]`` of ``logits`` masked by row i of ``bitmask``."""
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])
    index = rows.to(logits.device)
    logits[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Row ``rows[i]`` of ``logits`` [batch, vocab] masked by row i of ``bitmask`` [len(rows), words], in place."""
    if logits.device.type == "cpu" and logits.is_contiguous() and logits.dim() == 2:
        kernels = cpu_kernels()
        if kernels is not None:
            kernels.apply_token_bitmask(logits, bitmask.contiguous(), rows.to(torch.int64).contiguous())
            return
    apply_token_bitmask_torch(logits, bitmask, rows)
