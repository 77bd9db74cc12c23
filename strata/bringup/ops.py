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

from strata.bringup.weight_format_report import format_lines
from strata.kernels.backends import vendor_kernels_importable
from strata.kernels.cpu_kernels import library_path
from strata.kernels.rope import SUPPORTED_ROPE_TYPES
from strata.pipeline.models.activations import ACTIVATIONS
from strata.pipeline.models.architectures import (
    TEXT_FAMILIES,
    ModelArchitecture,
    TextFamily,
    UnknownArchitecture,
    resolve_architecture,
)
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.fallback_config import FALLBACK_WHERE, fallback_architecture, fallback_text_config
from strata.pipeline.models.model_config import read_config_json
from strata.pipeline.models.model_loader import plan_model_load
from strata.pipeline.models.router_kinds import Routing
from strata.pipeline.models.text_config import TextConfig, parse_text_config
from strata.pipeline.models.weights import WeightsError, weight_map

MISSING = None
EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")


@dataclass
class Component:
    name: str
    need: str  # what the checkpoint asks for, in words
    impl: str | None  # what implements it here; None: nothing does


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (config.json, *.safetensors)")
    p.add_argument("--json", type=Path, help="also write the inventory here")


def _attention_impl() -> str:
    """What attends here, found without building or running anything: ``strata ops`` reads configs, it
    never compiles a kernel (the CPU library is built, once, when an engine first needs it)."""
    built = library_path().is_file()
    impl = "paged C++ kernel (fast" + ("" if built else "; compiled on first use, ~30 s") + "), torch reference"
    try:
        import torch

        if torch.cuda.is_available():
            vendor = [name for name, ok in vendor_kernels_importable().items() if ok]
            impl += "; CUDA: " + ", ".join(["torch", "triton", *vendor]) + " (self-checked when an engine starts)"
    except Exception:  # no usable CUDA runtime: the CPU list stands
        pass
    return impl


def _architecture(raw: dict[str, Any]) -> ModelArchitecture | None:
    try:
        return resolve_architecture(raw)
    except UnknownArchitecture:
        return None


def _text_config(raw: dict[str, Any], arch: ModelArchitecture | None) -> dict[str, Any]:
    if arch is not None and arch.text_config_key:
        return raw.get(arch.text_config_key) or (raw if arch.flat_text_config else {})
    return raw.get("text_config") or raw  # VLMs nest it; text LLMs keep text fields at the top


def _tied(raw: dict[str, Any], tc: dict[str, Any], arch: ModelArchitecture | None) -> bool:
    """Whether the LM head is the embedding: a composite model's own setting wins (transformers ties by it)."""
    if arch is not None and arch.text_config_key and tc is not raw:
        top = bool(raw.get("tie_word_embeddings", arch.tie_default))
        return top if arch.tie == "top" else top or bool(tc.get("tie_word_embeddings", False))
    return bool(tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))


def _family(tc: dict[str, Any], arch: ModelArchitecture | None) -> TextFamily | None:
    """The decoder family the loader parses ``tc`` with (``model_config``'s rule)."""
    if tc.get("model_type") in TEXT_FAMILIES:
        name = tc["model_type"]
        return TEXT_FAMILIES[dict(arch.family_by_type).get(name, name) if arch is not None else name]
    return TEXT_FAMILIES.get(arch.text_family) if arch is not None and arch.text_family else None


def _parsed(tc: dict[str, Any], family: TextFamily | None) -> tuple[TextConfig | None, str]:
    """The decoder config exactly as the loader parses it, or None and why not (an unknown family, or a
    config the loader refuses: the decoder row says so)."""
    if family is None:
        return None, "no registered family"
    try:
        return parse_text_config(tc, family.model_type), ""
    except (ModelConfigError, KeyError, TypeError, ValueError) as e:
        return None, f"the config does not parse: {e}"


def _attention(tc: dict[str, Any], family: TextFamily | None, parsed: TextConfig | None) -> Component:
    """The attention kind's own line for the parsed config; a config the loader refuses shows what it asks
    for (from its raw keys) and is missing."""
    heads = tc.get("num_attention_heads")
    if tc.get("kv_lora_rank") and (parsed is None or parsed.mla is None):  # a latent the loader does not read
        latent = tc["kv_lora_rank"] + (tc.get("qk_rope_head_dim") or 0)
        return Component("attention", f"MLA ({heads} heads over one {latent}-value latent per token: compressed "
                         "KV + shared RoPE key)", MISSING)
    if parsed is not None and parsed.compressed is not None:
        return Component("attention", parsed.attention.describe(parsed),
                         "pipeline.models.attention_v4 (torch; a decode step's sequences together, prefill a sequence "
                         "at a time) over kernels.compress_kv; the window, the projections and the entries are cache "
                         "groups of their own")
    if parsed is not None and parsed.dsa is not None:
        return Component("attention", parsed.attention.describe(parsed),
                         "pipeline.models.attention_dsa (weight-absorbed, over the chosen latents; a decode step's "
                         "sequences together) with "
                         "kernels.sparse_index (torch; fused C++ on CPU, Triton on CUDA); indexer keys a cache group of their own")
    if parsed is not None and parsed.mla is not None:
        return Component("attention", parsed.attention.describe(parsed),
                         f"pipeline.models.attention_mla (weight-absorbed) over {_attention_impl()}")
    if parsed is not None:
        detail = parsed.attention.describe(parsed)
    else:
        kv_heads = tc.get("num_key_value_heads") or heads
        detail = f"{'MHA' if kv_heads == heads else 'MQA' if kv_heads == 1 else 'GQA'} ({heads} query / {kv_heads} KV heads)"
    types = sorted(set(tc.get("layer_types") or []))
    windows = [w for w in (parsed.layer_windows if parsed is not None else ()) if w is not None]
    if windows:
        where = "" if len(windows) == parsed.num_layers else f" on {len(windows)} of {parsed.num_layers} layers"
        detail += f", sliding window {windows[0]}{where}"
    if types:
        detail += f", per-layer types {'/'.join(types)}"
    known_types = set(types) <= {"full_attention", "sliding_attention"} | (
        {"linear_attention"} if parsed is not None and parsed.linear is not None else set())
    ok = known_types and (parsed is not None or family is None)
    return Component("attention", detail, _attention_impl() if ok else MISSING)


def _rope(tc: dict[str, Any], parsed: TextConfig | None) -> Component:
    """Positions as the loader parses them (an M-RoPE config needs a family that declares M-RoPE)."""
    if parsed is not None and not parsed.rope:
        return Component("rope", "none: attention takes no positions (NoPE); the linear layers carry order",
                         "pipeline.models.attention_mla (no rotation)")
    rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    mrope = "mrope_section" in rope
    params = parsed.rope_parameters if parsed is not None else rope
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "default" if rope_type == "mrope" else rope_type
    partial = float(params.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0)))
    mrope_ok = not mrope or (parsed is not None and parsed.uses_mrope)
    ok = rope_type in SUPPORTED_ROPE_TYPES and 0 < partial <= 1 and mrope_ok
    interleaved = parsed is not None and parsed.mrope_interleaved
    desc = f"RoPE {rope_type}" + (f" with M-RoPE (t/h/w sections {rope['mrope_section']}"
                                  f"{', interleaved' if interleaved else ''})" if mrope else "") + \
        (" (interleaved pairs)" if parsed is not None and parsed.rope_interleave else "") + \
        f", theta {params.get('rope_theta', tc.get('rope_theta', 10000.0))}" + \
        (f", over {partial:g} of each head" if partial != 1 else "")
    return Component("rope", desc, ("kernels.rope + pipeline.models.mrope" if mrope else "kernels.rope") if ok else MISSING)


def _mlp(tc: dict[str, Any], family: TextFamily | None, parsed: TextConfig | None) -> Component:
    """The feed-forward as the loader's parse of the config has it."""
    experts = next((tc[k] for k in EXPERT_KEYS if tc.get(k)), None)
    if not experts:
        return Component("mlp", "dense SwiGLU MLP", "pipeline.models.mlp (fused gate/up)")
    m = parsed.moe if parsed is not None else None
    if m is None:
        how = "a router this family is not registered with" if family is None or family.router is None else \
            "a config the loader does not parse"
        return Component("mlp", f"MoE: top-{tc.get('num_experts_per_tok')} of {experts} experts, {how}", MISSING)
    routing = Routing(m.norm_topk_prob, m.routed_scaling_factor, m.n_group, m.topk_group)
    desc = "MoE: " + m.router.describe(m.experts_per_tok, m.num_experts, routing)
    if m.n_shared_experts:
        desc += f", {m.n_shared_experts} shared" + (" behind a sigmoid gate" if m.shared_gate else "")
    desc += m.expert_kind.describe(m.swiglu_alpha, m.swiglu_limit)
    hashed = sum(parsed.compressed.hash_layers) if parsed.compressed is not None else 0
    if hashed:
        desc += f"; experts fixed per token id (hash) on {hashed} of {parsed.num_layers} layers"
    dense = parsed.num_layers - sum(parsed.moe_layers)
    if dense:
        desc += f"; {dense} of {parsed.num_layers} layers dense"
    return Component("mlp", desc, "pipeline.models.moe (kernels.moe routing + experts)")


def text_components(raw: dict[str, Any], arch: ModelArchitecture | None = None) -> list[Component]:
    tc = _text_config(raw, arch)
    family = _family(tc, arch)
    model_type = tc.get("model_type", "?")
    parsed, why_not = _parsed(tc, family)
    decoder = f"{family.model_type if family else model_type} decoder"
    module = "deepseek_v4" if parsed is not None and parsed.compressed is not None else "decoder"
    out = [Component("decoder", decoder if parsed is not None or family is None else f"{decoder} ({why_not})",
                     f"pipeline.models.{module} (registry)" if parsed is not None else MISSING),
           _attention(tc, family, parsed), _rope(tc, parsed)]
    if parsed is not None and parsed.compressed is not None:
        out += _compressed_rows(tc, parsed)
    if parsed is not None and parsed.linear is not None:
        lin = parsed.linear
        out.append(Component("linear attention", f"{lin.name} on {sum(parsed.linear_layers)} of {parsed.num_layers} "
                             f"layers ({lin.num_k_heads} key / {lin.num_v_heads} value heads of {lin.k_head_dim}/"
                             f"{lin.v_head_dim}, conv {lin.conv_kernel}): a per-sequence state, "
                             f"{lin.state_bytes() * sum(parsed.linear_layers) / 2**20:.2f} MiB in fp32",
                             f"pipeline.models.{'kimi_delta' if lin.kda else 'gated_deltanet'} over kernels.delta_rule "
                             "(torch, C++ decode step) and kvstore.state_pool"))
    if "layer_norm_eps" in tc or "norm_epsilon" in tc:
        out.append(Component("norm", f"LayerNorm, eps {tc.get('layer_norm_eps', tc.get('norm_epsilon'))}", MISSING))
    else:
        scale = " scaling by 1 + w" if parsed is not None and parsed.norm_offset else ""
        out.append(Component("norm", f"RMSNorm{scale}, eps {tc.get('rms_norm_eps', 1e-6)}", "kernels.norm (rms_norm)"))
    act = tc.get("hidden_act", "silu")
    out.append(Component("activation", f"{act} (gated MLP)", "kernels / torch" if act == "silu" else MISSING))
    out.append(_mlp(tc, family, parsed))
    tied = _tied(raw, tc, arch)
    out.append(Component("lm_head", "tied to the embeddings" if tied else "its own matrix", "pipeline.models.decoder"))
    return out


def _compressed_rows(tc: dict[str, Any], parsed: TextConfig) -> list[Component]:
    """DeepSeek-V4's own rows: the residual streams, the compressed layers' RoPE, and its MTP layers (not loaded)."""
    c = parsed.compressed
    assert c is not None
    rows = [Component("residual", f"mHC: {c.hc_mult} streams, mixed by a Sinkhorn-normalised matrix "
                      f"({c.hc_sinkhorn_iters} iterations)", "pipeline.models.hyper_connections"),
            Component("rope_compressed", f"RoPE {c.compress_rope.get('rope_type', 'default')}, theta "
                      f"{c.compress_rope.get('rope_theta')}, the last {c.rope_dim} dims of each head in interleaved "
                      "pairs, on compressed layers and their entries", "kernels.rope + kernels.compress_kv")]
    mtp = int(tc.get("num_nextn_predict_layers") or 0)
    if mtp:
        rows.append(Component("mtp", f"{mtp} multi-token-prediction layer(s) in the checkpoint",
                              "not loaded (ignored): speculation drafts with ngram"))
    return rows


def vision_components(raw: dict[str, Any], arch: ModelArchitecture | None = None) -> list[Component]:
    """The tower kind's own rows; a vision_config on a model no registered architecture claims is missing."""
    vc = raw.get("vision_config")
    if not vc:
        return []
    if arch is not None and not arch.takes_images:
        return [Component("vision_tower", f"{vc.get('model_type', '?')} (config has a vision_config)", MISSING)]
    if arch is None:  # a VLM no registered architecture claims: neither its tower nor its projector
        return [Component("vision_tower", f"{vc.get('model_type', '?')} (no registered architecture)", MISSING),
                Component("projector", f"{raw.get('model_type')} merger/projector", MISSING)]
    return [Component(*row) for row in arch.vision.rows(raw, arch.projector, ACTIVATIONS)]


def dtype_component(raw: dict[str, Any], arch: ModelArchitecture | None = None) -> Component:
    dtype = raw.get("dtype") or raw.get("torch_dtype") or _text_config(raw, arch).get("dtype") or "float32"
    ok = dtype in ("float32", "bfloat16", "float16")
    stored = "unquantized weights" if raw.get("quantization_config") else "weights"
    return Component("dtype", f"{stored} stored as {dtype}",
                     "loaded as float32 or bfloat16 (--dtype)" if ok else MISSING)


def check_weights(model_dir: Path, raw: dict[str, Any]) -> dict[str, Any] | None:
    """The loader's own plan (``plan_model_load``) against the checkpoint: tensors it refuses (no component
    claims them), parameters no tensor fills (by layer pattern), and tensors of layers past
    ``num_hidden_layers`` (multi-token prediction, which serving does not run); None without weights. A
    config the loader cannot build on claims nothing, so every tensor is unclaimed."""
    if not _has_weights(model_dir):
        return None
    try:
        names = list(weight_map(model_dir))
    except WeightsError as exc:
        return {"tensors": 0, "unclaimed": [], "unused": 0, "missing": {}, "formats": [], "unreadable": str(exc)}
    formats, unread = format_lines(raw, names)
    try:
        plan = plan_model_load(model_dir)
    except (ModelConfigError, UnknownArchitecture, WeightsError, ValueError, KeyError, TypeError) as exc:
        return {"tensors": len(names), "unclaimed": sorted(names), "unused": 0, "missing": {}, "formats": formats,
                "unchecked": str(exc)}
    missing = {part: sorted({_LAYER_NUMBER.sub(".*.", n) for n in params}) for part, params in plan.unfilled.items()}
    return {"tensors": len(names), "reads": len(plan.reads), "unclaimed": sorted(set(plan.unclaimed()) | set(unread)),
            "unused": len(plan.past_decoder), "missing": missing, "formats": formats}


_LAYER_NUMBER = re.compile(r"\.\d+\.")


def _has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors.index.json").is_file() or any(model_dir.glob("*.safetensors"))


def fallback_components(raw: dict[str, Any], arch: ModelArchitecture) -> list[Component]:
    """A causal LM on the transformers fallback: which parts run on transformers' modules and which on
    Strata's. What the config alone cannot show (a layer that never calls the attention interface, KV
    shapes, a softcap) the load's probe forward refuses in one line."""
    heads = raw.get("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    kind = "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else "GQA")
    types = sorted(set(raw.get("layer_types") or []))
    paged = set(types) <= {"full_attention", "sliding_attention"} and not raw.get("kv_lora_rank")
    need = f"{kind} ({heads} query / {kv_heads} KV heads) through transformers' attention interface" + (
        f", per-layer types {'/'.join(types)}" if types else "") + (", MLA" if raw.get("kv_lora_rank") else "")
    try:
        text = fallback_text_config(raw)
        layers, why = f"{text.num_layers} {arch.name} decoder layers", ""
    except ModelConfigError as exc:
        layers, why = f"{arch.name} decoder layers", f" ({exc})"
    return [Component("decoder", layers + why, f"transformers fallback: {FALLBACK_WHERE}" if not why else MISSING),
            Component("attention", need, f"Strata's paged attention ({_attention_impl()})" if paged else MISSING),
            Component("layers", "norms, RoPE, MLP / MoE, embeddings and LM head as the model defines them",
                      "transformers' modules (pipeline.models.fallback_model)")]


def inventory(model_dir: Path) -> dict[str, Any]:
    raw = read_config_json(model_dir)
    top = raw.get("model_type", "?")
    arch = _architecture(raw)
    names = raw.get("architectures") or [top]
    shown = ", ".join(map(str, names)) if isinstance(names, list) else str(names)
    fallback = None
    if arch is None:
        try:
            fallback = fallback_architecture(raw)
        except ModelConfigError as exc:  # a composite model transformers has: the fallback refuses it
            shown += f" ({exc})"
    impl = (f"registry: {arch.name}" + (" (text only)" if not arch.takes_images else "")) if arch else (
        f"transformers fallback: {fallback.name}" if fallback else MISSING)
    components = [Component("architecture", shown, impl)]
    if fallback is not None:
        components += fallback_components(raw, fallback) + [dtype_component(raw)]
        weights = None
        if _has_weights(model_dir):
            try:
                weights = {"tensors": len(weight_map(model_dir)), "unclaimed": [], "unused": 0, "missing": {},
                           "fallback": True}
            except WeightsError as exc:
                weights = {"tensors": 0, "unclaimed": [], "unused": 0, "missing": {}, "unreadable": str(exc)}
        components += [Component(*line) for line in format_lines(raw, [])[0]]
        return {"model_type": top, "architecture": fallback.name, "fallback": True,
                "components": [c.__dict__ for c in components], "weights": weights}
    components += text_components(raw, arch) + vision_components(raw, arch) + [dtype_component(raw, arch)]
    weights = check_weights(model_dir, raw)
    if weights is not None:
        components += [Component(*line) for line in weights.pop("formats")]
    else:
        components += [Component(*line) for line in format_lines(raw, [])[0]]
    return {"model_type": top, "architecture": arch.name if arch else None,
            "components": [c.__dict__ for c in components], "weights": weights}


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
        if weights.get("fallback"):
            print(f"# weights: {weights['tensors']} tensors, mapped by transformers' loader: a tensor it lacks, or "
                  "one it does not load, refuses the load")
        else:
            print(f"# weights: {weights['tensors']} tensors; {len(weights['unclaimed'])} claimed by no component"
                  + (f" (e.g. {', '.join(weights['unclaimed'][:3])})" if weights["unclaimed"] else ""))
        if weights["unused"]:
            print(f"# weights: {weights['unused']} tensors of layers past num_hidden_layers (multi-token "
                  "prediction) are not loaded unless --speculative-config '{\"method\": \"mtp\", "
                  "\"num_speculative_tokens\": 1}' drafts with them")
        for part, params in weights["missing"].items():
            print(f"# weights: no tensor fills the {part} part's {', '.join(params)}")
            missing.append(f"{part} weights")
        if weights["unclaimed"]:
            missing.append("unclaimed weights")
        if weights.get("unchecked"):
            print(f"# weights: not planned, the model does not build from this config ({weights['unchecked']})")
        if weights.get("unreadable"):
            print(f"# weights: {weights['unreadable']}")
            missing.append("readable weights")
    if args.json:
        args.json.write_text(json.dumps({**report, "missing": missing}, indent=2))
    if missing:
        print(f"MISSING: {', '.join(missing)}")
        return 1
    print("everything covered")
    return 0
