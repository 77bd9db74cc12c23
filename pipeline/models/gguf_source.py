"""A GGUF file as a checkpoint directory that Strata loads like any other, with its quantized blocks kept.

``strata serve --model model.gguf`` reads the file once into the cache: config, tokenizer and chat
template from its metadata (transformers' GGUF reader), and every tensor under its Hugging Face name.
The ``q4_0`` / ``q4_1`` / ``q8_0`` tensors keep llama.cpp's bytes unchanged, as ``X.weight_q4_1`` and the
like (format kind :class:`weight_formats.GGMLBlock`). The ``quantization_config`` says
``quant_method: gguf``. Their rows are only reordered where llama.cpp's converter permuted q/k for its
RoPE; a row of blocks moves whole.
Dense tensors (F32, F16, BF16) stay dense. Other block types (the K-quants, IQ) are widened to fp32 by
gguf-py's exact dequantizer, and ``ops`` then shows them as dense. The cache key covers the file's
content, this converter's version and the transformers that read the metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from strata.pipeline.models.file_digest import file_sha256, hash_file
from strata.pipeline.models.weight_formats.ggml_block import GGML_KINDS

log = logging.getLogger(__name__)

CONVERTER = "strata-gguf-1"  # bump when the directory this writes changes
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF architectures whose tensors need only names (and q/k rows)
SHARD_BYTES = 2 << 30


class GGUFError(ValueError):
    """A GGUF Strata cannot read; the message names what (one line)."""


def gguf_checkpoint(gguf: Path, cache_dir: Path) -> Path:
    """The checkpoint directory of ``gguf`` under ``cache_dir/models``, written the first time (atomically:
    concurrent callers see nothing or a whole directory)."""
    import transformers

    digest = file_sha256(gguf)
    key = hashlib.sha256(f"{digest} {CONVERTER} transformers {transformers.__version__}".encode()).hexdigest()[:16]
    return written_once(cache_dir / "models" / f"{gguf.name.removesuffix('.gguf')}-gguf-{key}",
                        lambda out: convert(gguf, out))


def written_once(final: Path, write: Callable[[Path], None]) -> Path:
    """``final``, a directory ``write`` fills the first time: written beside it and renamed into place, so
    concurrent callers see nothing or a whole directory (the loser's copy is dropped)."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert(gguf: Path, out: Path) -> None:
    """Write ``gguf`` as a checkpoint into the (empty) directory ``out``."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader, dequantize
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map
    except ImportError as exc:
        raise GGUFError(f"reading a GGUF needs the gguf package ({exc.name} is missing): pip install gguf") from None
    try:
        reader = GGUFReader(gguf)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{gguf.name} is not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[-1]).decode() if field is not None else "?"
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf.name}: GGUF architecture {arch!r} is not implemented (Strata reads "
                        f"{', '.join(ARCHITECTURES)} GGUFs)")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    kept = {getattr(GGMLQuantizationType, k.upper()): k for k in GGML_KINDS}
    dense = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    kinds: Counter[str] = Counter()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, widened, unplaced = 0, [], []
    for t in reader.tensors:
        hf_name = names.get(t.name)
        if hf_name is None:
            unplaced.append(t.name)
            continue
        if t.tensor_type in kept:
            kind = kept[t.tensor_type]
            rows = processor.process(np.asarray(t.data), t.name).weights  # a row of blocks moves whole
            name, tensor = f"{hf_name.removesuffix('.weight')}.weight_{kind}", torch.from_numpy(np.array(rows))
            kinds[kind] += tensor.shape[0]
        else:
            values = np.asarray(t.data) if t.tensor_type in dense else dequantize(np.asarray(t.data), t.tensor_type)
            if t.tensor_type not in dense:
                widened.append(f"{t.name} ({t.tensor_type.name})")
            name, tensor = hf_name, torch.from_numpy(np.array(processor.process(values, t.name).weights))
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if unplaced:
        log.warning("%s: %d GGUF tensor(s) with no place in %s are not read: %s", gguf.name, len(unplaced),
                    config.model_type, ", ".join(unplaced[:5]))
    if widened:
        log.warning("%s: %d tensor(s) in block types Strata does not keep are widened to fp32: %s", gguf.name,
                    len(widened), ", ".join(widened[:5]))
    _write(out, shards)
    raw = config.to_dict()
    if kinds:
        raw["quantization_config"] = {"quant_method": "gguf", "ggml_types": [k for k, _ in kinds.most_common()],
                                      "source": gguf.name}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _write(out: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    """Safetensors shards, their index and their SHA256SUMS."""
    from safetensors.torch import save_file

    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({name: fname for name in shard})
    sums = [f"{hash_file(out / fname)}  {fname}\n" for fname in files]
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out / "SHA256SUMS").write_text("".join(sums))
