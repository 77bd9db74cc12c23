"""KDA (Kimi Delta Attention), the linear-attention layer of Kimi-Linear, over the per-sequence state pool.

Gated DeltaNet with a finer forget gate: the decay is per key channel, not per head, so each row of a
head's [K, V] state fades at its own rate. q, k and v come from their own projections and convolutions
(``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, run as one over q|k|v with SiLU); the decay g = -exp(A_log) *
softplus(f_b(f_a(x)) + dt_bias) per head and channel, the write strength beta = sigmoid(b_proj(x)) per
head; q and k are L2-normalised, the gated delta rule (``kernels.delta_rule``, per-channel form) reads and
updates each sequence's state, and an RMSNorm of the output gated by sigmoid(g_b(g_a(x))) goes to
``o_proj``. The parameters keep the release's names, under ``self_attn`` as Kimi-Linear stores them.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels import linear, rms_norm
from strata.kernels.delta_rule import l2_normalize_div
from strata.pipeline.models.linear_mixer import LinearMixer, LinearStates
from strata.pipeline.models.text_config import TextConfig


class KimiDeltaAttention(LinearMixer):
    """One KDA layer."""

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None and lin.kda
        self.lin = lin
        self.linear_index = cfg.linear_index(layer_idx)
        h, heads, d = cfg.hidden_size, lin.num_v_heads, lin.v_head_dim
        width = heads * d
        self.q_proj = nn.Linear(h, width, bias=False)
        self.k_proj = nn.Linear(h, width, bias=False)
        self.v_proj = nn.Linear(h, width, bias=False)
        self.q_conv1d = nn.Conv1d(width, width, lin.conv_kernel, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, lin.conv_kernel, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, lin.conv_kernel, groups=width, bias=False)
        self.f_a_proj = nn.Linear(h, d, bias=False)  # the decay, low rank: hidden -> head width -> every channel
        self.f_b_proj = nn.Linear(d, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))  # as stored: one rate per head
        self.b_proj = nn.Linear(h, heads, bias=False)
        self.g_a_proj = nn.Linear(h, d, bias=False)  # the output gate, low rank like the decay
        self.g_b_proj = nn.Linear(d, width, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.eps = cfg.rms_norm_eps
        self.o_proj = nn.Linear(width, h, bias=False)

    def run(self, x: torch.Tensor, ln: nn.Module, cos, sin_signed, kv, meta, backend, steps) -> torch.Tensor:
        """Input norm and the layer's mixing: [T, heads * head width], before ``o_proj``."""
        states: LinearStates = meta.states
        t, heads, d = x.shape[0], self.lin.num_v_heads, self.lin.v_head_dim
        h = rms_norm(x, ln.weight, ln.eps)
        mixed = torch.cat([linear(h, self.q_proj.weight), linear(h, self.k_proj.weight), linear(h, self.v_proj.weight)], -1)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        q, k, v = self.convolve(mixed, weight, states).view(t, 3, heads, d).unbind(1)
        q = l2_normalize_div(q.float()) * d**-0.5
        k = l2_normalize_div(k.float())
        beta = linear(h, self.b_proj.weight).sigmoid()
        core = self.recur(q, k, v, self._decay(h), beta, states).to(x.dtype)
        gate = linear(linear(h, self.g_a_proj.weight), self.g_b_proj.weight).view(t, heads, d)
        return self._gated_norm(core, gate).reshape(t, heads * d)

    def _decay(self, h: torch.Tensor) -> torch.Tensor:
        """g [T, heads, head width] in fp32: -exp(A_log) * softplus(f + dt_bias), the softplus written as the
        reference writes it (x itself above 20)."""
        t, heads, d = h.shape[0], self.lin.num_v_heads, self.lin.v_head_dim
        f = linear(linear(h, self.f_a_proj.weight), self.f_b_proj.weight)
        g = (f.float() + self.dt_bias.float()).view(t, heads, d)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -self.A_log.float().view(heads, 1).exp() * softplus

    def _gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head in fp32, scaled by its weight in fp32, times sigmoid(gate) in fp32, then cast (the
        reference's order, which differs from Gated DeltaNet's cast-then-scale)."""
        h = core.float()
        h = self.o_norm.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(gate.float())).to(core.dtype)
