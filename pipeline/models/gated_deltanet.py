"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, over the per-sequence state pool.

One projection gives q, k, v (per key head, its share of value heads) and z (the output gate); another
gives b and a (per value head: the write strength beta = sigmoid(b) and the decay g = -exp(A_log) *
softplus(a + dt_bias)). q, k and v pass through a depthwise causal convolution with SiLU, q and k are
L2-normalised, the gated delta rule (``kernels.delta_rule``) reads and updates each sequence's state,
and an RMSNorm of the output gated by SiLU(z) goes to ``out_proj``. The state handling is the linear
layers' shared part (``models.linear_mixer``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import linear, rms_norm
from strata.kernels.delta_rule import l2_normalize
from strata.pipeline.models.linear_mixer import LinearMixer, LinearStates
from strata.pipeline.models.text_config import TextConfig


class GatedDeltaNet(LinearMixer):
    """One Gated DeltaNet layer; its parameters keep the checkpoint's names."""

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None
        self.lin = lin
        self.linear_index = cfg.linear_index(layer_idx)
        h, nk, nv, dk, dv = cfg.hidden_size, lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim
        if lin.split_projections:  # Qwen3.5: q|k|v, z, b and a each from their own projection
            self.in_proj_qkv = nn.Linear(h, lin.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, nv * dv, bias=False)
            self.in_proj_b = nn.Linear(h, nv, bias=False)
            self.in_proj_a = nn.Linear(h, nv, bias=False)
        else:  # Qwen3-Next: q, k, v and z per key head in one projection, b and a per key head in another
            self.in_proj_qkvz = nn.Linear(h, 2 * nk * dk + 2 * nv * dv, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * nv, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv))
        self.eps = cfg.rms_norm_eps
        self.out_proj = nn.Linear(nv * dv, h, bias=False)

    @property
    def o_proj(self) -> nn.Linear:
        """The output projection, under the name the decoder layer reads (the checkpoint's is ``out_proj``)."""
        return self.out_proj

    def run(self, x: torch.Tensor, ln: nn.Module, cos, sin_signed, kv, meta, backend, steps) -> torch.Tensor:
        """Input norm and the layer's mixing: [T, value heads * head width], before ``out_proj``."""
        states: LinearStates = meta.states
        lin, t = self.lin, x.shape[0]
        nk, nv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim
        r = nv // nk
        h = rms_norm(x, ln.weight, ln.eps)
        mixed, z, b, a = self._project(h)
        mixed = self.convolve(mixed, self.conv1d.weight[:, 0], states)
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q = l2_normalize(q.reshape(t, nk, dk).float()).repeat_interleave(r, dim=1) * dk**-0.5
        k = l2_normalize(k.reshape(t, nk, dk).float()).repeat_interleave(r, dim=1)
        v = v.reshape(t, nv, dv)
        beta = b.reshape(t, nv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, nv).float() + self.dt_bias)
        core = self.recur(q, k, v, g, beta, states).to(x.dtype)
        return self._gated_norm(core, z.reshape(t, nv, dv)).reshape(t, nv * dv)

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q|k|v for the convolution [T, conv_dim], z, b, a) in the layout either release stores them."""
        lin, t = self.lin, h.shape[0]
        if lin.split_projections:
            return (linear(h, self.in_proj_qkv.weight), linear(h, self.in_proj_z.weight),
                    linear(h, self.in_proj_b.weight), linear(h, self.in_proj_a.weight))
        nk, dk, dv, r = lin.num_k_heads, lin.k_head_dim, lin.v_head_dim, lin.num_v_heads // lin.num_k_heads
        q, k, v, z = linear(h, self.in_proj_qkvz.weight).view(t, nk, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], -1)
        b, a = linear(h, self.in_proj_ba.weight).view(t, nk, 2 * r).split([r, r], -1)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1), z, b, a

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm per value head (normalised in fp32, cast, scaled), then times SiLU(z) in fp32, as the
        reference's gated norm runs."""
        h = core.float()
        h = self.norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(core.dtype)
        return (h * F.silu(z.float())).to(core.dtype)
