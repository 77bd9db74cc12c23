"""The engine on a CUDA device: numerics against transformers, bf16, compiled steps, and the tier path
(pinned staging, transfers on a side stream). Skipped without a GPU; `make gpu-check` runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import build, greedy, sequence_logits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPT = "Tell me a story about the sea and the stars."


@pytest.mark.parametrize("arch", ["llava-llama", "llava-mixtral"])
def test_cuda_fp32_greedy_tokens_equal_transformers(arch: str, tiny_models: dict[str, Path]) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(tiny_models[arch]).to("cuda").eval()
    processor = AutoProcessor.from_pretrained(tiny_models[arch])
    engine = build(tiny_models[arch], device="cuda", attention_backend="auto")
    inputs = processor(text=engine.tokenizer.render_user_prompt(PROMPT), return_tensors="pt").to("cuda")
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=16, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert engine.generate([{"prompt": PROMPT, "params": greedy(16)}])[0].output_token_ids == ref


def test_cuda_bf16_agrees_with_transformers_teacher_forced(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = tiny_models["llava-llama"]
    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    processor = AutoProcessor.from_pretrained(path)
    engine = build(path, device="cuda", dtype="bfloat16")
    inputs = processor(text=engine.tokenizer.render_user_prompt(PROMPT), return_tensors="pt").to("cuda")
    with torch.inference_mode():
        tokens = hf.generate(**inputs, max_new_tokens=24, do_sample=False)[0]
        ref = hf(input_ids=tokens[None]).logits[0].float()
    ours = sequence_logits(engine, tokens.tolist()).to(ref.device)
    rows = slice(inputs["input_ids"].shape[1] - 1, len(tokens) - 1)
    assert (ours[rows].argmax(-1) == ref[rows].argmax(-1)).float().mean() >= 0.95
    assert torch.nn.functional.cosine_similarity(ours[rows], ref[rows], dim=-1).mean() >= 0.999


def test_compiled_steps_give_the_eager_tokens(llama_dir: Path) -> None:
    requests = [{"prompt": f"{PROMPT} ({i})", "params": greedy(12)} for i in range(5)]
    eager = build(llama_dir, device="cuda").generate(requests)
    compiled = build(llama_dir, device="cuda", compile=True).generate(requests)
    assert [o.output_token_ids for o in compiled] == [o.output_token_ids for o in eager]


def test_cuda_tiers_stream_spilled_blocks_exactly(llama_dir: Path, tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    request = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(3000)], "params": greedy(8)}]
    full = build(llama_dir, device="cuda", max_model_len=3100, num_kv_blocks=300).generate(request)[0]
    tiered = build(llama_dir, device="cuda", max_model_len=3100, num_kv_blocks=48, prefill_chunk_tokens=256,
                   kv_staging_blocks=8, host_kv_blocks=400, host_kv_dir=str(tmp_path / "host"))
    out = tiered.generate(request)[0]
    assert out.output_token_ids == full.output_token_ids
    assert tiered.kv.stats()["peak_spilled_blocks"] > 16  # several staging segments per layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cuda_backend_equals_the_reference(dtype: torch.dtype) -> None:
    """Triton always; vllm-flash-attn and flashinfer when installed (their self-check ran in this dtype)."""
    from strata.kernels import available_backends, get_attention_backend
    from strata.kernels.attention_vendor import check_against_reference

    names = available_backends("cuda", dtype)
    assert "triton" in names, names
    for name in names:
        check_against_reference(get_attention_backend(name, "cuda", dtype), torch.device("cuda"), dtype)


def test_a_cuda_engine_defaults_to_bf16_and_tp2_equals_tp1(llama_dir: Path) -> None:
    from strata.pipeline.contract.config import EngineConfig

    assert EngineConfig(device="cuda").dtype == "bfloat16"
    requests = [{"prompt": f"{PROMPT} ({i})", "params": greedy(8)} for i in range(3)]
    one = build(llama_dir, device="cuda", dtype="float32").generate(requests)
    two = build(llama_dir, device="cuda", dtype="float32", tp=2)
    try:
        assert [o.output_token_ids for o in two.generate(requests)] == [o.output_token_ids for o in one]
    finally:
        two.close()
