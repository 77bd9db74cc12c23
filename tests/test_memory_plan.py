"""`strata plan` sizes a deployment from config.json alone: counts checked against real configs and shards."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from strata.cli import main
from strata.pipeline.contract.sizes import parse_size
from strata.pipeline.models.model_config import ModelConfigError
from strata.pipeline.parallel.shard_plan import ShardPlan
from strata.planning.memory_plan import (
    count_params,
    load_model_shape,
    parse_count,
    plan_memory,
)
from strata.planning.model_shapes import BUILTIN_SHAPES
from strata.planning.plan_report import format_plan
from strata.checkpoints.tiny_model import ARCHITECTURES

GiB = 1 << 30

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}

LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "projector_hidden_act": "gelu", "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "text_config": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
        "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu",
    },
}


def write_config(root: Path, name: str, config: dict) -> Path:
    """A checkpoint directory holding config.json and nothing else: no weights, no tokenizer."""
    model = root / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture
def llama3(tmp_path: Path) -> Path:
    return write_config(tmp_path, "llama3-8b", LLAMA3_8B)


@pytest.fixture
def llava15(tmp_path: Path) -> Path:
    return write_config(tmp_path, "llava-1.5-7b", LLAVA_15_7B)


def test_llama3_8b_params_and_kv(llama3: Path) -> None:
    assert [p.name for p in llama3.iterdir()] == ["config.json"]  # planning needs no weights
    plan = plan_memory(llama3, context_tokens=1_000_000, concurrency=1, device_mem_bytes=80 * GiB)
    assert plan.num_params == 8_030_261_248
    assert plan.weights_bytes == 2 * 8_030_261_248
    assert plan.kv_bytes_per_token == 131072 == 128 * 1024
    assert plan.bytes_per_block == 16 * 131072
    assert plan.blocks_needed == 62_500
    assert plan.kv_bytes_needed == 1_000_000 * 131072  # ~122 GiB: 1M tokens of 128 KiB
    assert plan.staging_bytes == 64 * 16 * 131072
    assert plan_memory(llama3 / "config.json", 1, 1, 80 * GiB, dtype="float32").kv_bytes_per_token == 2 * 131072


def test_kv_is_rounded_up_to_whole_blocks_per_sequence(llama3: Path) -> None:
    plan = plan_memory(llama3, context_tokens=1000, concurrency=3, device_mem_bytes=80 * GiB)
    assert plan.blocks_needed == 3 * 63  # ceil(1000 / 16) blocks for each sequence
    assert plan.kv_bytes_needed == 3 * 63 * 16 * 131072


def test_llava_15_7b_params(llava15: Path) -> None:
    _, shape = load_model_shape(llava15)
    text = (
        2 * 32064 * 4096  # embed_tokens + untied lm_head
        + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)  # MHA q/k/v/o, gate/up/down, 2 RMSNorms
        + 4096  # final norm
    )
    patches = (336 // 14) ** 2
    vision = (
        1024 * 3 * 14 * 14 + (patches + 1) * 1024 + 1024  # patch conv (no bias), positions, class embedding
        + 2 * 1024  # pre-layernorm
        + 24 * (4 * (1024 * 1024 + 1024) + 2 * 2 * 1024 + (1024 * 4096 + 4096) + (4096 * 1024 + 1024))
        + 2 * 1024  # post-layernorm
    )
    projector = (1024 * 4096 + 4096) + (4096 * 4096 + 4096)
    expected = text + vision + projector
    assert expected == 7_063_427_072
    assert count_params(shape) == expected
    assert abs(expected - 7.06e9) / 7.06e9 < 0.01
    plan = plan_memory(llava15, context_tokens=4096, concurrency=1, device_mem_bytes=80 * GiB)
    assert plan.multimodal and plan.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2


def test_text_only_moe_and_bias_configs_count(tmp_path: Path) -> None:
    mixtral = {**LLAMA3_8B, "model_type": "mixtral", "intermediate_size": 64, "hidden_size": 32, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "num_local_experts": 8, "num_experts_per_tok": 2}
    _, shape = load_model_shape(write_config(tmp_path, "mixtral", mixtral))
    layer = (32 * 32 + 2 * 32 * 16 + 32 * 32) + 8 * 3 * 32 * 64 + 32 * 8 + 2 * 32
    assert count_params(shape) == 2 * 100 * 32 + 2 * layer + 32
    qwen = {**mixtral, "model_type": "qwen2", "tie_word_embeddings": True}
    _, shape = load_model_shape(write_config(tmp_path, "qwen", qwen))
    layer = (32 * 32 + 2 * 32 * 16 + 32 * 32) + (32 + 2 * 16) + 3 * 32 * 64 + 2 * 32  # q/k/v biases, no o bias
    assert count_params(shape) == 100 * 32 + 2 * layer + 32  # tied: no separate lm_head


def _numel_in_shards(model_dir: Path) -> int:
    total = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_param_count_matches_real_tiny_checkpoint(arch: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models[arch]
    numel = _numel_in_shards(model)
    assert numel > 0
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(model / "config.json", config_only / "config.json")
    plan = plan_memory(config_only, context_tokens=256, concurrency=2, device_mem_bytes=GiB, dtype="float32")
    assert plan.num_params == numel
    assert plan.weights_bytes == 4 * numel
    assert plan.fits, plan.reason


def test_device_capacity_and_verdicts(llama3: Path) -> None:
    plan = plan_memory(llama3, 1_000_000, 1, 80 * GiB)
    free = 80 * GiB - plan.weights_bytes - plan.activation_bytes - plan.staging_bytes
    assert plan.device_blocks == free // plan.bytes_per_block and plan.host_blocks == plan.disk_blocks == 0
    assert not plan.fits and "62,500 blocks" in plan.reason
    assert plan_memory(llama3, 1_000_000, 1, 80 * GiB, host_mem_bytes=256 * GiB).fits
    assert plan_memory(llama3, 1_000_000, 1, 80 * GiB, disk_bytes=parse_size("1TiB")).fits
    tiny_device = plan_memory(llama3, 8192, 1, 15 * GiB)
    assert not tiny_device.fits and "weights" in tiny_device.reason and tiny_device.device_blocks == 0
    # room for weights but not for 100 sequences' working sets (33 blocks each)
    crowded = plan_memory(llama3, 512, 100, 20 * GiB, host_mem_bytes=1024 * GiB)
    assert not crowded.fits and "working set" in crowded.reason
    no_staging = plan_memory(llama3, 1_000_000, 1, 80 * GiB, host_mem_bytes=256 * GiB, staging_blocks=0)
    assert not no_staging.fits and "staging" in no_staging.reason


def test_activation_estimate_grows_with_chunk_and_staging(llama3: Path) -> None:
    base = plan_memory(llama3, 8192, 1, 80 * GiB).activation_bytes
    assert base == 512 * (4 * 4096 + 3 * 14336) * 2 + 512 * 32 * 1024 * 4 + 128256 * 4
    assert plan_memory(llama3, 8192, 1, 80 * GiB, chunk_tokens=1024).activation_bytes > base
    assert plan_memory(llama3, 8192, 1, 80 * GiB, staging_blocks=128).activation_bytes > base


@pytest.mark.parametrize(
    "text, expected",
    [("80GiB", 80 * GiB), ("80G", 80 * GiB), ("80GB", 80 * GiB), ("80gib", 80 * GiB), ("512MiB", 512 << 20),
     ("1.5TiB", 3 << 39), ("0", 0), ("123", 123), ("4K", 4096), (" 2 GiB ", 2 * GiB)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "80XB", "1.5", "0.3K", "1e9", "80 GiB extra"])
def test_parse_size_rejects_junk(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_parse_count() -> None:
    assert parse_count("8192") == 8192 and parse_count("128K") == 128_000 and parse_count("1M") == 1_000_000
    assert parse_count("1.5M") == 1_500_000
    for junk in ("1G", "x", "", "1.5"):
        with pytest.raises(ValueError, match="invalid token count"):
            parse_count(junk)


def test_bad_configs_are_model_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="JSON"):
        load_model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelConfigError, match="missing required field"):
        load_model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match="unsupported"):
        load_model_shape(tmp_path)


def test_format_plan_is_an_aligned_table(llama3: Path) -> None:
    text = format_plan(plan_memory(llama3, 1_000_000, 1, 80 * GiB))
    assert "8,030,261,248" in text and "128.00 KiB" in text and "122.07 GiB" in text and "80.00 GiB" in text
    assert text.splitlines()[-1].startswith("verdict: does NOT fit: KV needs 62,500 blocks")
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("item"))
    end = header.index("bytes") + len("bytes")
    rows = [line for line in lines if line.startswith(("weights", "KV ", "activations", "staging", "device", "host", "disk", "total"))]
    assert len(rows) == 11
    assert all(line[:end].endswith("B") and line[end:end + 1] in ("", " ") for line in rows)  # bytes column right-aligned


# --- CLI -------------------------------------------------------------------------------------------------------


def run_plan(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_plan_fits(llama3: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, err = run_plan(capsys, "--model", str(llama3), "--context", "8192", "--concurrency", "1", "--device-mem", "80GiB")
    assert rc == 0, err
    assert "8,030,261,248" in out and "128.00 KiB" in out and out.rstrip().endswith("verdict: fits")
    assert err == ""


def test_cli_plan_does_not_fit_then_fits_with_host_memory(llama3: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = run_plan(capsys, "--model", str(llama3), "--context", "1M", "--device-mem", "80GiB")
    assert rc == 1
    assert "does NOT fit" in out and "KV needs 62,500 blocks" in out and "host or disk" in out
    rc, out, _ = run_plan(capsys, "--model", str(llama3 / "config.json"), "--context", "1M", "--host-mem", "256GiB")
    assert rc == 0 and "verdict: fits" in out and "256.00 GiB" in out


def test_cli_plan_llava(llava15: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = run_plan(capsys, "--model", str(llava15), "--context", "4K", "--concurrency", "8")
    assert rc == 0 and "7,063,427,072" in out and "vision + text, up to 576 tokens an image" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--context", "1M", "--device-mem", "lots"], "invalid size 'lots'"),
        (["--context", "1M", "--host-mem", "12XB"], "invalid size"),
        (["--context", "many"], "invalid token count"),
        (["--context", "0"], "context_tokens must be >= 1"),
        (["--context", "1M", "--block-size", "0"], "block_size must be >= 1"),
    ],
    ids=["bad-device-mem", "bad-host-mem", "bad-context", "zero-context", "zero-block-size"],
)
def test_cli_plan_bad_input_is_one_line(args: list[str], message: str, llama3: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, err = run_plan(capsys, "--model", str(llama3), *args)
    assert rc == 2 and out == ""
    assert err.startswith("strata: error:") and message in err and err.count("\n") == 1


def test_cli_plan_missing_or_invalid_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc, out, err = run_plan(capsys, "--model", str(tmp_path / "nowhere"), "--context", "1K")
    assert rc == 2 and out == "" and err.startswith("strata: error: no config.json") and err.count("\n") == 1
    (tmp_path / "config.json").write_text("[1, 2]")
    rc, out, err = run_plan(capsys, "--model", str(tmp_path), "--context", "1K")
    assert rc == 2 and out == "" and err.startswith("strata: error:") and "JSON object" in err and err.count("\n") == 1


# ---------------------------------------------------------------- tensor-parallel plans


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rank_shards_add_up_to_the_decoder(arch: str, tiny_models: dict[str, Path]) -> None:
    """One rank of one holds the whole decoder; two ranks hold it once plus the replicated norms/router."""
    from strata.planning.memory_plan import text_params

    tc = load_model_shape(tiny_models[arch])[1].text
    assert ShardPlan(tc, 0, 1).num_params() == text_params(tc)
    halves = [ShardPlan(tc, r, 2).num_params() for r in range(2)]
    replicated = (2 * tc.num_layers + 1) * tc.hidden_size + tc.num_layers * tc.num_experts * tc.hidden_size
    assert sum(halves) == text_params(tc) + replicated


def test_kimi_k2_as_released_needs_two_nodes_of_eight_80gib_ranks(capsys: pytest.CaptureFixture) -> None:
    """The real Kimi-K2 shape: MLA caches one 512 + 64 latent per layer (70,272 bytes a token in bf16, not
    the 249,856 of a GQA model with 8 KV heads of 128), replicated on every rank; experts split whole. Its
    linears are FP8 with 128 x 128 blocks, as Moonshot releases it: about a byte a parameter, not two."""
    plan = plan_memory("kimi-k2", 128_000, 1, 80 * GiB, host_mem_bytes=1024 * GiB, tp=8)
    assert 1.0e12 < plan.num_params < 1.05e12
    assert plan.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert plan.weights_bytes == pytest.approx(plan.num_params / 8, rel=0.03)  # FP8, about one eighth per rank
    assert plan.weight_formats.startswith("attention, dense mlp, shared experts, experts in fp8-e4m3-block128x128")
    assert (plan.num_experts, plan.experts_per_rank) == (384, 48)
    assert not plan.fits and (plan.nodes_needed, plan.tp_needed) == (2, 16)
    assert plan.rank_bytes_per_block == plan.bytes_per_block  # the latent is replicated, not split by heads
    assert plan_memory("moe-1t", 128_000, 1, 80 * GiB, tp=8).num_params == plan.num_params  # the old name
    rc, out, err = run_plan(capsys, "--model", "kimi-k2", "--context", "128K", "--tp", "16", "--nodes", "2",
                            "--device-mem", "141GiB", "--host-mem", "1TiB")
    assert rc == 0 and "group:  tp=16 over 2 node(s), 8 rank(s) per node" in out and "verdict: fits" in out
    assert "KV per token (MLA latent 512+64 per layer)" in out and "68.62 KiB" in out
    rc, out, err = run_plan(capsys, "--model", "kimi-k2", "--context", "128K", "--tp", "8", "--host-mem", "1TiB")
    assert rc == 1 and "needs:  2 node(s) of 8 rank(s): tp=16" in out
    assert "stored: attention, dense mlp, shared experts, experts in fp8-e4m3-block128x128; the rest in bfloat16" in out
    million = plan_memory("kimi-k2", 1_000_000, 1, 141 * GiB, host_mem_bytes=2048 * GiB, tp=8)
    assert million.kv_bytes_needed == 62_500 * 16 * 70_272 and million.fits  # one node of eight 141 GiB ranks


def test_kimi_k2_thinking_counts_its_int4_experts_at_their_stored_bytes() -> None:
    """INT4 routed experts (half a byte a weight plus a bf16 scale per 32: 0.5625 bytes), everything else bf16."""
    fp8 = plan_memory("kimi-k2", 128_000, 1, 141 * GiB, tp=8)
    int4 = plan_memory("kimi-k2-thinking", 128_000, 1, 141 * GiB, tp=8)
    assert int4.num_params == fp8.num_params and int4.weight_formats == "experts in int4-group32-sym; the rest in bfloat16"
    tc = load_model_shape("kimi-k2-thinking")[1].text
    roles = ShardPlan(tc, 0, 8).params_by_role()
    assert int4.weights_bytes == roles["experts"] * 0.5625 + 2 * (sum(roles.values()) - roles["experts"])
    assert 0.55 < int4.weights_bytes / fp8.weights_bytes < 0.65


def test_deepseek_v3_counts_its_published_671b_parameters() -> None:
    plan = plan_memory("deepseek-v3", 4096, 1, 80 * GiB, tp=8)
    assert 670e9 < plan.num_params < 672e9  # without the multi-token-prediction layer serving skips
    assert plan.kv_bytes_per_token == 70_272 and plan.experts_per_rank == 32


@pytest.mark.parametrize("args, message", [
    (["--tp", "3", "--nodes", "2"], "tp (3) must be a multiple of nodes (2)"),
    (["--tp", "12"], "tp=12 does not divide the model's 64 attention heads"),
], ids=["tp-not-multiple-of-nodes", "tp-does-not-split-heads"])
def test_cli_plan_bad_groups_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    rc, out, err = run_plan(capsys, "--model", "kimi-k2", "--context", "128K", *args)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1


def test_gpt_oss_120b_grows_only_its_full_layers_with_the_context(tmp_path: Path) -> None:
    """Half of gpt-oss's layers slide over 128 tokens: a token costs the 18 full layers' K and V, and the
    windows cost the same fixed slots at 128K and at 1M (``kvstore.window_slots``)."""
    at_128k = plan_memory("gpt-oss-120b", 128_000, 1, 80 * GiB)
    at_1m = plan_memory("gpt-oss-120b", 1_000_000, 1, 80 * GiB)
    assert at_128k.num_params == 116_829_156_672  # OpenAI: 116.8 B
    assert at_128k.kv_bytes_per_token == 18 * 2 * 8 * 64 * 2
    slots = 1 * (-(-127 // 16) + 3) + 512 // 16  # one window plus one chunk's blocks
    assert at_128k.window_kv_bytes == at_1m.window_kv_bytes == slots * 18 * 2 * 16 * 8 * 64 * 2
    assert at_1m.kv_bytes_needed == 62_500 * at_1m.bytes_per_block + at_1m.window_kv_bytes
    assert "18 slide over 128 tokens" in format_plan(at_128k)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BUILTIN_SHAPES["gpt-oss-120b"], "layer_types": ["full_attention"] * 36}))
    all_full = plan_memory(config, 128_000, 1, 80 * GiB)
    assert all_full.kv_bytes_per_token == 2 * at_128k.kv_bytes_per_token and all_full.window_kv_bytes == 0


def test_a_linear_attention_hybrid_costs_its_full_layers_per_token_and_a_fixed_state(text_models) -> None:
    """Qwen3-Next-80B: only its 12 full-attention layers cache per token; its 36 Gated DeltaNet layers keep a
    state per sequence (read, write and snapshot copies) that is the same at 128K and at 1M, and the engine's
    state pool holds exactly one such copy per slot."""
    from helpers import build
    from strata.pipeline.models.model_config import load_model_config
    from strata.planning.kv_bytes import STATE_COPIES, linear_state_bytes

    at_128k = plan_memory("qwen3-next-80b", 128_000, 1, 80 * GiB)
    at_1m = plan_memory("qwen3-next-80b", 1_000_000, 1, 80 * GiB)
    assert at_128k.num_params == 79_674_391_296  # Qwen: 80 B
    assert at_128k.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    per_copy = 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)  # conv inputs (bf16), fp32 matrix
    assert at_128k.state_bytes_per_sequence == at_1m.state_bytes_per_sequence == STATE_COPIES * per_copy
    assert at_1m.kv_bytes_needed == 62_500 * at_1m.bytes_per_block + at_1m.state_bytes_per_sequence
    assert "on 12 of 48 layers (the others linear)" in format_plan(at_1m)
    assert at_1m.kv_bytes_needed < plan_memory("deepseek-v3", 1_000_000, 1, 80 * GiB).kv_bytes_needed / 2
    # a rank of four holds its heads' quarter of each state, which is what its device sets aside per sequence
    ranks = plan_memory("qwen3-next-80b", 1_000_000, 8, 80 * GiB, tp=4)
    assert at_1m.rank_state_bytes == at_1m.state_bytes_per_sequence == 4 * ranks.rank_state_bytes
    assert "one rank's heads" in format_plan(ranks) and "one rank's heads" not in format_plan(at_1m)
    tiny = text_models["qwen3_next"]
    engine = build(tiny)
    assert STATE_COPIES * engine.kv.states.pool.bytes_per_sequence() == linear_state_bytes(load_model_config(tiny).text, 4)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text", "kimi_linear", "deepseek_v32", "glm_moe_dsa"])
def test_a_frontier_param_count_matches_its_transformers_built_checkpoint(arch: str, text_models,
                                                                          tmp_path: Path) -> None:
    """The planner counts linear-attention layers (Gated DeltaNet's and KDA's own projections, convolutions,
    decay and gate parameters) and DSA's indexers (GLM-5's only where a layer runs one) as transformers writes them."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(text_models[arch] / "config.json", config_only / "config.json")
    plan = plan_memory(config_only, context_tokens=256, concurrency=2, device_mem_bytes=GiB, dtype="float32")
    assert plan.num_params == _numel_in_shards(text_models[arch])


def test_kimi_linear_at_a_million_tokens_caches_its_seven_mla_layers(text_models) -> None:
    """Kimi-Linear-48B as released (its ``linear_attn_config``, counted from 1): 7 NoPE MLA layers cache a
    576-value latent per token, 20 KDA layers keep a state per sequence; 1M tokens cost less than an eighth of
    DeepSeek-V3's dense MLA, and the tiny engine's state pool holds one copy per slot."""
    from helpers import build
    from strata.pipeline.models.model_config import load_model_config
    from strata.planning.kv_bytes import STATE_COPIES, linear_state_bytes

    at_1m = plan_memory("kimi-linear-48b", 1_000_000, 1, 80 * GiB)
    assert at_1m.kv_bytes_per_token == 7 * 576 * 2
    per_copy = 20 * (3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4)  # conv inputs of q, k, v (bf16), fp32 matrix
    assert at_1m.state_bytes_per_sequence == STATE_COPIES * per_copy
    assert "on 7 of 27 layers (the others linear)" in format_plan(at_1m)
    assert at_1m.kv_bytes_needed < plan_memory("deepseek-v3", 1_000_000, 1, 80 * GiB).kv_bytes_needed / 8
    tiny = text_models["kimi_linear"]
    assert STATE_COPIES * build(tiny).kv.states.pool.bytes_per_sequence() == linear_state_bytes(load_model_config(tiny).text, 4)


def test_deepseek_v32_caches_an_indexer_key_beside_each_latent() -> None:
    """DeepSeek-V3.2 at its real shape: 61 layers of a 576-value latent plus a 128-value indexer key per token;
    its parameters are V3's plus the 61 indexers."""
    v32, v3 = plan_memory("deepseek-v3.2", 1_000_000, 1, 80 * GiB), plan_memory("deepseek-v3", 1_000_000, 1, 80 * GiB)
    assert v32.kv_bytes_per_token == 61 * (576 + 128) * 2 and v3.kv_bytes_per_token == 61 * 576 * 2
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert v32.num_params == v3.num_params + 61 * indexer
    assert "+ DSA indexer key 128 per layer" in format_plan(v32)


def test_deepseek_v32_with_a_host_tier_keeps_its_spilled_indexer_keys_on_device() -> None:
    """With a host tier, the device keeps room for one context's indexer keys (what ``kvstore.layer_mirror`` may
    hold): each decode step reads every key, and streaming 14.5 GiB of them a step from the host would be the
    cost of dense attention again. That room comes out of the device's KV blocks; without tiers none is kept."""
    alone = plan_memory("deepseek-v3.2", 1_000_000, 4, 141 * GiB, tp=8)
    tiered = plan_memory("deepseek-v3.2", 1_000_000, 4, 141 * GiB, host_mem_bytes=2048 * GiB, tp=8)
    keys = 1_000_000 * 61 * 128 * 2
    assert alone.index_mirror_bytes == 0 and tiered.index_mirror_bytes == tiered.sparse_step[0] == keys
    assert alone.device_blocks - tiered.device_blocks == pytest.approx(keys / tiered.rank_bytes_per_block, abs=1)
    assert tiered.fits and not alone.fits
    assert "device room for spilled blocks' indexer keys (one context's, per rank)" in format_plan(tiered)


def test_a_tiered_group_says_what_it_would_need_without_its_tiers(llama3: Path) -> None:
    """Nodes with and without host and disk tiers. Llama-3-8B's 8 KV heads split over ranks, so more nodes add
    KV room and two nodes hold 4 x 128K on device alone; DeepSeek-V3.2's latent is on every rank, so no group
    ever does, and the plan says why."""
    args = dict(context_tokens=128_000, concurrency=4, device_mem_bytes=24 * GiB, tp=2)
    tiered = plan_memory(llama3, host_mem_bytes=256 * GiB, **args)
    assert tiered.fits and tiered.nodes_without_tiers == 2
    n = tiered.nodes_without_tiers
    assert plan_memory(llama3, **{**args, "tp": 2 * n}, nodes=n).fits
    assert not plan_memory(llama3, **{**args, "tp": 2 * (n - 1)}, nodes=n - 1).fits
    assert f"without host and disk tiers: {n} node(s) of 2 rank(s): tp={2 * n}" in format_plan(tiered)
    assert plan_memory(llama3, **args).nodes_without_tiers is None  # no tiers given: nothing to compare
    v32 = plan_memory("deepseek-v3.2", 1_000_000, 4, 141 * GiB, host_mem_bytes=2048 * GiB, tp=8)
    assert v32.nodes_without_tiers is None
    assert "nodes fits: every rank holds every block" in format_plan(v32)
