"""DSA's decode rows read together: the step's sequences of one new row whose blocks are all on the device.

A decode step of many sequences spent most of its sparse attention in per-sequence Python (a gather, a
selection, an attention and a count each). Here each row's indexer keys are still read and scored one
sequence at a time (``kernels.sparse_index.index_scores``, fused: never [heads, tokens] products, whatever the
context), into one [B, longest] score matrix, -inf past each row's own context; then one selection (the same
top-k rule, per row, as ``select_topk`` applies to a sequence), one gather of every row's chosen latents
through the block tables and one batched absorbed attention. A sequence with spilled blocks, or with several
new rows, goes the per-sequence way, which loads from the tiers.
"""

from __future__ import annotations

import torch

from strata.kernels import AttentionMetadata
from strata.kernels.sparse_index import index_scores, select_topk


def decode_sequences(meta: AttentionMetadata) -> list[int]:
    """The step's sequences that decode together: one new row each, every block on the device."""
    return [i for i, rows in enumerate(meta.query_lens) if rows == 1 and not meta.kv_offset(i)]


def _tokens(cache: torch.Tensor, meta: AttentionMetadata, seq: int, positions: torch.Tensor) -> torch.Tensor:
    """Sequence ``seq``'s cached vectors [n, dim] at ``positions``, all on the device."""
    bs = meta.block_size
    blocks = meta.block_tables[seq, torch.div(positions, bs, rounding_mode="floor")].long()
    return cache[blocks, positions % bs][:, 0]


def choose_together(iq: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata,
                    seqs: list[int], scale: float, topk: int) -> torch.Tensor:
    """The chosen positions of each sequence's row, int64 [B, k], -1 where it has fewer: ``iq`` [B, heads, dim]
    and ``weights`` [B, heads] are the rows' indexer queries, ``keys`` the indexer-key cache layer."""
    lengths = [meta.seq_lens_list[i] for i in seqs]
    scores = iq.new_full((len(seqs), max(lengths)), float("-inf"), dtype=torch.float32)
    for j, (i, n) in enumerate(zip(seqs, lengths)):
        context = _tokens(keys, meta, i, torch.arange(n, device=keys.device)).to(iq.dtype)
        scores[j, :n] = index_scores(iq[j : j + 1], context, weights[j : j + 1], scale)[0]
    return select_topk(scores, [n - 1 for n in lengths], [meta.prompt_len(i) for i in seqs], topk)


def chosen_latents(cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int], chosen: torch.Tensor
                   ) -> torch.Tensor:
    """Every row's chosen latents [B, k, dim] (a -1 choice reads position 0, masked by the caller)."""
    rows = torch.tensor(seqs, device=cache.device)
    positions = chosen.clamp(min=0)
    blocks = meta.block_tables[rows[:, None], torch.div(positions, meta.block_size, rounding_mode="floor")].long()
    return cache[blocks, positions % meta.block_size][:, :, 0]


def count_together(meta: AttentionMetadata, seqs: list[int], chosen: torch.Tensor, key_bytes: int,
                   latent_bytes: int) -> None:
    """The rows' reads into ``kvstore.sparse_reads``' counters, as the per-sequence path counts them (every
    block here is on the device): the context's indexer keys (0 bytes on a layer sharing another's choice) and
    the chosen latents."""
    reads = meta.sparse_reads
    reads.reads += len(seqs)
    reads.index_key_bytes_device += sum(meta.seq_lens_list[i] for i in seqs) * key_bytes
    reads.latent_bytes_device += int((chosen >= 0).sum()) * latent_bytes
