"""Helpers shared by test modules (not fixtures): engines, sampling shortcuts, subprocesses, references.

Test modules import from here and never from each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from strata.bringup.teacher_forced import sequence_logits  # noqa: F401  (tests import it from here)
from strata.kernels import AttentionMetadata, write_kv
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.scheduler import ScheduledChunk
from strata.pipeline.core.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
BS = 16  # block size the kernel tests use
MODEL_NAME = "strata-test"  # the model id the shared test server serves
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SMOLLM2_KEY = "sk-strata-test-9f3c"  # the API key of the shared SmolLM2 server (conftest's keyed_server)
SMOLLM2_ALIAS = "HuggingFaceTB/SmolLM2-135M-Instruct"  # another id it answers to (vLLM's --served-model-name a b)
# The attention backend engines built by `build` use unless a test names one; the
# `attention_backend` fixture runs a whole module once per backend by setting it.
DEFAULT_BACKEND = {"name": "auto"}


def build(model_dir: Path, **config: Any):
    from strata.stages.factory import build_engine

    config.setdefault("attention_backend", DEFAULT_BACKEND["name"])
    return build_engine(model_dir, EngineConfig(**config))


def transformers_greedy(model_dir: Path, prompt: str, n: int, **load: Any) -> list[int]:
    """transformers' greedy continuation of the chat-rendered prompt in fp32 (EOS ignored, as the engine's
    ``ignore_eos`` requests are); ``load`` goes to ``from_pretrained`` (a quantization config, say)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).eval()
    ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=True))["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             min_new_tokens=n)
    return out[0, len(ids):].tolist()


def assert_tp2_equals_tp1(model_dir: Path, requests: list[dict[str, Any]]) -> None:
    """Two tensor-parallel ranks give the tokens one process gives."""
    expected = [o.output_token_ids for o in build(model_dir).generate(requests)]
    two = build(model_dir, tp=2)
    try:
        assert [o.output_token_ids for o in two.generate(requests)] == expected
    finally:
        two.close()


def build_stages(model_dir: Path, **config: Any):
    """A Prefiller and a Decoder over two block pools in this process, as two stage replicas would be."""
    from strata.stages.decoder import Decoder
    from strata.stages.factory import LanguageStage
    from strata.stages.prefiller import Prefiller

    config.setdefault("attention_backend", DEFAULT_BACKEND["name"])
    return (Prefiller(LanguageStage(model_dir, EngineConfig(**config)).core()),
            Decoder(LanguageStage(model_dir, EngineConfig(**config)).core()))


def wait_until(condition: Any, timeout: float, what: str, retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``condition`` until it returns something truthy (returned); ``retry_on`` errors count as not
    yet (a stage being replaced may not answer). AssertionError naming ``what`` after ``timeout`` s."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := condition():
                return value
        except retry_on:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_python(*args: str, timeout: float = 300, env: dict[str, str] | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """``python ARGS`` in a directory outside the repository, so only the installed ``strata`` package
    is importable (never the bare room folders)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=tempfile.gettempdir(), **kw)


def kernel_check(script: str, device: str, interpret: bool) -> list[dict]:
    """A kernel's check ``script`` (``python -c``, the device as its argument, its JSON results on the last line)
    in a child process: Triton's interpreter (``TRITON_INTERPRET=1``) must be set before Triton is imported."""
    import json

    res = run_python("-c", script, device, env={"TRITON_INTERPRET": "1"} if interpret else {}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_strata(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The `strata` command line in a child process (``python -m strata``)."""
    return run_python("-m", "strata", *args, timeout=timeout, env=env)


def paged_batch(seq_lens: list[int], query_lens: list[int], hkv: int, d: int, num_blocks: int, gen: torch.Generator):
    """Random K/V written into a shuffled paged cache; returns cache, per-seq dense K/V and metadata."""
    k_cache = torch.zeros(num_blocks, BS, hkv, d)
    v_cache = torch.zeros(num_blocks, BS, hkv, d)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense, slots = [], [], []
    for s_len, q_len in zip(seq_lens, query_lens):
        blocks = [free.pop() for _ in range(-(-s_len // BS))]
        k = torch.randn(s_len, hkv, d, generator=gen)
        v = torch.randn(s_len, hkv, d, generator=gen)
        all_slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(s_len)])
        write_kv(k_cache, v_cache, k, v, all_slots)
        tables.append(blocks)
        dense.append((k, v))
        slots.extend(all_slots[s_len - q_len :].tolist())
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, BS)
    return k_cache, v_cache, dense, meta


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    window: int | None) -> torch.Tensor:
    """SDPA over one sequence with an explicit causal (+window) mask. q [Tq,Hq,D], k/v [S,Hkv,D]."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    k_pos = torch.arange(k.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def prefill_logits(engine: Any, prompt: str, images: list[bytes]) -> torch.Tensor:
    """Last-position logits of one prompt computed by our model runner in a single chunk."""
    request = engine.prepare("probe", greedy(1), list(images), prompt=prompt)
    kv = engine.kv
    seq = Sequence.from_request(request, kv.layout.block_size)
    assert kv.reserve(seq.block_table, seq.num_tokens)
    try:
        return engine.core.runner.execute([ScheduledChunk(seq, 0, seq.num_tokens)])[0]
    finally:
        kv.free(seq.block_table)


def scrape_metrics(metrics_url: str) -> dict[str, float]:
    """Sum of every sample per metric name + label set, e.g.
    'ray_strata_requests_total{endpoint="chat",status="200"}', from Ray's Prometheus endpoint."""
    import re

    import httpx

    text = httpx.get(metrics_url, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("ray_strata_"):
            continue
        name, value = line.rsplit(" ", 1)
        # drop labels that vary per process (replica ids, pids, ...): keep the ones we set
        metric = re.sub(r",?(Component|NodeAddress|SessionName|Version|WorkerId|JobId|application|deployment|replica)=\"[^\"]*\"", "", name)
        metric = metric.replace("{,", "{")
        out[metric] = out.get(metric, 0.0) + float(value)
    return out


def metric_value(samples: dict[str, float], prefix: str, **labels: str) -> float:
    """Total of the samples of metric ``prefix`` whose labels include ``labels``."""
    total = 0.0
    for key, v in samples.items():
        if key.startswith(prefix + "{") or key == prefix:
            if all(f'{k}="{val}"' in key for k, val in labels.items()):
                total += v
    return total


def write_transformers5_checkpoint(src: Path, dst: Path) -> None:
    """Re-save a checkpoint with transformers-5 runtime names (model.language_model…, fused experts)."""
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers import LlavaForConditionalGeneration

    shutil.copytree(src, dst)
    for p in dst.glob("*.safetensors"):
        p.unlink()
    (dst / "model.safetensors.index.json").unlink()
    (dst / "SHA256SUMS").unlink()
    hf = LlavaForConditionalGeneration.from_pretrained(src)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(dst / name))
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def patterned_image(size: tuple[int, int], seed: int = 0) -> bytes:
    """A PNG of ``size`` (width, height): a gradient with seeded noise, so each seed and size is its own image."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3)
    pixels = (base + rng.integers(0, 60, (h, w, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def tokens_through_handoff(model_dir: Path, config: EngineConfig, engine: Any, images: list[bytes], prompt: str,
                           params: SamplingParams, check: Any = None, decode_config: EngineConfig | None = None
                           ) -> list[int]:
    """One request prepared by ``engine``, prefilled by a prefill service and finished by a decode service
    (both in this process, over ``config``; the decode service over ``decode_config`` if given), its hand-off
    passed as bytes; ``check(request, handoff)`` may inspect what crossed. Returns every generated token."""
    import asyncio

    from strata.pipeline.contract.handoff import Handoff
    from strata.stages.factory import build_decode_service, build_prefill_service

    prefill, decode = build_prefill_service(model_dir, config), build_decode_service(model_dir, decode_config or config)

    async def complete() -> list[int]:
        request = engine.prepare("handoff", params, images, prompt=prompt)
        handoff = Handoff.from_msgpack((await prefill.prefill(request)).to_msgpack())
        if check is not None:
            check(request, handoff)
        tokens = [handoff.first.token_id]
        async for batch in decode.generate(handoff):
            tokens += [e.token_id for e in batch]
        return tokens

    try:
        return asyncio.run(complete())
    finally:
        prefill.close()
        decode.close()


def concurrent_handoffs(model_dir: Path, host_dir: Path, prompts: list[str], params: SamplingParams
                        ) -> tuple[list[list[int]], int]:
    """Text prompts prefilled by a prefill service and decoded by a decode service at once (both in this process,
    over a host tier under ``host_dir``), each hand-off passed as bytes: every request's tokens, and how many
    handed-off tokens the decode side had to recompute."""
    import asyncio

    from strata.pipeline.contract.handoff import Handoff
    from strata.stages.factory import build_decode_service, build_prefill_service

    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(host_dir))
    prefill, decode = build_prefill_service(model_dir, config), build_decode_service(model_dir, config)
    engine = build(model_dir)

    async def complete(i: int, prompt: str) -> list[int]:
        request = engine.intake.make_request(f"h{i}", params, prompt=prompt)[0]
        handoff = Handoff.from_msgpack((await prefill.prefill(request)).to_msgpack())
        tokens = [handoff.first.token_id]
        if not handoff.first.finished:
            async for batch in decode.generate(handoff):
                tokens += [e.token_id for e in batch]
        return tokens

    async def run_all() -> list[list[int]]:
        return await asyncio.gather(*(complete(i, p) for i, p in enumerate(prompts)))

    try:
        tokens = asyncio.run(run_all())
        return tokens, asyncio.run(decode.stats())["handoff_tokens"]["recomputed"]
    finally:
        prefill.close()
        decode.close()


def spilling_engine(model_dir: Path, host_dir: Path):
    """An engine whose device pool (10 blocks) is smaller than one long prompt: the prompt's older blocks
    spill to a host tier under ``host_dir`` and stream back to attention."""
    return build(model_dir, num_kv_blocks=10, prefill_chunk_tokens=32, host_kv_blocks=200, host_kv_dir=str(host_dir))


def preempting_engine(model_dir: Path):
    """An engine whose pool (14 blocks) cannot hold four growing requests at once: some are preempted and
    computed again (prefix caching off, so the recompute is a real one)."""
    return build(model_dir, num_kv_blocks=14, max_num_batched_tokens=64, prefill_chunk_tokens=32,
                 enable_prefix_caching=False)


def assert_preemption_recomputes_the_same(model_dir: Path, prompts: list[str]) -> None:
    """Four requests growing in a pool too small for all of them (``preempting_engine``): some are preempted
    and computed again, each equals its answer alone, and the pool's invariants hold after."""
    reqs = [{"prompt": p, "params": greedy(24, ignore_eos=True)} for p in [*prompts, prompts[1] + " Again."]]
    alone = [o.output_token_ids for o in build(model_dir).generate(reqs)]
    engine = preempting_engine(model_dir)
    assert [o.output_token_ids for o in engine.generate(reqs)] == alone
    assert engine.scheduler.num_preemptions > 0
    engine.kv.pool.check_invariants()


def image_chat(images: list[bytes], prompt: str) -> list[dict[str, Any]]:
    """One user message of PNG images as base64 data URLs, then the prompt: what the openai client sends."""
    import base64

    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
             for b in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": prompt}]}]


def transformers_reference(model_dir: Path, prompt: str, n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (``n``, EOS ignored) and its last prompt position's logits for a chat of one
    user message, in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=True))["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             min_new_tokens=n)
    return out[0, len(ids):].tolist(), logits


def assert_generates_as_transformers(model_dir: Path, reference: Path, prompts: list[str], n: int = 10) -> None:
    """A quantized checkpoint's greedy tokens equal transformers' on ``reference`` (its exact dequantization), and
    its prefill logits match within 1e-4 relative."""
    engine = build(model_dir, prefill_chunk_tokens=8)
    outs = engine.generate([{"prompt": p, "params": greedy(n, ignore_eos=True)} for p in prompts])
    for prompt, out in zip(prompts, outs):
        tokens, logits = transformers_reference(reference, prompt, n)
        assert out.error is None and out.output_token_ids == tokens, prompt
        ours = prefill_logits(engine, prompt, [])
        torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())


def strata_in_process(capsys: Any, *args: str) -> subprocess.CompletedProcess:
    """``main(args)`` (the ``strata`` command line, in this process) with its exit code and what it printed
    (``capsys``: pytest's capture fixture), in the shape of a finished child process."""
    from strata.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["strata", *args], code, out.out, out.err)
