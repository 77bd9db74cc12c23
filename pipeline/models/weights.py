"""Streaming weight loader for checkpoints as they lie on disk.

Reads shard by shard, tensor by tensor (``safetensors.safe_open``), maps the checkpoint's names onto
our modules by its architecture's rules (``models.architectures``: classic llava-hf names,
transformers-5 names, causal-LM names), verifies the SHA-256 manifest, and reads only the tensors of
the parts a stage asks for. Per-expert tensors (Mixtral's ``w1/w2/w3``, DeepSeek's and Qwen3-MoE's
``gate/up/down_proj``) are stacked into the experts' 3-D layout as they arrive.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from strata.pipeline.models.architectures import ARCHITECTURES, ModelArchitecture
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.file_digest import file_identity, hash_file, remember
from strata.pipeline.models.load_plan import EXPERT, EXPERT_KIND, plan_load
from strata.pipeline.models.quant_loading import QuantCollector, QuantLoadError
from strata.pipeline.models.quant_modules import QuantEmbedding, tie_lm_head
from strata.pipeline.models.weight_formats import QuantScheme, WeightFormatError

if TYPE_CHECKING:
    from strata.pipeline.parallel.shard_plan import ShardPlan

log = logging.getLogger(__name__)

PARTS = ("vision", "projector", "text")
MANIFEST = "SHA256SUMS"
LLAVA = ARCHITECTURES["LlavaForConditionalGeneration"]
DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class WeightsError(RuntimeError):
    """The checkpoint's weights are missing, corrupt or do not fit the config; the message names the file."""


@dataclass
class LoadStats:
    shards_opened: list[str] = field(default_factory=list)
    tensors_read: int = 0
    bytes_read: int = 0
    skipped_tensors: int = 0


def canonical_name(name: str, arch: ModelArchitecture = LLAVA) -> tuple[str, str] | None:
    """Map a checkpoint tensor name to (part, name inside that part's module); None if not ours."""
    return arch.map_name(name)


def read_manifest(model_dir: Path) -> dict[str, str]:
    path = model_dir / MANIFEST
    if not path.is_file():
        return {}
    sums: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, fname = line.split(maxsplit=1)
            sums[fname.strip().lstrip("*")] = digest.lower()
    return sums


def verify_shard(path: Path, expected: str) -> None:
    """Check a shard against its manifest digest; the digest read on the way is remembered, so the
    KV fingerprint (a content digest of the weights) costs no second read of the file."""
    version = file_identity(path)
    digest = hash_file(path)
    if digest != expected:
        raise WeightsError(f"shard {path.name} does not match its SHA-256 in {MANIFEST}: "
                           "the file is corrupt or was changed")
    remember(path, digest, version)


def checked_shard(model_dir: Path, shard_file: str, sums: dict[str, str]) -> Path:
    """The path of a shard the index lists, present and matching its manifest digest when it has one."""
    path = model_dir / shard_file
    if not path.is_file():
        raise WeightsError(f"shard {shard_file} listed in the index is missing from {model_dir}")
    if shard_file in sums:
        verify_shard(path, sums[shard_file])
    return path


def weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or from the shards themselves. Every shard named
    by the index must lie inside the model directory: a hostile index cannot make us open other files."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index.name} is not a valid safetensors index ({type(exc).__name__})") from None
        if not isinstance(mapping, dict):
            raise WeightsError(f"{index.name}: weight_map is not an object")
        for shard in set(mapping.values()):
            _check_shard_name(shard)
        return dict(mapping)
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"no *.safetensors weights in {model_dir}")
    mapping: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as f:
            mapping.update({k: shard for k in f.keys()})
    return mapping


def _check_shard_name(shard: object) -> None:
    """A shard is a relative path that stays inside the model directory (no absolute path, no ``..``).
    Symlinks inside the directory are the owner's choice (the Hugging Face cache links into blobs/)."""
    if not isinstance(shard, str) or not shard or "\0" in shard:
        raise WeightsError(f"the weight index names an invalid shard file {shard!r}")
    norm = os.path.normpath(shard)
    if os.path.isabs(shard) or norm == ".." or norm.startswith(".." + os.sep) or norm == ".":
        raise WeightsError(f"the weight index names shard {shard!r}, which lies outside the model directory")


def shard_files(model_dir: Path) -> list[str]:
    """Every weight file the checkpoint uses, sorted."""
    return sorted(set(weight_map(model_dir).values()))


def _assign(module: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    current = getattr(parent, leaf)
    if _transposed_experts(leaf, tensor, current):  # Qwen3-VL-MoE's release: [E, H, 2I] and [E, I, H]
        tensor = tensor.transpose(1, 2)
    if tuple(current.shape) != tuple(tensor.shape):
        raise WeightsError(f"tensor {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(current.shape)}")
    if not current.dtype.is_floating_point and not tensor.dtype.is_floating_point:  # an index table (V4's tid2eid)
        setattr(parent, leaf, nn.Parameter(tensor.to(current.dtype), requires_grad=False))
        return
    if tensor.dtype not in DENSE_DTYPES:  # e4m3 bytes or packed integers read as numbers: every answer wrong
        raise WeightsError(f"tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, but the "
                           "checkpoint's config says nothing of how to read it (no quantization_config claims it)")
    # a router scores in fp32 whatever the model's dtype, as the reference does; a weight the reference holds
    # in the model dtype but multiplies in fp32 (gpt-oss's norms) is rounded to that dtype, then widened
    if getattr(parent, "keep_fp32", False):
        tensor = tensor.to(torch.float32)
    elif getattr(parent, "widen_after_cast", False):
        tensor = tensor.to(dtype).to(torch.float32)
    else:
        tensor = tensor.to(dtype)
    if getattr(parent, "weight_offset", 0.0):  # a norm stored as w that scales by 1 + w (held widened)
        tensor = tensor + parent.weight_offset
    setattr(parent, leaf, nn.Parameter(tensor, requires_grad=False))


def _transposed_experts(leaf: str, tensor: torch.Tensor, current: torch.Tensor) -> bool:
    """A stacked expert tensor stored as ``x @ W`` ([E, in, out]) where ours is ``W @ x`` ([E, out, in]), as
    Qwen3-VL-MoE's releases keep them (transformers 5 transposes them on load, and writes its own layout)."""
    if leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3 or current.dim() != 3:
        return False
    e, a, b = current.shape
    return a != b and tuple(tensor.shape) == (e, b, a)


class _ExpertMerger:
    """Collects classic per-expert w1/w2/w3 tensors into the stacked gate_up / down layout."""

    def __init__(self, num_experts: int, first_expert: int = 0) -> None:
        self.num_experts = num_experts  # the experts this process holds: global ids first_expert ..
        self.first_expert = first_expert
        self.parts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)

    def add(self, layer: int, expert: int, kind: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        expert -= self.first_expert
        kind = EXPERT_KIND[kind]
        self.parts[(layer, kind)][expert] = tensor
        done: list[tuple[str, torch.Tensor]] = []
        w1, w3 = self.parts.get((layer, "w1"), {}), self.parts.get((layer, "w3"), {})
        if kind in ("w1", "w3") and len(w1) == len(w3) == self.num_experts:
            stacked = torch.stack([torch.cat([w1[e], w3[e]], dim=0) for e in range(self.num_experts)])
            done.append((f"layers.{layer}.mlp.experts.gate_up_proj", stacked))
            del self.parts[(layer, "w1")], self.parts[(layer, "w3")]
        w2 = self.parts.get((layer, "w2"), {})
        if kind == "w2" and len(w2) == self.num_experts:
            done.append((f"layers.{layer}.mlp.experts.down_proj", torch.stack([w2[e] for e in range(self.num_experts)])))
            del self.parts[(layer, "w2")]
        return done


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not enabled, leave=False)


def load_weights(
    model_dir: str | Path,
    modules: dict[str, nn.Module],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    verify: bool = True,
    progress: bool | None = None,
    shard: "ShardPlan | None" = None,
    arch: ModelArchitecture = LLAVA,
    quant: QuantScheme | None = None,
) -> LoadStats:
    """Stream the tensors of the parts in ``modules`` (keys from :data:`PARTS`) into those modules.

    Modules may be built on the meta device; every parameter must be filled or this raises.
    Tensors of other parts are never read; their shards are never opened. With ``shard`` (a
    tensor-parallel rank's plan) only that rank's slice of each decoder tensor is read, and
    experts it does not hold are skipped. With ``quant`` (the checkpoint's quantization scheme) the
    text part's linears stored quantized are swapped for their quantized modules and filled in their
    stored format. Which tensors are read is :func:`plan_load`'s answer; a tensor it refuses fails the
    load before any shard is opened.
    """
    model_dir = Path(model_dir)
    unknown = set(modules) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown model parts {sorted(unknown)}; expected some of {PARTS}")
    mapping = weight_map(model_dir)
    stats = LoadStats()
    quantized = quant_collector(quant, modules, mapping, arch, shard)
    plan = plan_load(mapping, modules, arch, quantized, shard)
    if plan.refused:
        more = f" (and {len(plan.refused) - 1} more)" if len(plan.refused) > 1 else ""
        raise WeightsError(plan.refused[0][1] + more)
    stats.skipped_tensors = plan.skipped + len(plan.past_decoder)
    wanted: dict[str, list[tuple[str, str, str]]] = defaultdict(list)  # shard file -> tensors to read
    for ckpt_name, part, name in plan.reads:
        wanted[mapping[ckpt_name]].append((ckpt_name, part, name))
    sums = read_manifest(model_dir) if verify else {}
    text = modules.get("text")
    if shard is not None and shard.cfg.num_experts:
        merger = _ExpertMerger(shard.experts[1] - shard.experts[0], shard.experts[0])
    else:
        merger = _ExpertMerger(getattr(getattr(text, "cfg", None), "num_experts", 0))
    total = sum((model_dir / s).stat().st_size for s in wanted if (model_dir / s).is_file())
    with _progress(total, progress if progress is not None else total > (256 << 20)) as bar:
        for shard_file in sorted(wanted):
            path = checked_shard(model_dir, shard_file, sums)
            stats.shards_opened.append(shard_file)
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for ckpt_name, part, name in wanted[shard_file]:
                        plan = shard if part == "text" else None
                        if quantized is not None and part == "text" and quantized.claims(name):
                            tensor = _read_cut(f, ckpt_name, quantized.slice_for(name))
                            stats.tensors_read += 1
                            stats.bytes_read += tensor.numel() * tensor.element_size()
                            quantized.add(name, tensor.to(device=device))
                            continue
                        tensor = _read(f, ckpt_name, name, plan)
                        stats.tensors_read += 1
                        stats.bytes_read += tensor.numel() * tensor.element_size()
                        if plan is not None:
                            tensor = _pad_rows(tensor, plan.padded_rows(name))
                        _place(modules[part], part, name, tensor.to(device=device), merger, dtype)
            except WeightsError:
                raise
            except (QuantLoadError, WeightFormatError, ModelConfigError) as exc:
                raise WeightsError(str(exc)) from None
            except Exception as exc:  # safetensors raises its own types for truncated or garbled files
                raise WeightsError(f"cannot read shard {shard_file}: {exc}") from exc
            bar.update(path.stat().st_size)
    _finish(modules, dtype, device)
    lacking = quantized.missing() if quantized is not None else []
    if lacking:
        shown = ", ".join(lacking[:5]) + (" …" if len(lacking) > 5 else "")
        raise WeightsError(f"checkpoint lacks the quantized tensors of {len(lacking)} module(s): {shown}")
    return stats


def text_tensor_names(mapping: dict[str, str], arch: ModelArchitecture) -> list[tuple[str, str]]:
    """(checkpoint name, our name) of every tensor of the text part."""
    return [(ckpt, target[1]) for ckpt in mapping if (target := arch.map_name(ckpt)) is not None and target[0] == "text"]


def quant_collector(quant: QuantScheme | None, modules: dict[str, nn.Module], mapping: dict[str, str],
                    arch: ModelArchitecture, shard: "ShardPlan | None") -> QuantCollector | None:
    """The quantized modules of the text part, swapped in before anything is read."""
    if quant is None or "text" not in modules:
        return None
    names = text_tensor_names(mapping, arch)
    try:
        return QuantCollector(quant, modules["text"], names, shard)
    except (ModelConfigError, ValueError) as exc:
        raise WeightsError(str(exc)) from None


def _read(f, ckpt_name: str, name: str, shard: "ShardPlan | None") -> torch.Tensor:
    """The tensor, or only this rank's slices of it (strided reads of the mapped file: the other rows or
    columns are never copied), concatenated where it holds several ranges."""
    cut = shard.cut_for(name) if shard is not None else None
    if cut is None:
        return f.get_tensor(ckpt_name)
    dim, ranges = cut
    parts = [_read_cut(f, ckpt_name, (dim, start, stop)) for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read_cut(f, ckpt_name: str, cut: tuple[int, int, int] | None) -> torch.Tensor:
    if cut is None:
        return f.get_tensor(ckpt_name)
    dim, start, stop = cut
    index = (slice(None),) * dim + (slice(start, stop),)
    return f.get_slice(ckpt_name)[index]


def _pad_rows(tensor: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)])


def _place(module: nn.Module, part: str, name: str, tensor: torch.Tensor, merger: _ExpertMerger,
           dtype: torch.dtype) -> None:
    split = getattr(module, "split_fused", None)
    pieces = split(name, tensor) if split is not None else None
    if pieces is not None:  # one checkpoint tensor holding several of ours (MoonViT's wqkv)
        for piece_name, piece in pieces:
            _assign(module, piece_name, piece, dtype)
        return
    m = EXPERT.match(name) if part == "text" else None
    if m is None:
        _assign(module, name, tensor, dtype)
        return
    for merged_name, merged in merger.add(int(m.group(1)), int(m.group(2)), m.group(3), tensor):
        _assign(module, merged_name, merged, dtype)


def _finish(modules: dict[str, nn.Module], dtype: torch.dtype, device: torch.device | str) -> None:
    text = modules.get("text")
    if text is not None and hasattr(text, "compute_dtype"):
        text.compute_dtype = dtype
    if text is not None and isinstance(text.embed_tokens, QuantEmbedding):
        text.embed_tokens.dtype = dtype
        if isinstance(text.lm_head, nn.Linear) and text.lm_head.weight.is_meta and text.cfg.tie_word_embeddings:
            tie_lm_head(text)
    elif text is not None and text.lm_head.weight.is_meta and text.cfg.tie_word_embeddings:
        text.lm_head.weight = text.embed_tokens.weight
    missing = [f"{part}.{n}" for part, m in modules.items() for n, p in m.named_parameters() if p.is_meta]
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise WeightsError(f"checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")
