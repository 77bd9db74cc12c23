"""Scales of an FP8 KV cache (``kv_cache_dtype: fp8``): one per KV-layout layer for keys and one for values
(one for MLA's latent, one for DSA's indexer keys), calibrated once at load on a fixed text.

Why calibrated, and per layer: e4m3 keeps 3 mantissa bits from 2^-6 to 448 and flushes what lies below
2^-6 to a few subnormal steps. With vLLM's default scale of 1, the values of layers whose V is small
(SmolLM2's first layer: median |v| 0.02, 41% of values below 2^-6) lose most of their bits, and greedy
answers drift from a bf16 cache's on 7 of 8 short prompts. A scale per layer and part (the amax of a
calibration pass, times a headroom for larger values later, over 448) moves every layer into e4m3's
normal range. The scale is a power of two: dividing by it is exact. The scales are part of the KV
fingerprint, so a block is only ever read with the scales it was written with.

Calibrated once per node, then shared (``shared_scales``): a prefill replica at tp=1 and a decode group at
tp=2 sum their partial outputs in other orders, and in bf16 that moves an amax by a rounding step, which
may cross a power of two; two stages with different scales could not hand a prompt's KV over. So the
first process to calibrate a model (its fingerprint without scales, and this module's calibration)
writes the scales under the digest cache, holding a lock while it does, and every later one on the node
reads them.

Reads never see the scales: a layer writes ``k / s_k`` and ``v / s_v``, attends with ``q * s_k`` over the
stored keys and multiplies its output by ``s_v`` (softmax(q.(s k)) = softmax((s q).k)), so every backend and
the spilled-tier path read the cache as plain e4m3 values.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from strata.kernels import AttentionMetadata
from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.cache_ops import FP8_MAX
from strata.pipeline.models.file_digest import cache_root
from strata.pipeline.models.linear_mixer import LinearMixer, LinearStates, state_kinds

log = logging.getLogger(__name__)

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
    """amax of what every KV-layout layer caches ([layers, 2]: keys, values; a latent's twice; fp32) over
    ``token_ids``, from one forward into a private full-precision pool (never the engine's: nothing it writes
    can be reused). Every cache group counts (DSA's indexer keys are layers of their own). Under tensor
    parallelism every rank runs it on the same tokens (its collectives are the forward's own) and gets
    the amax of its own KV heads."""
    from strata.pipeline.models.cache_groups import kv_layout

    t = len(token_ids)
    num_blocks = -(-t // block_size)
    layout = kv_layout(model.cfg, block_size, model.compute_dtype)
    kv = [torch.zeros(num_blocks, *layout.groups[layout.group_of(i)[0]].layer_shape(block_size),
                      dtype=model.compute_dtype, device=device) for i in range(layout.num_layers)]
    meta = AttentionMetadata.build([t], [t], [list(range(num_blocks))], list(range(t)), block_size, device)
    meta.prompt_lens = [t]
    if any(model.cfg.linear_layers):  # a hybrid's linear layers run from a zero state of their own
        meta.states = _private_states(model, t, device)
    set_kv_scales(model, None)
    ids = torch.tensor(token_ids, device=device)
    meta.token_ids = ids  # DeepSeek-V4's hash-routed layers
    model.forward(model.embed(ids), torch.arange(t, device=device), kv, meta, backend)
    parts = [layer.abs().amax(dim=(0, 2, 3, 4)) for layer in kv]  # [kv_parts] each
    return torch.stack([torch.stack([p[0], p[-1]]) for p in parts]).float().cpu()


def _private_states(model: torch.nn.Module, t: int, device: str | torch.device) -> LinearStates:
    """One sequence's linear-attention state, read from a zero slot and written to another, in a pool of the
    calibration's own (this rank's heads under tensor parallelism: ``model.cfg`` is its local config)."""
    from strata.kvstore.state_pool import StatePool

    pool = StatePool(state_kinds(model.cfg, model.compute_dtype), sum(model.cfg.linear_layers), 2, device)
    return LinearStates(pool, [0], [1], [t], [(-1, -1)])


def scales_from_amax(amax: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer (key scale, value scale); MLA's one latent uses its scale for both."""
    return [(scale_for(float(row[0])), scale_for(float(row[-1]))) for row in amax]


def set_kv_scales(model: torch.nn.Module, scales: list[tuple[float, float]] | None) -> None:
    """Give each layer's attention its (key, value) scales, and a DSA indexer its keys' scale (the row of its
    KV-layout layer); None: a cache in the model's own dtype. A model whose layers read several KV-layout layers
    each (DeepSeek-V4) takes the whole list."""
    if (by_layout := getattr(model, "set_layout_kv_scales", None)) is not None:
        by_layout(scales)
        return
    for layer in model.layers:
        attn = layer.mixer
        if isinstance(attn, LinearMixer):  # a linear-attention layer caches no KV
            continue
        attn.kv_scales = None if scales is None else scales[attn.layer_idx]  # its KV-layout layer
        if getattr(attn, "index_layer", None) is not None:
            attn.index_scale = None if scales is None else scales[attn.index_layer][0]


Scales = list[tuple[float, float]]


def _calibration_id() -> str:
    """What else decides the scales besides the model: the text and the headroom (and this format)."""
    return hashlib.sha256(f"kv-scales.v1\0{HEADROOM}\0{CALIBRATION_TEXT}".encode()).hexdigest()[:16]


def scales_path(model_key: bytes) -> Path:
    """Where the node keeps a model's scales: ``model_key`` is its KV fingerprint without scales."""
    return cache_root() / "kv-scales" / f"{model_key.hex()[:32]}-{_calibration_id()}.json"


def _read(path: Path, num_layers: int) -> Scales | None:
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(rows, list) and len(rows) == num_layers
          and all(isinstance(r, list) and len(r) == 2 and all(_is_scale(x) for x in r) for r in rows))
    return [(float(k), float(v)) for k, v in rows] if ok else None


def _is_scale(x: object) -> bool:
    """A stored scale is a positive finite power of two (anything else is a damaged record: recalibrate)."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0 and x == 2.0 ** round(math.log2(x))


@contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Holds ``path``'s lock (True), or yields False when the cache cannot hold one (read-only, full)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.warning("FP8 KV scales are not shared on this node (%s): this process calibrates its own", exc)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a killed holder's lock is dropped by the kernel
        yield True
    finally:
        os.close(fd)


def shared_scales(model_key: bytes, num_layers: int, calibrate: Callable[[], Scales]) -> Scales:
    """This node's scales for the model: read if a process calibrated it already, else calibrated now
    (under the lock, so concurrent starts calibrate once) and written (0600, atomically)."""
    path = scales_path(model_key)
    with _locked(path) as shared:
        if not shared:
            return calibrate()
        if (known := _read(path, num_layers)) is not None:
            return known
        scales = calibrate()
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump([list(s) for s in scales], f)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only cache: this process still serves with what it computed
            log.warning("could not keep the FP8 KV scales at %s (%s)", path, exc)
            tmp.unlink(missing_ok=True)
        return scales
