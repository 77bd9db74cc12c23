"""`strata align --model DIR`: Strata's activations against a reference, layer by layer.

The same prompt (and image) goes through Strata's engine, as a chunked prefill over the paged KV
(so paging and chunking are part of what is checked), and through a reference: transformers on
this machine in the same dtype, or activations captured earlier with ``--save-reference`` (on another platform, say)
and given back with ``--reference``. Points compared, in the order the data flows: every vision
layer Strata runs, the projector output, every decoder layer's hidden state, the final norm and
the logits. For each: max abs error, max relative error (to the reference's largest magnitude),
cosine similarity and, for logits, top-1 agreement over positions. The first point past its
dtype's threshold is named; the exit status is 0 on pass, 1 on fail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# Per dtype, against transformers in the same dtype (the numerics contract): a point fails past its
# max relative error (to the reference's largest magnitude) or below its cosine; logits also need
# the top-1 agreement. float32 is the exact contract (1e-4). For bf16 the contract's cosine 0.999
# holds; its 1e-2 relative error is a GPU figure: CPU bf16 kernels accumulate differently and
# measure about 2e-2 at the logits of the tiny models, so CPU runs allow 5e-2.
THRESHOLDS = {
    "float32": {"rel": 1e-4, "cos": 0.99999, "top1": 1.0},
    "bfloat16": {"rel": 5e-2, "cos": 0.999, "top1": 0.9},
    "float16": {"rel": 2e-2, "cos": 0.999, "top1": 0.9},
}
DEFAULT_PROMPT = "Describe the picture, then tell me a story about the sea and the stars."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--prompt", default=None, help=f"user prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--image", type=Path, help="an image to include (default: the deterministic demo image)")
    p.add_argument("--no-image", action="store_true", help="text only")
    p.add_argument("--dtype", choices=tuple(THRESHOLDS), default="float32", help="Strata's compute dtype")
    p.add_argument("--backend", default="auto", help="Strata's attention backend (auto, cpu, torch, triton)")
    p.add_argument("--chunk", type=int, default=16, help="prefill chunk in tokens (small: many chunks)")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference", type=Path, help="compare with activations saved by --save-reference")
    ref.add_argument("--save-reference", type=Path, help="run transformers and save its activations here, then exit")
    p.add_argument("--json", type=Path, help="also write the per-point table here")


@dataclass
class AlignInput:
    prompt: str
    image: bytes | None


# ------------------------------------------------------------------ capture
class Recorder:
    """Activations by point name; several calls to one point (prefill chunks) are concatenated."""

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.parts.setdefault(name, []).append(value.detach().float().cpu())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat(chunks, dim=0) for name, chunks in self.parts.items()}


def _wrap(obj: Any, attr: str, on_output: Callable[[Any], None]) -> Callable[[], None]:
    """Replace ``obj.attr`` (a bound method) with one that records its output; returns the undo.
    Strata's step calls ``layer.forward`` directly, so module hooks would not fire there."""
    original = getattr(obj, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        on_output(out)
        return out

    setattr(obj, attr, wrapped)
    return lambda: delattr(obj, attr) if attr in vars(obj) else None


def strata_activations(model_dir: Path, data: AlignInput, dtype: str, backend: str, chunk: int) -> tuple[dict, list[int]]:
    """Run Strata's engine on the input as a chunked prefill and record every point."""
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.sampling_params import SamplingParams
    from strata.stages.factory import build_engine

    engine = build_engine(model_dir, EngineConfig(dtype=dtype, attention_backend=backend, prefill_chunk_tokens=chunk,
                                                  enable_prefix_caching=False))
    rec = Recorder()
    lm = engine.core.runner.model
    undo = [_wrap(layer, "forward", lambda out, i=i: rec.add(f"decoder.{i}", _rows(out))) for i, layer in enumerate(lm.layers)]
    undo.append(_wrap(lm, "forward", lambda out: rec.add("final_norm", out)))
    handles = []
    encoder = getattr(engine.encoder, "model", None)
    if encoder is not None:
        tower = encoder.vision_tower
        layers = tower.layers if hasattr(tower, "layers") else tower.blocks if hasattr(tower, "blocks") else tower.encoder.layers
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(lambda _m, _i, out, i=i: rec.add(f"vision.{i}", _rows(out))))
        handles.append(encoder.projector.register_forward_hook(lambda _m, _i, out: rec.add("projector", _rows(out))))
    try:
        images = [data.image] if data.image is not None else []
        request = engine.prepare("align", SamplingParams(max_tokens=1, temperature=0.0), images, prompt=data.prompt)
        engine.add(request)
        with torch.inference_mode():
            while engine.has_unfinished():
                engine.step()
    finally:
        for u in undo:
            u()
        for h in handles:
            h.remove()
    acts = rec.tensors()
    with torch.inference_mode():
        acts["logits"] = lm.logits(acts["final_norm"].to(lm.compute_dtype)).float()
    return acts, list(request.prompt_token_ids)


def _rows(out: Any) -> torch.Tensor:
    """A point's activations as [tokens, features]: drops a batch of one ([1, T, D], CLIP and decoders)
    or a singleton middle axis ([N, 1, D], Kimi's projector); packed [N, D] (MoonViT) stays."""
    t = out[0] if isinstance(out, tuple) else out
    if t.dim() == 3 and t.shape[0] == 1:
        return t[0]
    if t.dim() == 3 and t.shape[1] == 1:
        return t[:, 0]
    return t


def _find(model: torch.nn.Module, suffixes: tuple[str, ...]) -> torch.nn.Module | None:
    for name, module in model.named_modules():
        if name.endswith(suffixes):
            return module
    return None


def reference_activations(model_dir: Path, data: AlignInput, num_vision_layers: int,
                          dtype: str = "float32", gguf: Path | None = None) -> tuple[dict, list[int]]:
    """transformers on CPU, in ``dtype``, with forward hooks at the same points (a checkpoint read from a GGUF:
    transformers reads the ``gguf`` file itself, dequantizing it its own way)."""
    import io

    from PIL import Image
    import transformers
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    from strata.pipeline.frontend.tokenizer import PromptTokenizer
    from strata.pipeline.models.model_config import load_model_config

    cfg = load_model_config(model_dir)
    text = PromptTokenizer(model_dir, cfg).render_user_prompt(data.prompt, int(data.image is not None))
    if cfg.takes_images:
        model_class = getattr(transformers, cfg.arch.name)  # the registry's class names are transformers'
        hf = model_class.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        images = [Image.open(io.BytesIO(data.image)).convert("RGB")] if data.image is not None else None
        inputs = AutoProcessor.from_pretrained(model_dir)(text=text, images=images, return_tensors="pt")
    else:
        if data.image is not None:
            raise ValueError(f"{cfg.arch.name} is a text-only model: run align with --no-image")
        if cfg.quant is not None and cfg.quant.method == "gguf" and gguf is None:
            raise ValueError("transformers reads GGUF files, not Strata's copy of one: pass the .gguf file as --model")
        source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name} if gguf else {
            "pretrained_model_name_or_path": model_dir}
        hf = AutoModelForCausalLM.from_pretrained(**source, dtype=getattr(torch, dtype)).eval()
        inputs = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt")
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(getattr(torch, dtype))
    rec = Recorder()
    handles = []
    decoder_layers = _find(hf, ("language_model.layers", "language_model.model.layers", "model.layers"))
    vision_layers = _find(hf, ("vision_tower.encoder.layers", "vision_tower.vision_model.encoder.layers",
                               "vision_tower.layers", "visual.blocks"))
    norm = _find(hf, ("language_model.norm", "language_model.model.norm", "model.norm"))
    projector = _find(hf, ("multi_modal_projector", "mm_projector", "visual.merger"))
    if decoder_layers is None or norm is None:
        raise ValueError("the transformers model has no decoder layers where LLaVA and causal LMs keep them")
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731  (layers return a tuple in older versions)
    for i, layer in enumerate(decoder_layers):
        handles.append(layer.register_forward_hook(lambda _m, _i, out, i=i: rec.add(f"decoder.{i}", first(out)[0])))
    handles.append(norm.register_forward_hook(lambda _m, _i, out: rec.add("final_norm", first(out)[0])))
    if vision_layers is not None:
        for i, layer in enumerate(list(vision_layers)[:num_vision_layers]):
            handles.append(layer.register_forward_hook(lambda _m, _i, out, i=i: rec.add(f"vision.{i}", _rows(out))))
    if projector is not None:
        handles.append(projector.register_forward_hook(lambda _m, _i, out: rec.add("projector", _rows(out))))
    try:
        with torch.inference_mode():
            logits = hf(**inputs).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    acts = rec.tensors()
    acts["logits"] = logits
    return acts, inputs["input_ids"][0].tolist()


# ------------------------------------------------------------------ compare
def _order(name: str) -> tuple[int, int]:
    group = {"vision": 0, "projector": 1, "decoder": 2, "final_norm": 3, "logits": 4}[name.split(".")[0]]
    return group, int(name.split(".")[1]) if "." in name else 0


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], dtype: str) -> list[dict[str, Any]]:
    limits = THRESHOLDS[dtype]
    rows = []
    for name in sorted(set(ours) & set(ref), key=_order):
        a, b = ours[name].reshape(ref[name].shape) if ours[name].numel() == ref[name].numel() else ours[name], ref[name]
        if a.shape != b.shape:
            rows.append({"point": name, "error": f"shape {tuple(a.shape)} != reference {tuple(b.shape)}", "pass": False})
            continue
        diff = (a - b).abs()
        row = {"point": name, "max_abs": float(diff.max()), "max_rel": float(diff.max() / b.abs().max().clamp_min(1e-30)),
               "cosine": float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))}
        ok = row["max_rel"] <= limits["rel"] and row["cosine"] >= limits["cos"]
        if name == "logits":
            row["top1"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
            ok = ok and row["top1"] >= limits["top1"]
        row["pass"] = ok
        rows.append(row)
    return rows


# ------------------------------------------------------------------ reference files
def save_reference(path: Path, acts: dict[str, torch.Tensor], token_ids: list[int], data: AlignInput,
                   model_dir: Path, dtype: str, device: str = "cpu") -> None:
    from safetensors.torch import save_file

    from strata.pipeline.models.model_identity import weights_content_digest

    tensors = {f"act.{k}": v.contiguous() for k, v in acts.items()}
    tensors["input.token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
    if data.image is not None:
        tensors["input.image"] = torch.frombuffer(bytearray(data.image), dtype=torch.uint8)
    meta = {"prompt": data.prompt, "reference": f"transformers {dtype} {device}", "dtype": dtype,
            "weights": weights_content_digest(model_dir),
            "config_sha256": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()}
    save_file(tensors, str(path), metadata={"strata_align": json.dumps(meta)})


def load_reference(path: Path) -> tuple[dict[str, torch.Tensor], list[int], AlignInput, dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw_meta = (f.metadata() or {}).get("strata_align")
        if raw_meta is None:
            raise ValueError(f"{path} is not a reference saved by `strata align --save-reference`")
        meta = json.loads(raw_meta)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    image = bytes(tensors["input.image"].numpy().tobytes()) if "input.image" in tensors else None
    acts = {k[len("act."):]: v for k, v in tensors.items() if k.startswith("act.")}
    return acts, tensors["input.token_ids"].tolist(), AlignInput(meta["prompt"], image), meta


# ------------------------------------------------------------------ command
def _input(args: argparse.Namespace, takes_images: bool = True) -> AlignInput:
    image = None
    if args.image is not None and not takes_images:
        raise ValueError("this model takes no images: drop --image")
    if not args.no_image and takes_images:
        if args.image is not None:
            image = args.image.read_bytes()
        else:
            import tempfile

            from strata.checkpoints.tiny_model import make_demo_image

            with tempfile.TemporaryDirectory() as tmp:
                image = make_demo_image(Path(tmp) / "demo.png", 64).read_bytes()
    return AlignInput(args.prompt or DEFAULT_PROMPT, image)


def run(args: argparse.Namespace) -> int:
    from strata.pipeline.models.model_config import load_model_config

    gguf = args.model if args.model.suffix == ".gguf" else None
    if gguf is not None:
        from strata.pipeline.models.model_source import resolve_model_dir

        args.model = resolve_model_dir(gguf)
    cfg = load_model_config(args.model)
    if args.reference is not None:
        ref, ref_ids, data, meta = load_reference(args.reference)
        source = f"saved reference {args.reference.name} ({meta['reference']})"
        from strata.pipeline.models.model_identity import weights_content_digest

        if meta.get("dtype", args.dtype) != args.dtype:
            raise ValueError(f"{args.reference} holds {meta['dtype']} activations; run with --dtype {meta['dtype']}")
        if meta.get("weights") != weights_content_digest(args.model):
            print("# note: the reference was captured from different weights than these (a copy or a new platform's load?)")
    else:
        data = _input(args, cfg.takes_images)
        ref, ref_ids = reference_activations(args.model, data, cfg.vision_layers_needed, args.dtype, gguf)
        source = f"transformers ({args.dtype}, this machine)"
        if args.save_reference is not None:
            save_reference(args.save_reference, ref, ref_ids, data, args.model, args.dtype)
            print(f"saved {len(ref)} reference points for {len(ref_ids)} tokens to {args.save_reference}")
            return 0
    ours, our_ids = strata_activations(args.model, data, args.dtype, args.backend, args.chunk)
    print(f"# strata align: {args.model.name}, Strata {args.dtype} / backend {args.backend}, prefill in chunks of "
          f"{args.chunk} tokens, vs {source}; {len(ref_ids)} prompt tokens{', 1 image' if data.image else ''}")
    if our_ids != ref_ids:
        print(f"FAIL: the prompt tokens differ from the reference's ({len(our_ids)} vs {len(ref_ids)} tokens)")
        return 1
    rows = compare(ours, ref, args.dtype)
    print(f"{'point':<12} {'max abs':>10} {'max rel':>10} {'cosine':>10} {'top-1':>7}  result")
    for r in rows:
        if "error" in r:
            print(f"{r['point']:<12} {r['error']}  FAIL")
            continue
        top1 = f"{r['top1']:.3f}" if "top1" in r else ""
        print(f"{r['point']:<12} {r['max_abs']:10.2e} {r['max_rel']:10.2e} {r['cosine']:10.6f} {top1:>7}  "
              f"{'ok' if r['pass'] else 'FAIL'}")
    first_bad = next((r["point"] for r in rows if not r["pass"]), None)
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "backend": args.backend, "reference": source,
                                         "thresholds": THRESHOLDS[args.dtype], "points": rows,
                                         "first_failure": first_bad}, indent=2))
    if first_bad is not None:
        print(f"FAIL: first divergence at {first_bad} (thresholds for {args.dtype}: {THRESHOLDS[args.dtype]})")
        return 1
    print(f"PASS: all {len(rows)} points within the {args.dtype} thresholds")
    return 0
