"""Block hash chain that names KV blocks by everything that determined them.

``h_i = H(h_{i-1}, tokens_i, extras_i)`` with ``h_{-1}`` the model fingerprint, so a
block hash commits to the model, the whole token prefix and every image whose
placeholder tokens fall in or before the block.  blake2b is used because a collision
would hand one request another request's KV: it must be cryptographic, not fast-only.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

DIGEST_SIZE = 16
_FINGERPRINT_DOMAIN = b"strata.kv.model.v2"
_BLOCK_DOMAIN = b"strata.kv.block.v1"


@dataclass(frozen=True)
class ImageSpan:
    """Placeholder tokens [offset, offset+length) of one image, plus its content hash."""

    offset: int
    length: int
    content_hash: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


def _new() -> "hashlib._Hash":
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


def _update_field(h: "hashlib._Hash", data: bytes) -> None:
    """Length-prefix every field so concatenations cannot alias."""
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def model_fingerprint(architecture: str, weights_digest: str, dtype: str, block_size: int,
                      config_digest: str = "", layout: str = "") -> bytes:
    """Root of every chain: KV from another model, config, dtype or block layout never matches.

    Callers pass a content digest of the weights and of every configuration file that changes what a
    block holds (``pipeline.model_identity`` builds them); the store itself stays model-agnostic."""
    h = _new()
    _update_field(h, _FINGERPRINT_DOMAIN)
    for field in (architecture, weights_digest, dtype, config_digest, layout):
        _update_field(h, field.encode("utf-8"))
    _update_field(h, struct.pack("<q", block_size))
    return h.digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extras: Sequence[bytes] = ()) -> bytes:
    """Hash of one block given its parent hash, its token ids and extra content keys."""
    h = _new()
    _update_field(h, _BLOCK_DOMAIN)
    _update_field(h, parent)
    _update_field(h, struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(struct.pack("<Q", len(extras)))
    for extra in extras:
        _update_field(h, extra)
    return h.digest()


def _span_key(span: ImageSpan) -> bytes:
    # Geometry is included so two images with equal placeholder tokens but a
    # different split point inside one block cannot produce the same key.
    return span.content_hash + struct.pack("<qq", span.offset, span.length)


def block_extras(start: int, end: int, image_spans: Iterable[ImageSpan]) -> tuple[bytes, ...]:
    """Keys of every image whose span overlaps token range [start, end), in offset order.

    Each key is ``content_hash + pack('<qq', offset, length)``.
    """
    hits = [s for s in image_spans if s.length > 0 and s.offset < end and s.end > start]
    hits.sort(key=lambda s: (s.offset, s.length))
    return tuple(_span_key(s) for s in hits)


def state_piece_hash(block_hash: bytes, index: int) -> bytes:
    """The name of piece ``index`` of a linear-attention state snapshot taken at the block ``block_hash`` ends, as
    the lower tiers store it in block-sized pieces (``state_cache``): it commits to what the block's hash does."""
    h = _new()
    _update_field(h, b"strata.kv.state-piece.v1")
    _update_field(h, block_hash)
    _update_field(h, struct.pack("<Q", index))
    return h.digest()


def prompt_seed(fingerprint: bytes, prompt_len: int) -> bytes:
    """The chain's seed for a model whose KV of a prefix depends on the length of the prompt it was computed in
    (DSA: the indexer's top-k ties break by ``torch.topk`` over the whole prompt, ``kernels.sparse_index``):
    blocks are then shared only between requests whose prompts are as long."""
    h = _new()
    _update_field(h, b"strata.kv.prompt-keyed.v1")
    _update_field(h, fingerprint)
    _update_field(h, struct.pack("<Q", prompt_len))
    return h.digest()


def hash_chain(
    fingerprint: bytes,
    token_ids: Sequence[int],
    block_size: int,
    image_spans: Sequence[ImageSpan] = (),
    start_hashes: Sequence[bytes] = (),
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``; a partial tail block gets none.

    ``start_hashes`` are the already-known hashes of the leading blocks, so extending
    a sequence costs only the new blocks.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_full = len(token_ids) // block_size
    first = len(start_hashes)
    if first > num_full:
        raise ValueError(f"{first} start hashes but only {num_full} full blocks")
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else fingerprint
    # Only spans reaching past the first new block can matter.
    first_tok = first * block_size
    spans = [s for s in image_spans if s.end > first_tok]
    for i in range(first, num_full):
        start, end = i * block_size, (i + 1) * block_size
        extras = block_extras(start, end, spans) if spans else ()
        parent = hash_block(parent, token_ids[start:end], extras)
        hashes.append(parent)
    return hashes
