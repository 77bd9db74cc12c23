"""A sequence's request state as plain data, so a prefill replica can hand it to a decode replica.

Carries what decoding needs to continue exactly where prefill stopped: every token so far,
sampling params, the sampler's generator state (a seeded request stays reproducible), the
detokenizer offsets and emitted text (no repeated or lost characters), and the image
embeddings (a recompute after preemption needs them). KV is not in here: it moves by
``KVHandle`` through the KV store. Values are numpy / bytes / builtins, which Ray passes
without pickling torch tensors (numpy arrays cross its object store zero-copy).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from pipeline.detokenizer import IncrementalDetokenizer
from pipeline.sampling_params import SamplingParams
from pipeline.sequence import ImageEmbedding, Sequence

WIRE_VERSION = 1


def sequence_to_wire(seq: Sequence) -> dict[str, Any]:
    return {
        "v": WIRE_VERSION,
        "seq_id": seq.seq_id,
        "token_ids": list(seq.token_ids),
        "num_prompt_tokens": seq.num_prompt_tokens,
        "params": asdict(seq.params),
        "images": [
            {"offset": img.offset, "embeds": img.embeds.float().numpy(), "hash": img.content_hash} for img in seq.images
        ],
        "generator_state": seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None,
        "text": seq.text,
        "emitted_text_len": seq.emitted_text_len,
        "detokenizer": [seq.detokenizer.prefix_offset, seq.detokenizer.read_offset],
        "num_cached_tokens": seq.num_cached_tokens,
        "num_preemptions": seq.num_preemptions,
    }


def sequence_from_wire(wire: dict[str, Any], block_size: int) -> Sequence:
    """Rebuild a WAITING sequence with no KV; the caller admits it with its handle."""
    if wire.get("v") != WIRE_VERSION:
        raise ValueError(f"unsupported sequence wire version {wire.get('v')!r}")
    params = SamplingParams(**wire["params"])
    images = [
        ImageEmbedding(img["offset"], torch.from_numpy(np.array(img["embeds"], copy=True)), img["hash"])
        for img in wire["images"]
    ]
    seq = Sequence(wire["seq_id"], wire["token_ids"][: wire["num_prompt_tokens"]], params, block_size, images)
    seq.token_ids = list(wire["token_ids"])
    if wire["generator_state"] is not None:
        assert seq.generator is not None
        seq.generator.set_state(torch.frombuffer(bytearray(wire["generator_state"]), dtype=torch.uint8))
    seq.text = wire["text"]
    seq.emitted_text_len = wire["emitted_text_len"]
    seq.detokenizer = IncrementalDetokenizer(*wire["detokenizer"])
    seq.num_cached_tokens = wire["num_cached_tokens"]
    seq.num_preemptions = wire["num_preemptions"]
    return seq
