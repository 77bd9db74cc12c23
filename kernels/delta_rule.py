"""Gated DeltaNet's two recurrences, in torch (the reference): the short causal convolution and the gated delta rule.

A linear-attention layer keeps, per sequence, a fixed-size state instead of per-token KV: the last
``kernel - 1`` inputs of its depthwise causal convolution, and a [heads, key_dim, value_dim] matrix S
that the gated delta rule updates token by token:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

Decode steps that form one token at a time (:func:`delta_rule_step`, batched over sequences). A prefill
chunk uses the chunked form (:func:`delta_rule_chunked`): within a block of ``chunk`` tokens the updates
are solved at once (a unit lower-triangular system, the "UT transform" of DeltaNet), and only the blocks
are sequential, so a chunk costs matrix products, not one step per token. Both read and return the state
in fp32, as the reference keeps it, so a prompt cut into engine chunks anywhere continues the same
recurrence; only the rounding of the per-block sums differs from one unchunked pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.delta_rule_triton import triton_delta_rule_step
from strata.kernels.triton_import import triton_importable


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's form, which checkpoints were trained with)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows through a depthwise causal convolution with SiLU, continuing from ``state``.

    ``x`` [T, C]; ``state`` [C, K-1], the inputs before these rows (zeros for a new sequence); ``weight``
    [C, K]. Returns (out [T, C] in x's dtype, the new state [C, K-1]: the last K-1 inputs)."""
    t, width = x.shape[0], weight.shape[-1]
    ext = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [C, K-1+T]
    out = F.conv1d(ext.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0, :, -t:]
    return F.silu(out).t().to(x.dtype), ext[:, ext.shape[-1] - (width - 1):].to(state.dtype)


def causal_conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new row per sequence: ``x`` [B, C], ``state`` [B, C, K-1] -> (out [B, C], new state [B, C, K-1])."""
    ext = torch.cat([state.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)  # [B, C, K]
    out = (ext * weight.unsqueeze(0)).sum(-1)
    return F.silu(out).to(x.dtype), ext[..., 1:].to(state.dtype)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``q``/``k`` [B, H, K] (normalised and scaled), ``v`` [B, H, V], ``g``/``beta``
    [B, H], ``state`` [B, H, K, V] fp32 -> (out [B, H, V] fp32, new state)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def delta_rule_step_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          pool: torch.Tensor, read: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """:func:`delta_rule_step` over a layer's view of the state pool ``pool`` [slots, H, K, V] (fp32): each
    sequence's state read from slot ``read[b]``, the new one written to ``write[b]``; returns out [B, H, V] fp32.
    The C++ kernel (``csrc/delta_rule_cpu.cpp``) on CPU and the Triton one (``delta_rule_triton``) on CUDA read
    and write the slots in place; else the torch step, through a gather and a scatter."""
    if pool.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.delta_rule_step(*(t.float().contiguous() for t in (q, k, v, g, beta)), pool, read, write)
    if pool.device.type == "cuda" and triton_importable():
        return triton_delta_rule_step(q, k, v, g, beta, pool, read, write)
    out, pool[write] = delta_rule_step(q, k, v, g, beta, pool[read])
    return out


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows at once: ``q``/``k`` [T, H, K] (normalised and scaled), ``v`` [T, H, V], ``g``/``beta``
    [T, H], ``state`` [H, K, V] fp32 -> (out [T, H, V] fp32, the state after the last row)."""
    t = q.shape[0]
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h, n = q.shape[0], (t + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    decay = g.cumsum(-1)  # log of the decay from each block's start to each row
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()  # row i from j
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # rows of a block read each other's writes: solve (I + strictly-lower(beta k k^T decay)) u = beta v, and the
    # same system for the decayed keys the old state is read through
    system = (kb @ k.transpose(-1, -2)) * between
    lower = torch.tril(system, -1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(lower, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, kb * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * between  # within a block, causal (the diagonal included)
    q_read = q * decay.exp().unsqueeze(-1)
    k_write = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()
    out = torch.empty_like(v)
    s = state.float()
    for i in range(n):
        fresh = u[:, i] - w[:, i] @ s  # what each row writes beyond what the old state already predicts
        out[:, i] = q_read[:, i] @ s + attn[:, i] @ fresh
        s = s * block_decay[:, i, None, None] + k_write[:, i].transpose(-1, -2) @ fresh
    return out.reshape(h, n * chunk, -1)[:, :t].transpose(0, 1), s
