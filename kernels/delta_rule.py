"""The linear-attention recurrences, in torch (the reference): the short causal convolution and the gated
delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5) and KDA (Kimi-Linear).

A linear-attention layer keeps, per sequence, a fixed-size state instead of per-token KV: the last
``kernel - 1`` inputs of its depthwise causal convolution, and a [heads, key_dim, value_dim] matrix S
that the gated delta rule updates token by token:

    S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T,    o_t = S_t^T q_t

where the decay D_t is exp(g_t) times the identity in Gated DeltaNet (``g`` one value per head) and
diag(exp(g_t)) in KDA (``g`` one value per head and key channel: each row of S fades at its own rate).

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

SUB = 16  # KDA's sub-blocks: rows whose pairs are summed channel by channel (``_within_blocks``)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA library's form, which checkpoints were trained with),
    as Qwen3-Next's reference writes it: times the reciprocal square root."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2_normalize_div(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same norm as Kimi-Linear's reference writes it: divided by the square root (a different rounding)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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
    """One token per sequence: ``q``/``k`` [B, H, K] (normalised and scaled), ``v`` [B, H, V], ``beta`` [B, H],
    ``g`` [B, H] or per key channel [B, H, K], ``state`` [B, H, K, V] fp32 -> (out [B, H, V] fp32, new state)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state * (g.exp()[..., None] if g.dim() == 3 else g.exp()[..., None, None])
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def delta_rule_step_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          pool: torch.Tensor, read: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """:func:`delta_rule_step` over a layer's view of the state pool ``pool`` [slots, H, K, V] (fp32): each
    sequence's state read from slot ``read[b]``, the new one written to ``write[b]``; returns out [B, H, V] fp32.
    ``g`` is [B, H] (Gated DeltaNet) or [B, H, K] (KDA). The C++ kernel (``csrc/delta_rule_cpu.cpp``) on CPU and the Triton one (``delta_rule_triton``) on CUDA read
    and write the slots in place; else the torch step, through a gather and a scatter."""
    if pool.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.delta_rule_step(*(t.float().contiguous() for t in (q, k, v, g, beta)), pool, read, write)
    if pool.device.type == "cuda" and triton_importable():
        return triton_delta_rule_step(q, k, v, g, beta, pool, read, write)
    out, pool[write] = delta_rule_step(q, k, v, g, beta, pool[read])
    return out


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows at once: ``q``/``k`` [T, H, K] (normalised and scaled), ``v`` [T, H, V], ``beta``
    [T, H], ``g`` [T, H] or per key channel [T, H, K], ``state`` [H, K, V] fp32 -> (out [T, H, V] fp32, the
    state after the last row)."""
    t = q.shape[0]
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
    if g.dim() == 2:
        g = g.unsqueeze(-1)  # one decay per row: [H, T, 1], broadcast over the key channels
    pad = (-t) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    h, n = q.shape[0], (t + pad) // chunk
    q, k, v, g = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(h, n, chunk)
    decay = g.cumsum(-2)  # log of the decay from each block's start to each row: [H, n, chunk, 1 or K]
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # rows of a block read each other's writes: solve (I + strictly-lower(beta k k^T decay)) u = beta v, and the
    # same system for the decayed keys the old state is read through
    system, attn = _within_blocks(kb, q, k, decay)
    lower = torch.tril(system, -1) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(lower, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, kb * decay.exp(), upper=False, unitriangular=True)
    q_read = q * decay.exp()
    k_write = k * (decay[..., -1:, :] - decay).exp()
    block_decay = decay[..., -1, :].exp()  # [H, n, 1 or K]: how each row of the state fades over a block
    out = torch.empty_like(v)
    s = state.float()
    for i in range(n):
        fresh = u[:, i] - w[:, i] @ s  # what each row writes beyond what the old state already predicts
        out[:, i] = q_read[:, i] @ s + attn[:, i] @ fresh
        s = s * block_decay[:, i, :, None] + k_write[:, i].transpose(-1, -2) @ fresh
    return out.reshape(h, n * chunk, -1)[:, :t].transpose(0, 1), s


def _within_blocks(kb: torch.Tensor, q: torch.Tensor, k: torch.Tensor, decay: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inside each block, row i against row j <= i (0 above the diagonal): (sum_c kb_ic k_jc e^(d_ic - d_jc),
    the same with q for kb). One decay per row factors out of the sum, so the products are matrix products
    times one [chunk, chunk] mask. A decay per channel (KDA) does not factor as e^(d_i) e^(-d_j): over a
    block e^(-d_j) overflows fp32. It does factor through any row r between them, e^(d_i - d_r) e^(d_r - d_j),
    both at most 1 since the decay only falls (g <= 0): so rows of a sub-block of ``SUB`` against every
    earlier row are one matrix product through the sub-block's first row, and only pairs inside a sub-block
    are summed channel by channel ([H, SUB, SUB, K] at a time, not the reference's [H, chunk, chunk, K])."""
    chunk = q.shape[-2]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    if decay.shape[-1] == 1:
        d = decay[..., 0]
        between = (d.unsqueeze(-1) - d.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()  # row i from j
        return (kb @ k.transpose(-1, -2)) * between, (q @ k.transpose(-1, -2)) * between
    system, attn = (q.new_zeros(q.shape[:-1] + (chunk,)) for _ in range(2))
    inside = future[:SUB, :SUB, None]
    for lo in range(0, chunk, SUB):
        hi = min(lo + SUB, chunk)
        d, ref = decay[..., lo:hi, :], decay[..., lo : lo + 1, :]
        pair = (d.unsqueeze(-2) - d.unsqueeze(-3)).masked_fill(inside[: hi - lo, : hi - lo], float("-inf")).exp()
        k_here = k[..., lo:hi, :].unsqueeze(-3)
        system[..., lo:hi, lo:hi] = (kb[..., lo:hi, :].unsqueeze(-2) * k_here * pair).sum(-1)
        attn[..., lo:hi, lo:hi] = (q[..., lo:hi, :].unsqueeze(-2) * k_here * pair).sum(-1)
        if lo:
            to_ref = (d - ref).exp()  # e^(d_i - d_r) for the sub-block's rows
            earlier = (k[..., :lo, :] * (ref - decay[..., :lo, :]).exp()).transpose(-1, -2)  # e^(d_r - d_j) k_j
            system[..., lo:hi, :lo] = (kb[..., lo:hi, :] * to_ref) @ earlier
            attn[..., lo:hi, :lo] = (q[..., lo:hi, :] * to_ref) @ earlier
    return system, attn
