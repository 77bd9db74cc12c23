"""Quantized copies of a dense checkpoint, in the formats models are released in, written by the libraries
that define those formats; and their exact dequantization, the numerical reference.

* ``fp8-block``: DeepSeek-V3 / Kimi-K2's own layout (``quant_method: fp8``): e4m3 weights and a float32
  ``weight_scale_inv`` per block, partial last blocks included.
* ``fp8-channel``: compressed-tensors ``float-quantized``, one scale per output row.
* ``int4`` / ``int4-asym``: compressed-tensors ``pack-quantized`` groups (Kimi-K2.5's experts: groups of 32,
  bf16 scales, symmetric).
* ``mxfp4``: compressed-tensors ``mxfp4-pack-quantized`` (e2m1 nibbles, an E8M0 scale per 32 values).

The codes and scales come from compressed-tensors (its ``calculate_qparams`` and compressors, the code
vLLM and llm-compressor use), never from Strata, so a test that loads the copy checks Strata against an
independent encoder. The layout is the release one: per-expert 2-D linears, an ``ignore`` list naming
every linear left dense. compressed-tensors and transformers are test and bench dependencies.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from strata.checkpoints.tiny_model import write_sha256sums

SKIP = ("embed_tokens", "lm_head", "mlp.gate.", "block_sparse_moe.gate.", "vision_tower", "visual",
        "multi_modal_projector")  # never quantized (routers: every release keeps them dense)
EXPERTS = ".mlp.experts."


@dataclass(frozen=True)
class Recipe:
    """How one release format is written: compressed-tensors' weight arguments and format name."""

    weights: dict[str, Any]
    ct_format: str
    native_fp8: bool = False  # DeepSeek's own config and ``weight_scale_inv`` names instead of compressed-tensors'
    scale_dtype: torch.dtype | None = None  # scales stored in this dtype (Kimi's bf16), rounded before encoding
    extra: dict[str, Any] = field(default_factory=dict)


def recipe(name: str, block: int = 128, group: int = 32) -> Recipe:
    """The recipe of a release format by name (``fp8-block``, ``fp8-channel``, ``int4``, ``int4-asym``, ``mxfp4``)."""
    recipes = {
        "fp8-block": Recipe({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                             "block_structure": [block, block]}, "float-quantized", native_fp8=True),
        "fp8-channel": Recipe({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                              "float-quantized"),
        "int4": Recipe({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group},
                       "pack-quantized", scale_dtype=torch.bfloat16),
        "int4-asym": Recipe({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                             "group_size": group}, "pack-quantized"),
        "mxfp4": Recipe({"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                         "scale_dtype": torch.uint8}, "mxfp4-pack-quantized"),
    }
    if name not in recipes:
        raise ValueError(f"unknown release format {name!r}; expected one of {', '.join(recipes)}")
    return recipes[name]


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module names of every 2-D ``.weight`` but embeddings, the LM head, routers and vision parts."""
    return sorted(k.removesuffix(".weight") for k, t in tensors.items()
                  if k.endswith(".weight") and t.dim() == 2 and not any(s in k for s in SKIP))


def _attach(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent = root
    *path, leaf = dotted.split(".")
    for part in path:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent.add_module(leaf, module)


def _observe(linear: nn.Linear, scale_dtype: torch.dtype | None) -> None:
    """Set the module's scale (and zero point) from its weight's range with compressed-tensors'
    ``calculate_qparams`` (the min/max observer llm-compressor's default uses, without calibration data)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = linear.quantization_scheme.weights
    w = linear.weight.data.float()
    rows, cols = w.shape
    if args.strategy == "group":
        n = math.ceil(cols / args.group_size)
        grouped = nn.functional.pad(w, (0, n * args.group_size - cols)).view(rows, n, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:  # block: partial last blocks padded with zeros, which the range includes anyway
        br, bc = args.block_structure
        r, c = math.ceil(rows / br), math.ceil(cols / bc)
        blocks = nn.functional.pad(w, (0, c * bc - cols, 0, r * br - rows)).view(r, br, c, bc)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero = calculate_qparams(lo, hi, args)
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).float()  # encode with the scale the file will hold
    linear.weight_scale.data = scale.to(linear.weight_scale.dtype).reshape(linear.weight_scale.shape).clone()
    if hasattr(linear, "weight_zero_point"):
        zp = linear.weight_zero_point
        zp.data = zero.to(zp.dtype).reshape(zp.shape).clone()


def encode(tensors: dict[str, torch.Tensor], names: list[str], r: Recipe) -> tuple[dict[str, torch.Tensor], Any]:
    """The compressed tensors of the linears ``names`` and compressed-tensors' config of them."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    root = nn.Module()
    for name in names:
        w = tensors[f"{name}.weight"]
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.float().clone()
        _attach(root, name, linear)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**r.weights))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=r.ct_format)
    apply_quantization_config(root, config)
    for name in names:
        _observe(root.get_submodule(name), r.scale_dtype)
    compressor = ModelCompressor.from_pretrained_model(root, quantization_format=r.ct_format)
    compressor.compress_model(root)
    out = {k: v.detach().clone() for k, v in root.state_dict().items()}
    if r.scale_dtype is not None:
        out = {k: v.to(r.scale_dtype) if k.endswith(".weight_scale") else v for k, v in out.items()}
    return out, compressor.quantization_config


def quantize_checkpoint(src: str | Path, out: str | Path, fmt: str, only_experts: bool = False, block: int = 128,
                        group: int = 32, shards: int = 3) -> Path:
    """Write ``src`` (a dense checkpoint) into ``out`` with its linears (or only its routed experts) in ``fmt``."""
    src, out = Path(src), Path(out)
    r = recipe(fmt, block, group)
    tensors = read_tensors(src)
    linears = _linears(tensors)
    chosen = [n for n in linears if EXPERTS in n] if only_experts else linears
    encoded, ct_config = encode(tensors, chosen, r)
    result = {k: v for k, v in tensors.items() if k.removesuffix(".weight") not in chosen or not k.endswith(".weight")}
    if r.native_fp8:
        encoded = {k.replace(".weight_scale", ".weight_scale_inv") if k.endswith(".weight_scale") else k: v
                   for k, v in encoded.items()}
        quant: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [block, block]}
    else:
        quant = ct_config.model_dump(exclude_none=True)
        quant["ignore"] = sorted({"lm_head", *[n for n in linears if n not in chosen], *_routers(tensors)})
        quant["quant_method"] = "compressed-tensors"
    result.update(encoded)
    _write(src, out, result, quant, shards)
    return out


def _routers(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.removesuffix(".weight") for k in tensors if k.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")))


def _write(src: Path, out: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any] | None, shards: int) -> None:
    """Sharded safetensors with an index, config.json (with ``quant``), and every other file of ``src``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        if not part:
            continue
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "SHA256SUMS",
                                                                           "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_sha256sums(out)


def dequantize_checkpoint(src: str | Path, out: str | Path) -> Path:
    """A dense float32 copy of a checkpoint written by :func:`quantize_checkpoint`: every quantized linear
    decompressed by compressed-tensors' own compressor, DeepSeek's FP8 blocks expanded by their definition
    (``w = code * scale of its block``; not transformers' CPU path, which misreads partial blocks)."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    quant = config["quantization_config"]
    tensors = read_tensors(src)
    modules = sorted({k.rpartition(".")[0] for k in tensors
                      if k.endswith((".weight_scale_inv", ".weight_packed", ".weight_scale"))})
    dense = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in modules}
    for module in modules:
        parts = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == module}
        dense[f"{module}.weight"] = (_expand_fp8_blocks(parts, quant["weight_block_size"])
                                     if quant["quant_method"] == "fp8" else decompress(parts, quant))
    _write(src, out, dense, None, 3)
    return out


def _expand_fp8_blocks(parts: dict[str, torch.Tensor], block: list[int]) -> torch.Tensor:
    codes, scale = parts["weight"].float(), parts["weight_scale_inv"].float()
    rows, cols = codes.shape
    full = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return codes * full


def decompress(parts: dict[str, torch.Tensor], quant: dict[str, Any]) -> torch.Tensor:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    # bf16 scales widened first: their products with 4-bit codes are exact in fp32, the library would round
    # them to bf16
    parts = {k: v.float() if k == "weight_scale" and v.dtype in (torch.bfloat16, torch.float16) else v
             for k, v in parts.items()}
    (group,) = quant["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group.get("format") or quant["format"])
    return compressor.decompress(parts, scheme)["weight"].float()
