"""Exact merge of attention computed over disjoint key segments."""

from __future__ import annotations

import torch


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions ([T, H, D] with log-sum-exp [T, H]) into one.

    softmax over the union of keys = each part re-weighted by exp(lse_part - lse_total).
    A part with no keys carries lse = -inf and weight 0; if both are empty the output is 0.
    """
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a.float() - safe).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b.float() - safe).nan_to_num(0.0).unsqueeze(-1)
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse
