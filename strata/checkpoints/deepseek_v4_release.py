"""A dense DeepSeek-V4 checkpoint rewritten in V4's release format, and that format's exact dequantization.

DeepSeek-V4 ships ``quant_method: fp8`` with ``scale_fmt: ue8m0`` and ``expert_dtype: fp4``:

* its attention and shared-expert linears are e4m3 blocks, each block's scale a power of two stored as
  ``float8_e8m0fnu`` under ``<linear>.scale`` (not ``weight_scale_inv``);
* its routed experts are FP4: ``<expert>.w1.weight`` int8 [rows, cols / 2] holding two e2m1 codes a byte
  (the low nibble first) and ``<expert>.w1.scale`` e8m0 [rows, cols / 32], one per 32 inputs;
* the compressors' and the indexer's scoring projections, the routers, the embeddings and the head stay
  dense.

The FP8 codes and scales come from transformers' own quantizer (``Fp8Quantize``, the code its FP8 release
path uses) and the FP4 ones from compressed-tensors' MXFP4 compressor, never from Strata, so a test that loads
the copy checks Strata against independent encoders. transformers and compressed-tensors are test and bench
dependencies.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from strata.checkpoints.quantized_checkpoint import _expand_fp8_blocks, _write, encode, read_tensors, recipe

FP8_LINEARS = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".indexer.wq_b.",
               ".shared_experts.w1.", ".shared_experts.w2.", ".shared_experts.w3.")
EXPERTS = ".ffn.experts."


def _fp8_quantizer(block: int):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=[block, block], scale_fmt="ue8m0")
    return Fp8Quantize(SimpleNamespace(quantization_config=config))


def write_deepseek_v4_release(src: str | Path, out: str | Path, block: int = 128, shards: int = 3) -> Path:
    """``src`` (a dense DeepSeek-V4 checkpoint) written into ``out`` as V4 is released: FP8 blocks of ``block``
    (every quantized dim a multiple of it: transformers' quantizer leaves other shapes dense) and FP4 experts."""
    src, out = Path(src), Path(out)
    tensors = read_tensors(src)
    result = dict(tensors)
    quantizer = _fp8_quantizer(block)
    for name in sorted(k for k in tensors if k.endswith(".weight") and any(s in k for s in FP8_LINEARS)):
        parts = quantizer._quantize_one(name, tensors[name].float())
        if len(parts) == 1:
            raise ValueError(f"{name} {tuple(tensors[name].shape)} is not whole {block}x{block} blocks")
        module = name.removesuffix(".weight")
        result[name], result[f"{module}.scale"] = parts[name], parts[f"{module}.weight_scale_inv"]
    experts = sorted(k.removesuffix(".weight") for k in tensors if EXPERTS in k and k.endswith(".weight"))
    encoded, _ = encode(tensors, experts, recipe("mxfp4"))
    for module in experts:
        result[f"{module}.weight"] = encoded[f"{module}.weight_packed"].view(torch.int8)
        result[f"{module}.scale"] = encoded[f"{module}.weight_scale"].view(torch.float8_e8m0fnu)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block],
             "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    _write(src, out, result, quant, shards)
    return out


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_deepseek_v4_release(src: str | Path, out: str | Path) -> Path:
    """A dense float32 copy of a V4 release checkpoint, every weight expanded by the format's definition: an FP8
    code times its block's scale (partial last blocks included), an e2m1 code times ``2^(byte - 127)``."""
    src, out = Path(src), Path(out)
    block = json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"]
    tensors = read_tensors(src)
    dense = {k: v for k, v in tensors.items() if not k.endswith(".scale")}
    for scale_name in (k for k in tensors if k.endswith(".scale")):
        name = scale_name.removesuffix(".scale") + ".weight"
        codes, scale = tensors[name], tensors[scale_name].float()
        if codes.dtype == torch.int8:
            u8 = codes.view(torch.uint8).long()
            values = E2M1[torch.stack([u8 & 0xF, u8 >> 4], dim=-1).flatten(-2)]
            dense[name] = values * scale.repeat_interleave(32, dim=-1)
        else:
            dense[name] = _expand_fp8_blocks({"weight": codes, "weight_scale_inv": scale}, block)
    _write(src, out, dense, None, 3)
    return out
