"""DeepSeek Sparse Attention's selection, in torch (the reference): the lightning indexer's scores and the
top-k each query keeps.

For query row i and cached token j the indexer scores

    I[i, j] = sum_h w[i, h] * relu(scale * q[i, h] . k[j])

with a few small heads (``q`` [rows, heads, dim], one key per token), and the query attends only over the
``topk`` best-scoring tokens at or before its position. Which tokens win a tie is part of the answer: many
scores are exactly 0 (every head's ReLU closed), so the top-k boundary often falls inside a tie. The rule
here is transformers': ``torch.topk`` over the row as its forward builds it, the whole prompt long for a
prompt row (later tokens at -inf) and the context so far for a generated one, then whatever falls after the
row's position dropped. ``torch.topk`` breaks ties by its own algorithm, which depends on the row's length
and contents, so the same row is handed to it: the tests check tied rows against transformers' generate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.sparse_index_triton import triton_index_scores
from strata.kernels.triton_import import triton_importable


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """I [rows, tokens] in fp32 from ``q`` [rows, heads, dim], ``keys`` [tokens, dim] and ``weights``
    [rows, heads] (already scaled by heads^-0.5), in the reference's order of operations. The C++ kernel
    (``csrc/sparse_index_cpu.cpp``) on CPU and the Triton one (``sparse_index_triton``) on CUDA compute the same
    sums fused, never holding the [rows, heads, tokens] products."""
    if q.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.index_scores(*(t.float().contiguous() for t in (q, keys, weights)), scale)
    if q.device.type == "cuda" and triton_importable():
        return triton_index_scores(q, keys, weights, scale)
    return index_scores_reference(q, keys, weights, scale)


def index_scores_reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`index_scores` in torch, as transformers computes it."""
    scores = F.relu(torch.matmul(q.float(), keys.float().t()) * scale)  # [rows, heads, tokens]
    return torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)


def select_topk(scores: torch.Tensor, positions: list[int], prompt_len: int | list[int], topk: int) -> torch.Tensor:
    """The tokens each row attends: int64 [rows, k] positions, -1 where a row has fewer (k = ``topk`` or less),
    from ``scores`` [rows, tokens] of rows at absolute ``positions`` of a sequence whose prompt is ``prompt_len``
    tokens (or of one row each of several sequences: a prompt length per row; their scores past a row's own
    position may be anything). A row's top-k is taken over ``max(prompt_len, position + 1)`` entries, later ones
    at -inf (see the module's docstring); a choice past the row's own position is no choice."""
    rows, tokens = scores.shape
    prompts = prompt_len if isinstance(prompt_len, list) else [prompt_len] * rows
    lengths = [max(prompt, p + 1) for prompt, p in zip(prompts, positions)]
    width = min(topk, max(lengths, default=1))
    chosen = torch.full((rows, width), -1, dtype=torch.int64, device=scores.device)
    by_length: dict[int, list[int]] = {}
    for r, length in enumerate(lengths):
        by_length.setdefault(length, []).append(r)
    for length, members in by_length.items():
        idx = torch.tensor(members, device=scores.device)
        row_pos = torch.tensor([positions[r] for r in members], device=scores.device)
        full = scores.new_full((len(members), length), float("-inf"))
        seen = min(length, tokens)
        full[:, :seen] = scores[idx, :seen]
        full[torch.arange(length, device=scores.device)[None, :] > row_pos[:, None]] = float("-inf")  # causal
        picked = full.topk(min(topk, length), dim=-1).indices
        chosen[idx, : picked.shape[1]] = picked.masked_fill(picked > row_pos[:, None], -1)
    return chosen


def sparse_latent_attention(q: torch.Tensor, latents: torch.Tensor, valid: torch.Tensor, rank: int,
                            scale: float) -> torch.Tensor:
    """MLA in the weight-absorbed form over each row's own gathered latents: ``q`` [rows, heads, rank + rope]
    against ``latents`` [rows, k, rank + rope] (keys: whole; values: the first ``rank``), where ``valid``
    [rows, k] says which of a row's k are chosen. Returns [rows, heads, rank] in q's dtype; softmax in fp32."""
    s = torch.einsum("rhd,rkd->rhk", q.float(), latents.float()) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("rhk,rkd->rhd", s, latents[..., :rank].float()).to(q.dtype)
