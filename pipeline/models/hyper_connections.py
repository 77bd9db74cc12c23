"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual kept as ``hc`` parallel streams.

Each token carries ``hc`` copies of the hidden state [T, hc, D]. Before attention and before the MLP, a
learned projection of the normed streams gives three weights: ``pre`` collapses the streams into the block's
input, ``post`` spreads the block's output back over them, and ``comb`` (made doubly stochastic by
Sinkhorn-Knopp iterations, so the mix never grows the residual's norm) mixes the old streams into the new.
The final :class:`HyperHead` collapses them once more before the model's norm. Parameters keep the
release's names (``fn``, ``base``, ``scale``; ``hc_fn``, ``hc_base``, ``hc_scale``) and stay in fp32, and
every op runs in the reference's order and dtypes (transformers' ``DeepseekV4HyperConnection``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.compress_kv import rms_norm_unweighted


class HyperConnection(nn.Module):
    """One block's mHC weights: ``forward`` returns (post [T, hc], comb [T, hc, hc], the block's input [T, D])."""

    keep_fp32 = True  # the loader leaves its tensors in fp32

    def __init__(self, hc: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc) * hc
        self.fn = nn.Parameter(torch.empty(width, hc * hidden))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        mixes = F.linear(rms_norm_unweighted(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams after a block: its output [T, D] spread by ``post``, plus the old streams [T, hc, D] mixed
    by ``comb`` (read transposed: stream k takes sum_j comb[j, k] * stream j)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The last collapse of the streams into one hidden state [T, D], before the model's final norm."""

    keep_fp32 = True

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * hidden))
        self.hc_base = nn.Parameter(torch.empty(hc))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms_norm_unweighted(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
