"""A multi-token-prediction layer added to a tiny checkpoint, laid out as DeepSeek-V3 and GLM-4.5 ship theirs.

transformers builds neither family's MTP layer (it skips ``model.layers.{num_hidden_layers}.*`` on load),
so the layer is made here: transformers' own decoder layer of the family at index ``num_hidden_layers``
(built in a model one layer deeper, same config otherwise, fixed seed), plus ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm``, and the copies of the embedding and output head releases store beside
it. It goes into a shard of its own, the index and SHA256SUMS are rewritten, and config.json says
``num_nextn_predict_layers: 1``.
"""

from __future__ import annotations

import json
from pathlib import Path

from strata.checkpoints.tiny_model import write_sha256sums
from strata.checkpoints.tiny_text_models import perturb_params

SHARD = "model-mtp.safetensors"


def add_mtp_layer(model_dir: str | Path, seed: int = 0) -> Path:
    """Give the checkpoint at ``model_dir`` (a tiny text model of an MTP family) one MTP layer, in place."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    layers = int(raw["num_hidden_layers"])
    deeper = AutoConfig.from_pretrained(model_dir)
    deeper.num_hidden_layers = layers + 1
    torch.manual_seed(seed + 7)
    model = AutoModelForCausalLM.from_config(deeper, dtype=torch.float32).eval()
    perturb_params(model, seed + 7)
    prefix = f"model.layers.{layers}."
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k.startswith(prefix)}
    hidden = deeper.hidden_size
    gen = torch.Generator().manual_seed(seed + 11)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = torch.empty(hidden).uniform_(0.5, 1.5, generator=gen)
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * deeper.initializer_range
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {
        "metadata": {}, "weight_map": _weight_map(model_dir / "model.safetensors")}
    shared = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
    for name, ours in shared.items():  # releases store copies of both beside the layer
        source = name if name in index["weight_map"] else "model.embed_tokens.weight"  # a tied head
        with safe_open(model_dir / index["weight_map"][source], "pt") as f:
            tensors[prefix + ours] = f.get_tensor(source).clone()
    save_file(tensors, model_dir / SHARD, metadata={"format": "pt"})
    index["weight_map"].update({name: SHARD for name in tensors})
    index_path.write_text(json.dumps(index, indent=2))
    raw["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2))
    write_sha256sums(model_dir)
    return model_dir


def _weight_map(shard: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(shard, "pt") as f:
        return {name: shard.name for name in f.keys()}
