"""`strata ops --model DIR`: the operator inventory of a checkpoint, before anything is loaded.

Reads ``config.json`` (and the safetensors index when there is one), lists every component the
model needs, and says which implementation on this machine covers it: the torch reference, the
fast CPU backend, a CUDA kernel, or none. It also checks the weights against the components:
tensors no component claims, and tensors a component needs that the checkpoint lacks.
Exit 0: everything covered; exit 1: the list of what is missing. Never a traceback on a config we
do not know: an unknown model is a list of missing components, not a crash.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.kernels import available_backends
from strata.kernels.rope import SUPPORTED_ROPE_TYPES
from strata.pipeline.models.activations import ACTIVATIONS
from strata.pipeline.models.model_config import TEXT_MODEL_TYPES, read_config_json
from strata.pipeline.models.weights import canonical_name

VISION_TYPES = ("clip_vision_model",)
SELECT_STRATEGIES = ("default", "full")
TOP_LEVEL_TYPES = ("llava",)
MISSING = None


@dataclass
class Component:
    name: str
    need: str  # what the checkpoint asks for, in words
    impl: str | None  # what implements it here; None: nothing does


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--json", type=Path, help="also write the inventory here")


def _attention_impl() -> str:
    cpu = available_backends("cpu")
    names = {"cpu": "paged C++ kernel (fast)", "torch": "torch reference"}
    impl = ", ".join(names.get(n, n) for n in cpu)
    try:
        import torch

        if torch.cuda.is_available():
            impl += "; CUDA: " + ", ".join(available_backends("cuda"))
    except Exception:  # no usable CUDA runtime: the CPU list stands
        pass
    return impl


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("text_config") or raw  # llava nests it; many others keep text fields at the top


def text_components(raw: dict[str, Any]) -> list[Component]:
    tc = _text_config(raw)
    out = []
    model_type = tc.get("model_type", "?")
    out.append(Component("decoder", f"{model_type} decoder",
                         "pipeline.models.decoder" if model_type in TEXT_MODEL_TYPES else MISSING))
    heads = tc.get("num_attention_heads")
    kv_heads = tc.get("num_key_value_heads") or heads
    if tc.get("kv_lora_rank") or tc.get("q_lora_rank"):
        out.append(Component("attention", "MLA (multi-head latent attention: low-rank compressed KV)", MISSING))
    else:
        kind = "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else "GQA")
        window = tc.get("sliding_window")
        use_window = window is not None and (model_type != "qwen2" or tc.get("use_sliding_window", False))
        types = sorted(set(tc.get("layer_types") or []))
        detail = f"{kind} ({heads} query / {kv_heads} KV heads)"
        if use_window:
            detail += f", sliding window {window}"
        if types:
            detail += f", per-layer types {'/'.join(types)}"
        known_types = set(types) <= {"full_attention", "sliding_attention"}
        out.append(Component("attention", detail, _attention_impl() if known_types else MISSING))
    rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    ok_rope = rope_type in SUPPORTED_ROPE_TYPES and rope.get("partial_rotary_factor", 1.0) == 1.0 \
        and "mrope_section" not in rope
    rope_desc = f"RoPE {rope_type}" + (" with M-RoPE sections" if "mrope_section" in rope else "") + \
        f", theta {rope.get('rope_theta', tc.get('rope_theta', 10000.0))}"
    out.append(Component("rope", rope_desc, "kernels.rope" if ok_rope else MISSING))
    if "layer_norm_eps" in tc or "norm_epsilon" in tc:
        out.append(Component("norm", f"LayerNorm, eps {tc.get('layer_norm_eps', tc.get('norm_epsilon'))}", MISSING))
    else:
        out.append(Component("norm", f"RMSNorm, eps {tc.get('rms_norm_eps', 1e-6)}", "kernels.norm (rms_norm)"))
    act = tc.get("hidden_act", "silu")
    out.append(Component("activation", f"{act} (gated MLP)", "kernels / torch" if act == "silu" else MISSING))
    experts = tc.get("num_local_experts") or tc.get("n_routed_experts") or tc.get("num_experts")
    if experts:
        top_k = tc.get("num_experts_per_tok")
        extra = []
        if tc.get("n_shared_experts"):
            extra.append(f"{tc['n_shared_experts']} shared experts")
        if tc.get("topk_method") or tc.get("n_group"):
            extra.append(f"group-limited routing ({tc.get('topk_method', 'grouped')})")
        desc = f"MoE: top-{top_k} of {experts} experts, softmax then renormalise" + (f"; {', '.join(extra)}" if extra else "")
        ok = model_type == "mixtral" and not extra
        out.append(Component("mlp", desc, "kernels.moe (moe_route, moe_experts)" if ok else MISSING))
    else:
        out.append(Component("mlp", "dense SwiGLU MLP", "pipeline.models.mlp (fused gate/up)"))
    tied = bool(tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))
    out.append(Component("lm_head", "tied to the embeddings" if tied else "its own matrix", "pipeline.models.decoder"))
    return out


def vision_components(raw: dict[str, Any]) -> list[Component]:
    vc = raw.get("vision_config")
    if not vc:
        return []
    vtype = vc.get("model_type", "clip_vision_model")
    layer = raw.get("vision_feature_layer", -2)
    strategy = raw.get("vision_feature_select_strategy", "default")
    out = [Component("vision_tower", f"{vtype}, {vc.get('num_hidden_layers', '?')} layers, "
                     f"{vc.get('image_size', '?')} px / patch {vc.get('patch_size', '?')}",
                     "pipeline.models.vision (CLIP ViT)" if vtype in VISION_TYPES else MISSING),
           Component("vision_features", f"feature layer {layer}, select '{strategy}'",
                     "pipeline.models.image_encoder" if strategy in SELECT_STRATEGIES else MISSING)]
    act = raw.get("projector_hidden_act", "gelu")
    is_llava = raw.get("model_type") in TOP_LEVEL_TYPES
    out.append(Component("projector", f"2-layer MLP, {act}" if is_llava else f"{raw.get('model_type')} merger/projector",
                         "pipeline.models.projector" if is_llava and act in ACTIVATIONS else MISSING))
    return out


def dtype_component(raw: dict[str, Any]) -> Component:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or _text_config(raw).get("dtype") or "float32"
    ok = dtype in ("float32", "bfloat16", "float16")
    return Component("dtype", f"weights stored as {dtype}",
                     "loaded as float32 or bfloat16 (--dtype)" if ok else MISSING)


def required_tensors(raw: dict[str, Any]) -> dict[str, list[str]]:
    """Component -> regexes of the canonical tensor names it needs (``weights.canonical_name``)."""
    tc = _text_config(raw)
    layer = r"layers\.\d+\."
    text = [r"embed_tokens\.weight", r"norm\.weight", layer + r"input_layernorm\.weight",
            layer + r"post_attention_layernorm\.weight"] + [layer + rf"self_attn\.{p}_proj\.weight" for p in "qkvo"]
    if tc.get("num_local_experts"):
        text += [layer + r"mlp\.gate\.weight", layer + r"mlp\.experts\."]
    else:
        text += [layer + rf"mlp\.{p}_proj\.weight" for p in ("gate", "up", "down")]
    if not tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)):
        text.append(r"lm_head\.weight")
    vision = [r"embeddings\.patch_embedding\.weight", r"embeddings\.position_embedding\.weight", r"pre_layrnorm\.weight",
              r"encoder\.layers\.\d+\.self_attn\.q_proj\.weight", r"encoder\.layers\.\d+\.mlp\.fc1\.weight"]
    return {"text": text, "vision": vision if raw.get("vision_config") else [],
            "projector": [r"linear_1\.weight", r"linear_2\.weight"] if raw.get("vision_config") else []}


def check_weights(model_dir: Path, raw: dict[str, Any]) -> dict[str, Any] | None:
    """Unclaimed tensors and missing ones, from the index (or the shard headers); None without weights."""
    index = model_dir / "model.safetensors.index.json"
    names: list[str] = []
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        from safetensors import safe_open

        for shard in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                names.extend(f.keys())
    if not names:
        return None
    by_part: dict[str, set[str]] = {"text": set(), "vision": set(), "projector": set()}
    unclaimed = []
    for name in names:
        mapped = canonical_name(name)
        if mapped is None:
            unclaimed.append(name)
        else:
            by_part[mapped[0]].add(mapped[1])
    missing = {part: [p for p in patterns if not any(re.match(p, n) for n in by_part[part])]
               for part, patterns in required_tensors(raw).items()}
    return {"tensors": len(names), "unclaimed": sorted(unclaimed), "missing": {k: v for k, v in missing.items() if v}}


def inventory(model_dir: Path) -> dict[str, Any]:
    raw = read_config_json(model_dir)
    top = raw.get("model_type", "?")
    components = [Component("architecture", f"{top}", "pipeline (LLaVA family)" if top in TOP_LEVEL_TYPES else MISSING)]
    components += text_components(raw) + vision_components(raw) + [dtype_component(raw)]
    weights = check_weights(model_dir, raw)
    return {"model_type": top, "components": [c.__dict__ for c in components], "weights": weights}


def run(args: argparse.Namespace) -> int:
    report = inventory(args.model)
    rows = report["components"]
    width = max(len(r["need"]) for r in rows)
    print(f"# strata ops: what {args.model.name} needs, and what implements it on this machine")
    print(f"{'component':<16} {'needs':<{width}}  implemented by")
    for r in rows:
        print(f"{r['name']:<16} {r['need']:<{width}}  {r['impl'] or 'MISSING'}")
    missing = [r["name"] for r in rows if r["impl"] is None]
    weights = report["weights"]
    if weights is None:
        print("# weights: none in the directory (config checked only)")
    else:
        print(f"# weights: {weights['tensors']} tensors; {len(weights['unclaimed'])} claimed by no component"
              + (f" (e.g. {', '.join(weights['unclaimed'][:3])})" if weights["unclaimed"] else ""))
        for part, patterns in weights["missing"].items():
            print(f"# weights: the {part} component lacks tensors matching {', '.join(patterns)}")
            missing.append(f"{part} weights")
        if weights["unclaimed"]:
            missing.append("unclaimed weights")
    if args.json:
        args.json.write_text(json.dumps({**report, "missing": missing}, indent=2))
    if missing:
        print(f"MISSING: {', '.join(missing)}")
        return 1
    print("everything covered")
    return 0
