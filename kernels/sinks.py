"""Attention sinks (gpt-oss): a learned logit per head that takes part in every softmax and holds no value.

A sink adds ``exp(sink)`` to a row's softmax denominator, so each key's weight shrinks by
``S / (S + exp(sink))`` with ``S = exp(lse)`` the row's own sum. That factor is ``sigmoid(lse - sink)``;
applied to the output of attention without the sink it is exact. So every backend that returns its
log-sum-exp (torch, the C++ CPU kernel, Triton, the vendor kernels, and the merge over spilled tiers)
has sinks with no change to its kernel, and a row that sees no key stays 0 (lse = -inf).
"""

from __future__ import annotations

import torch


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] and its lse [T, H] (natural log, fp32) without sinks -> out with a sink per head [H]."""
    keep = torch.sigmoid(lse.float() - sinks.float())
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)
