"""Scales of an FP8 KV cache (``kv_cache_dtype: fp8``): one per layer for keys and one for values (one for
MLA's latent), calibrated once at load on a fixed text.

Why calibrated, and per layer: e4m3 keeps 3 mantissa bits from 2^-6 to 448 and flushes what lies below
2^-6 to a few subnormal steps. With vLLM's default scale of 1, the values of layers whose V is small
(SmolLM2's first layer: median |v| 0.02, 41% of values below 2^-6) lose most of their bits, and greedy
answers drift from a bf16 cache's on 7 of 8 short prompts. A scale per layer and part (the amax of a
calibration pass, times a headroom for larger values later, over 448) moves every layer into e4m3's
normal range. The scale is a power of two: dividing by it is exact, and two processes that calibrate the
same weights (a prefill and a decode replica with other thread counts, say) land on the same scales
unless an amax sits within rounding of a power of two. The scales are part of the KV fingerprint, so a
block is only ever read with the scales it was written with.

Reads never see the scales: a layer writes ``k / s_k`` and ``v / s_v``, attends with ``q * s_k`` over the
stored keys and multiplies its output by ``s_v`` (softmax(q.(s k)) = softmax((s q).k)), so every backend and
the spilled-tier path read the cache as plain e4m3 values.
"""

from __future__ import annotations

import math

import torch

from strata.kernels import AttentionMetadata
from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.cache_ops import FP8_MAX

HEADROOM = 8.0  # the calibration amax is scaled up by this before it is mapped to 448 (3 binades spare)
CALIBRATION_TEXT = (
    "The harbour was quiet in the early morning. Fishing boats rocked at their moorings while gulls circled "
    "overhead. def area(r):\n    return 3.14159 * r ** 2\n| year | tonnes |\n| 1998 | 4,210 |\n"
    "Q: What is 17 x 23? A: 391. Les marins rentraient au port; die Sonne ging unter; 海は静かだった. "
    "{\"name\": \"Ada\", \"id\": 1815, \"tags\": [\"math\", \"engines\"]} THE END!!! ... 0.000125 -42 1e9"
)


def scale_for(amax: float) -> float:
    """The power of two that maps ``amax`` x HEADROOM to at most 448 (1.0 for an all-zero layer)."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / FP8_MAX))


@torch.inference_mode()
def calibration_amax(model: torch.nn.Module, token_ids: list[int], block_size: int, backend: AttentionBackend,
                     device: str | torch.device) -> torch.Tensor:
    """amax of what every layer caches ([layers, parts], fp32) over ``token_ids``, from one forward into a
    private full-precision pool (never the engine's: nothing it writes can be reused). Under tensor
    parallelism every rank runs it on the same tokens (its collectives are the forward's own) and gets
    the amax of its own KV heads."""
    cfg = model.cfg
    t = len(token_ids)
    num_blocks = -(-t // block_size)
    dtype = model.embed_tokens.weight.dtype
    kv = torch.zeros(num_blocks, cfg.num_layers, cfg.kv_parts, block_size, cfg.kv_cache_heads, cfg.kv_cache_dim,
                     dtype=dtype, device=device)
    meta = AttentionMetadata.build([t], [t], [list(range(num_blocks))], list(range(t)), block_size)
    set_kv_scales(model, None)
    ids = torch.tensor(token_ids, device=device)
    model.forward(model.embed(ids), torch.arange(t, device=device), kv, meta, backend)
    return kv.abs().amax(dim=(0, 3, 4, 5)).float().cpu()


def scales_from_amax(amax: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer (key scale, value scale); MLA's one latent uses its scale for both."""
    return [(scale_for(float(row[0])), scale_for(float(row[-1]))) for row in amax]


def set_kv_scales(model: torch.nn.Module, scales: list[tuple[float, float]] | None) -> None:
    """Give each layer's attention its (key, value) scales; None: a cache in the model's own dtype."""
    for i, layer in enumerate(model.layers):
        layer.self_attn.kv_scales = None if scales is None else scales[i]
