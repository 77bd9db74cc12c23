"""A gpt-oss checkpoint as OpenAI releases it: routed experts in MXFP4 ``_blocks``/``_scales``.

The codes and E8M0 scales come from compressed-tensors' MXFP4 encoder (``quantized_checkpoint.encode``),
never from Strata; this module only lays them out as gpt-oss does: per layer
``mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H / 32, 16] with ``_scales`` [E, 2I, H / 32] (rows are
outputs, gate and up alternating as in the dense ``x @ W`` columns), and ``down_proj_blocks`` [E, H, I / 32, 16]
with its scales; biases, attention, router, embeddings and LM head stay dense, as
``modules_to_not_convert`` says. transformers' own dequantizer (``Mxfp4Config(dequantize=True)``) is the
reference that reads it back. Test and bench only.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from strata.checkpoints.quantized_checkpoint import _write, encode, read_tensors, recipe

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def write_gpt_oss_mxfp4(src: str | Path, out: str | Path) -> Path:
    """Write the dense gpt-oss checkpoint ``src`` into ``out`` with its experts in gpt-oss's MXFP4 layout."""
    src, out = Path(src), Path(out)
    tensors = read_tensors(src)
    result = dict(tensors)
    for name, stacked in tensors.items():
        m = _EXPERTS.match(name)
        if m is None:
            continue
        rows_first = stacked.transpose(1, 2).float()  # [E, out, in]: one linear per expert
        names = [f"e{e}" for e in range(rows_first.shape[0])]
        encoded, _ = encode({f"{n}.weight": w for n, w in zip(names, rows_first)}, names, recipe("mxfp4"))
        packed = torch.stack([encoded[f"{n}.weight_packed"] for n in names])
        scales = torch.stack([encoded[f"{n}.weight_scale"] for n in names])
        e, rows, half = packed.shape
        del result[name]
        result[f"{name}_blocks"] = packed.reshape(e, rows, half // 16, 16).contiguous()
        result[f"{name}_scales"] = scales.contiguous()
    _write(src, out, result, {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}, 3)
    return out
