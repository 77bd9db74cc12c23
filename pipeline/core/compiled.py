"""``torch.compile`` of the model step's dense parts (``EngineConfig.compile``).

What is compiled: the three pure tensor functions of :class:`~pipeline.models.decoder.DenseSteps`
(norm + q/k/v + RoPE; output projection + norm + MLP), one graph each shared by every layer
(weights are inputs, not constants). Paged attention stays eager: it reads the pool through the
step's metadata. On CPU the graphs take a dynamic token count (one compile serves every batch);
on CUDA they are compiled for decode-sized batches, token counts padded to a bucket so compiles
stay bounded, while larger (prefill) steps run eager.

Not CUDA graphs, on purpose: a graph shared by every layer takes the weights as inputs, and a
CUDA graph replays fixed addresses, so ``mode="reduce-overhead"`` would either copy each layer's
weights into the graph's static buffers on every call (non-static inputs) or record a graph per
layer (static inputs whose address changes), and fall back to eager past its re-record limit.
Capturing the whole decode step per batch bucket (weights as constants, attention metadata in
static buffers), as vLLM does, is what CUDA graphs need here; it waits for a GPU to measure on.

Compiled artifacts are cached on disk by inductor (``~/.cache/strata/inductor`` unless
``TORCHINDUCTOR_CACHE_DIR`` is set), so a restart re-traces but does not recompile.
Measured on the 2-core CPU this project develops on (``strata bench offline --compile``): the
compiled steps do not beat eager there (per-call guard overhead equals the fused-op savings), so
compiling is off by default; the first request after a restart pays ~10-25 s.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from strata.pipeline.models.decoder import DenseSteps, LanguageModel
from strata.pipeline.models.quant_modules import quant_weights

log = logging.getLogger(__name__)

CUDA_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # decode token counts compiled for on CUDA


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class BucketedSteps(DenseSteps):
    """CUDA: pad the token count to a bucket and run the compiled graph; eager beyond the largest."""

    def __init__(self, compiled: DenseSteps, eager: DenseSteps, buckets: tuple[int, ...]) -> None:
        super().__init__()
        self.buckets = buckets
        for name in ("qkv_rope", "out_proj_norm", "out_proj_mlp"):
            setattr(self, name, self._wrap(getattr(compiled, name), getattr(eager, name)))

    def _wrap(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
        def call(x: torch.Tensor, *args: Any) -> Any:
            t = x.shape[0]
            size = _bucket(t, self.buckets)
            if size is None:
                return eager(x, *args)
            padded = [_pad(a, t, size) for a in (x, *args)]
            out = compiled(*padded)
            return tuple(o[:t] for o in out) if isinstance(out, tuple) else out[:t]

        return call


def _pad(a: Any, t: int, size: int) -> Any:
    """Pad per-token tensors (first dim == t) to ``size`` rows; leave weights and scalars alone."""
    if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] != t or size == t:
        return a
    return torch.cat([a, a.new_zeros((size - t, *a.shape[1:]))])


def compile_model(model: LanguageModel, device: torch.device, max_decode_tokens: int, max_step_tokens: int) -> float:
    """Swap the model's dense steps for compiled ones and compile them now; returns the seconds spent."""
    if quant_weights(model):  # the steps would trace the tile loop of every quantized linear
        log.warning("not compiling the model step: its weights are kept quantized, computed by kernels.quant_linear")
        return 0.0
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "strata" / "inductor"))
    eager = DenseSteps()
    if device.type == "cuda":
        fns = {n: torch.compile(getattr(eager, n), dynamic=False) for n in ("qkv_rope", "out_proj_norm", "out_proj_mlp")}
        compiled = DenseSteps()
        for name, fn in fns.items():
            setattr(compiled, name, fn)
        buckets = tuple(b for b in CUDA_BUCKETS if b <= max(1, max_decode_tokens)) or (1,)
        steps: DenseSteps = BucketedSteps(compiled, eager, buckets)
        warm = buckets
    else:
        steps = DenseSteps()
        for name in ("qkv_rope", "out_proj_norm", "out_proj_mlp"):
            setattr(steps, name, torch.compile(getattr(eager, name), dynamic=True))
        # One token is specialised by dynamo; the dynamic graph's guards cover counts up to the one it
        # was traced with, so it is traced with the largest a step can have.
        warm = (1, max(2, max_step_tokens))
    log.warning("compiling the model step (%s, token counts %s); cached on disk for later runs",
                "inductor Triton" if device.type == "cuda" else "inductor C++", ", ".join(map(str, warm)))
    t0 = time.perf_counter()
    model.steps = steps
    with torch.inference_mode():
        for t in warm:
            _warm_up(model, device, t)
    seconds = time.perf_counter() - t0
    log.warning("model step compiled in %.1f s", seconds)
    return seconds


def _warm_up(model: LanguageModel, device: torch.device, t: int) -> None:
    """Run every compiled function once at token count ``t`` on the first layer's weights."""
    layer = model.layers[0]
    a, ln1, ln2, mlp = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    if a.qkv_weight is None:
        model.fuse_projections()
    dtype = a.qkv_weight.dtype
    x = torch.zeros(t, model.cfg.hidden_size, dtype=dtype, device=device)
    cos, sin = model.rope.cos_sin(torch.arange(t, device=device), dtype)
    model.steps.qkv_rope(x, ln1.weight, ln1.eps, a.qkv_weight, a.qkv_bias, cos, sin, a.num_heads, a.num_kv_heads,
                         a.head_dim)
    attn = torch.zeros(t, a.num_heads, a.head_dim, dtype=dtype, device=device)
    model.steps.out_proj_norm(x, attn, a.o_proj.weight, a.o_proj.bias, ln2.weight, ln2.eps)
    if getattr(mlp, "gate_up_weight", None) is not None:
        model.steps.out_proj_mlp(x, attn, a.o_proj.weight, a.o_proj.bias, ln2.weight, ln2.eps, mlp.gate_up_weight,
                                 mlp.gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias)
