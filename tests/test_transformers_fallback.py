"""The transformers fallback: causal LMs with no Strata family (ERNIE-4.5-MoE, Hunyuan-MoE, Seed-OSS, GLM-4) run
on transformers' own modules with Strata's paged attention inside them, through every engine path (chunked
prefill, batching, prefix reuse, spill, preemption, the prefill→decode hand-off), equal to transformers'
own greedy tokens; what it cannot serve exactly is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (assert_preemption_recomputes_the_same, build, concurrent_handoffs, greedy, spilling_engine,
                     transformers_greedy)

from strata.checkpoints.tiny_model import write_sha256sums
from strata.checkpoints.tiny_text_models import FALLBACK_ARCHITECTURES, build_tiny_text_model
from strata.cli import main
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.fallback_model import TransformersLanguageModel
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.models.model_loader import check_tensor_parallel_split
from strata.pipeline.models.weights import WeightsError
from strata.pipeline.parallel.shard_plan import ShardingError

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


@pytest.fixture(scope="module")
def fallback_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback-models")
    return {arch: build_tiny_text_model(arch, root / arch) for arch in (*FALLBACK_ARCHITECTURES, "qwen3_next")}


@pytest.mark.parametrize("arch", FALLBACK_ARCHITECTURES)
def test_greedy_tokens_equal_transformers_in_small_chunks_and_a_batch(arch: str, fallback_models) -> None:
    """Three prompts batched in one engine, prefilled 5 tokens at a time: each equals transformers' generate."""
    engine = build(fallback_models[arch], prefill_chunk_tokens=5)
    assert isinstance(engine.core.runner.model, TransformersLanguageModel)
    outs = engine.generate([{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == transformers_greedy(fallback_models[arch], prompt, 10), prompt


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_model_impl_transformers_equals_strata_on_a_registered_family(arch: str, text_models) -> None:
    """``model_impl="transformers"`` runs a family Strata has on transformers' modules: Llama's llama3 RoPE and
    tied head, gpt-oss's sinks (``s_aux``) and sliding windows reach the paged attention through the interface.
    Both implementations give transformers' tokens; their KV blocks are not each other's (the fingerprint)."""
    reqs = [{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS[:2]]
    native, fallback = build(text_models[arch], prefill_chunk_tokens=7), build(
        text_models[arch], prefill_chunk_tokens=7, model_impl="transformers")
    assert isinstance(fallback.core.runner.model, TransformersLanguageModel)
    tokens = [o.output_token_ids for o in fallback.generate(reqs)]
    assert tokens == [o.output_token_ids for o in native.generate(reqs)]
    assert tokens[0] == transformers_greedy(text_models[arch], PROMPTS[0], 10)
    assert fallback.core.runner.kv.fingerprint != native.core.runner.kv.fingerprint


def test_a_prefix_hit_equals_a_fresh_run(fallback_models) -> None:
    engine = build(fallback_models["seed_oss"])
    request = {"prompt": PROMPTS[1], "params": greedy(8)}
    first, second = engine.generate([request])[0], engine.generate([request])[0]
    assert second.output_token_ids == first.output_token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 32


def test_spilled_blocks_reload_and_preempted_requests_recompute(fallback_models, tmp_path: Path) -> None:
    """A prompt longer than the device pool spills to the host tier and streams back into transformers'
    attention modules; requests preempted in a small pool recompute the same tokens."""
    model_dir = fallback_models["ernie4_5_moe"]
    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 8
    expected = build(model_dir).generate([{"prompt": prompt, "params": greedy(8)}])[0]
    spilling = spilling_engine(model_dir, tmp_path / "host")
    assert spilling.generate([{"prompt": prompt, "params": greedy(8)}])[0].output_token_ids == expected.output_token_ids
    assert spilling.kv.spills.peak > 0
    assert_preemption_recomputes_the_same(model_dir, PROMPTS)


def test_the_prefill_to_decode_handoff_equals_the_engine(fallback_models, tmp_path: Path) -> None:
    model_dir = fallback_models["hunyuan_v1_moe"]
    expected = build(model_dir).generate([{"prompt": p, "params": greedy(10)} for p in PROMPTS])
    tokens, recomputed = concurrent_handoffs(model_dir, tmp_path / "host", PROMPTS, greedy(10))
    assert tokens == [o.output_token_ids for o in expected]
    assert recomputed == 0


def test_ops_and_align_cover_the_fallback(fallback_models, tmp_path: Path, capsys) -> None:
    """`strata ops` names what runs on transformers' modules and what on Strata's attention, and passes.
    `strata align` passes in fp32."""
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(fallback_models["glm4"]), "--json", str(report)]) == 0
    rows = {r["name"]: r for r in json.loads(report.read_text())["components"]}
    assert rows["architecture"]["impl"] == "transformers fallback: Glm4ForCausalLM"
    assert rows["attention"]["impl"].startswith("Strata's paged attention")
    assert rows["layers"]["impl"].startswith("transformers' modules")
    capsys.readouterr()
    align = tmp_path / "align.json"
    assert main(["align", "--model", str(fallback_models["glm4"]), "--json", str(align)]) == 0, capsys.readouterr().out
    result = json.loads(align.read_text())
    points = [p["point"] for p in result["points"]]
    assert [p for p in points if p.startswith("decoder.")] == ["decoder.0", "decoder.1"]
    assert points[-2:] == ["final_norm", "logits"] and result["points"][-1]["top1"] == 1.0


def test_what_the_fallback_cannot_serve_is_refused_in_one_line(fallback_models, tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"layers 0, 1, 2 never call transformers' attention interface "
                                                r"\(Qwen3NextDecoderLayer: linear_attn Qwen3NextGatedDeltaNet\)"):
        build(fallback_models["qwen3_next"], model_impl="transformers")  # Strata's own family runs it
    seed = fallback_models["seed_oss"]
    with pytest.raises(ModelConfigError, match="does not split across tensor-parallel ranks"):
        build(seed, tp=2)
    with pytest.raises(ShardingError, match="does not split across tensor-parallel ranks"):  # `strata serve`'s check
        check_tensor_parallel_split(seed, load_model_config(seed), 2)
    with pytest.raises(ModelConfigError, match="compile is not supported on the transformers fallback"):
        build(seed, compile=True)
    with pytest.raises(ModelConfigError, match="FP8 KV cache is not supported on the transformers fallback"):
        build(seed, kv_cache_dtype="fp8")
    with pytest.raises(ModelConfigError, match="no Strata implementation"):
        build(seed, model_impl="strata")
    composite = tmp_path / "composite"  # a vision tower in the config: the fallback serves text only
    composite.mkdir()
    raw = json.loads((seed / "config.json").read_text())
    (composite / "config.json").write_text(json.dumps({**raw, "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(ModelConfigError, match="SeedOssForCausalLM is a composite model"):
        load_model_config(composite)


def test_a_checkpoint_missing_a_tensor_or_corrupt_is_refused(fallback_models, tmp_path: Path) -> None:
    """transformers would initialise a missing tensor at random, and would drop one its model does not have: the
    fallback refuses either load, naming the tensor. A shard changed after its SHA-256 manifest is refused
    before transformers reads it."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "seed"
    shutil.copytree(fallback_models["seed_oss"], copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    dropped = "model.layers.1.mlp.down_proj.weight"
    shard = copy / index["weight_map"].pop(dropped)
    tensors = load_file(shard)
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    write_sha256sums(copy)
    with pytest.raises(WeightsError, match=r"lacks or misshapes model\.layers\.1\.mlp\.down_proj\.weight"):
        build(copy)
    # A tensor no module loads is refused too; one of a layer past num_hidden_layers (multi-token prediction)
    # is not, as Strata's own loader skips it
    extra = tmp_path / "extra"
    shutil.copytree(fallback_models["seed_oss"], extra)
    _add_tensor(extra, "model.layers.1.mlp.extra_proj.weight")
    with pytest.raises(WeightsError, match=r"loads no tensor model\.layers\.1\.mlp\.extra_proj\.weight"):
        build(extra)
    mtp = tmp_path / "mtp"
    shutil.copytree(fallback_models["seed_oss"], mtp)
    _add_tensor(mtp, "model.layers.2.mlp.down_proj.weight")
    assert isinstance(build(mtp).core.runner.model, TransformersLanguageModel)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(fallback_models["seed_oss"], corrupt)
    victim = sorted(corrupt.glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="does not match its SHA-256"):
        build(corrupt)


def _add_tensor(model_dir: Path, name: str) -> None:
    """A checkpoint with one more tensor in its last shard (index and manifest updated)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    save_file({**load_file(shard), name: torch.zeros(4, 4)}, shard, metadata={"format": "pt"})
    index["weight_map"][name] = shard.name
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    write_sha256sums(model_dir)


@pytest.mark.slow
def test_the_openai_client_through_strata_serve_equals_the_engine(fallback_models, tmp_path: Path) -> None:
    """`strata serve` of an architecture Strata has no family for (aggregated): a chat answer and a streamed
    one are the engine's, token for token."""
    import openai
    from helpers import MODEL_NAME
    from serve_process import ServeProcess, stop_later

    model_dir = fallback_models["glm4"]
    expected = build(model_dir).generate([{"prompt": PROMPTS[0], "params": greedy(12, ignore_eos=True)}])[0]
    server = ServeProcess(model_dir, tmp_path, {"mode": "aggregated", "engine": {"max_model_len": 2048}})
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": PROMPTS[0]}]
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.prompt_tokens == expected.num_prompt_tokens
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    finally:
        stop_later(server)
