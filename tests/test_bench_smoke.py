"""Every benchmark command runs end to end on a tiny configuration in seconds and reports what it
compared: a benchmark that rots is a performance claim nobody can check any more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.cli import main


def _bench(tmp_path: Path, capsys: pytest.CaptureFixture, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.mark.unit
def test_bench_offline_compares_engine_and_transformers(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "offline", "--sections", "throughput", "prefix", "--models", "tiny",
                             "--dtypes", "float32", "--batches", "2", "--prompt-len", "16", "--output-len", "4",
                             "--repeats", "1", "--prefix-len", "64", "--prefix-requests", "2", "--prefix-model", "tiny")
    (row,) = result["throughput"]
    assert row["batch"] == 2 and row["hf_tok_s"] > 0 and row["engine_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["engine_tok_s"] / row["hf_tok_s"])
    assert result["prefix"]["cold_s"] > 0 and result["prefix"]["cached_s"] > 0
    assert "same checkpoints for both sides" in printed and "hf tok/s" in printed


@pytest.mark.unit
def test_bench_quant_linear_times_each_path_of_each_format(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "quant-linear", "--shape", "96", "64", "--rows", "1", "20", "200",
                             "--calls", "1")
    assert result["shape"] == [96, 64]
    cells = {(r["rows"], r["format"]) for r in result["results"]}
    assert cells == {(m, f) for m in (1, 20, 200) for f in ("fp8", "int4", "mxfp4", "fp32")}
    assert all(r["engine_ms"] > 0 and r.get("tiles_ms", 1) > 0 and r["fp32_ms"] > 0 for r in result["results"])
    assert "engine path (streamed <= 8 rows, GEMM <= 128, tiles past) / tile path / fp32 F.linear" in printed


@pytest.mark.unit
def test_bench_kv_measures_every_tier_and_decode_vs_context(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "kv", "--parts", "ttft", "decode", "--model", "tiny",
                             "--prompt-len", "64", "--repeats", "1", "--contexts", "256", "512",
                             "--device-blocks", "64", "--decode-steps", "2", "--workdir", str(tmp_path / "tiers"))
    for tier in ("device", "host", "disk"):
        assert result["ttft"][f"{tier}_s"] > 0
    assert [r["context"] for r in result["decode"]] == [256, 512]
    assert all(r["decode_step_ms"] > 0 and r["peak_device_blocks"] <= 64 for r in result["decode"])
    assert "older blocks streamed from the host tier" in printed


@pytest.mark.unit
def test_bench_step_compares_one_forward_with_the_decode_then_prefill_pair(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "step", "--model", "tiny", "--requests", "4", "--prompt-len", "40",
                             "--output-len", "6", "--chunk", "16", "--arrival-steps", "2", "--rounds", "1")
    one, two = result["one forward per step"], result["decode, then prefill"]
    assert one["forwards_per_step"] == 1.0 and two["forwards_per_step"] > 1.0  # steps that mixed both
    assert one["tok_s"] > 0 and two["tok_s"] > 0
    assert "one forward / two:" in printed and "interleaved rounds" in printed


def test_bench_step_profile_splits_a_decode_step_and_puts_everything_back(tmp_path: Path, capsys) -> None:
    import torch.nn.functional as F

    import strata.pipeline.models.decoder as decoder

    silu, linear = F.silu, decoder.linear
    result, printed = _bench(tmp_path, capsys, "step", "--profile", "--model", "tiny", "--prompt-len", "40",
                             "--steps", "3", "--batch", "1", "2", "12")
    assert result["12"]["step_ms_torch_gemm"] > 0 and "step_ms_torch_gemm" not in result["2"]  # fp32 past 8 rows
    for batch in ("1", "2", "12"):
        split = result[batch]["split_ms"]
        assert split["linears"] > 0 and split["attention"] > 0 and split["norms / RoPE / activations"] > 0
        assert sum(split.values()) == pytest.approx(result[batch]["profiled_step_ms"], rel=1e-6)
    assert "Python and scheduling" in printed and "unprofiled" in printed
    assert F.silu is silu and decoder.linear is linear  # the timers are gone


def test_bench_spec_compares_speculation_with_plain_decoding_on_real_weights(smollm2: Path, tmp_path: Path,
                                                                             capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "spec", "--model", str(smollm2), "--max-tokens", "24", "--rounds", "1")
    for row in result.values():
        assert row["plain_tok_s"] > 0 and row["ngram_tok_s"] > 0 and 0 <= row["acceptance"] <= 1
    assert result["repeat text"]["tokens_per_verifying_step"] > 1.5  # repeating given text: most drafts hold
    assert "answers identical" in printed


@pytest.mark.unit
def test_bench_kv_with_a_device_tier_too_small_is_one_line(tmp_path: Path, capsys) -> None:
    code = main(["bench", "kv", "--parts", "decode", "--contexts", "64", "--device-blocks", "2",
                 "--workdir", str(tmp_path / "tiers")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("strata: error:") and "Traceback" not in err


@pytest.mark.serve
def test_bench_serve_overhead_against_a_running_server(aggregated_server, llama_dir: Path, tmp_path: Path,
                                                       capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "serve-overhead", "--url", aggregated_server.base_url,
                             "--model", str(llama_dir), "--concurrency", "1", "--requests", "2",
                             "--prompt-words", "8", "--output-tokens", "4", "--load-model", "none", "--handoff-lens")
    (row,) = result["levels"]
    assert row["concurrency"] == 1 and row["serve"]["ttft_p50_ms"] > 0 and row["in_process"]["ttft_p50_ms"] > 0
    assert row["tpot_ratio"] == pytest.approx(row["serve"]["tpot_p50_ms"] / row["in_process"]["tpot_p50_ms"])
    assert "Serve path vs in-process engine" in printed


@pytest.mark.serve
def test_bench_soak_finds_no_leak_in_a_short_run(serve_server, tmp_path: Path, capsys) -> None:
    out = tmp_path / "soak.json"
    code = main(["bench", "soak", "--url", serve_server.base_url, "--dashboard-url", serve_server.dashboard_url,
                 "--minutes", "0.25", "--sample-s", "5", "--concurrency", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0, printed
    assert result["kv_back_to_baseline"] and not result["unexpected"]
    assert len(result["samples"]) >= 2
    assert {"Ingress", "Prefill", "Decode"} <= set(result["rss"]) and all(g["end_mib"] > 0 for g in result["rss"].values())
    kinds = {k.split(":")[0] for k in result["outcomes"]}
    assert {"chat", "stream", "disconnect", "slowbody"} <= kinds  # stalled uploads (a phase of their own) got 408s
    assert "back to baseline" in printed


def test_bench_vision_compares_packing_and_times_image_requests(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "vision", "--model", "tiny", "--sizes", "64x64", "300x120", "224x224",
                             "--rounds", "1", "--chunk", "64")
    assert set(result["encoder_mixed_seconds"]) == {"packed by 2048 patches (default)", "all in one call",
                                                    "one call per image"}
    assert result["repeated_cached_tokens"] > 0 and result["ttft_four"] > 0
    assert "vs one call per image" in printed and "repeated image" in printed


def test_bench_structured_times_constrained_sampler_steps(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "structured", "--batch", "4", "--rounds", "1")
    assert set(result["ms_per_step"]) == {"none constrained", "1 constrained", "all 4 constrained",
                                          "all 4 tools, auto, text", "all 4 tools, auto, 1-token marker",
                                          "all 4 tools, required"}
    assert "over unconstrained" in printed


@pytest.mark.unit
def test_bench_vs_vllm_says_which_side_is_better_and_needs_a_vllm_python(tmp_path: Path, capsys) -> None:
    """vLLM is not installed here, so the run itself is measured by hand (docs/measured.md); what is checked is
    the table's direction (throughput: Strata over vLLM; latencies: vLLM over Strata) and the refusal."""
    from strata.bench.vs_vllm import table

    side = {"output_throughput": 100.0, "median_ttft_ms": 50.0, "median_tpot_ms": 20.0, "median_itl_ms": 20.0}
    shown = table({"strata": {1: {**side, "output_throughput": 150.0, "median_tpot_ms": 10.0}}, "vllm": {1: side}}, [1])
    rows = {line.split()[1] + " " + line.split()[2]: line.split()[-1] for line in shown.splitlines()[1:5]}
    assert rows == {"output tok/s": "1.50x", "median TTFT": "1.00x", "median TPOT": "2.00x", "median ITL": "1.00x"}
    assert main(["bench", "vs-vllm", "--vllm-python", str(tmp_path / "no-python")]) == 2
    assert "is not a file: pass the python of a venv with vLLM" in capsys.readouterr().err


def test_bench_vs_vllm_hands_vllm_a_llava_under_the_tower_names_it_reads(llama_dir: Path, tmp_path: Path) -> None:
    """vLLM 0.32's LLaVA loader reads the CLIP tower only as ``vision_tower.vision_model.*``; transformers 5
    saves ``vision_tower.*``. vLLM gets a renamed copy with every tensor's values; Strata keeps the original."""
    import json

    from safetensors.torch import load_file

    from strata.bench.vs_vllm import vllm_names

    def tensors(model: Path) -> dict:
        index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
        return {k: t for shard in sorted(set(index.values())) for k, t in load_file(model / shard).items()}

    copy = vllm_names(llama_dir, tmp_path / "vllm")
    ours, theirs = tensors(llama_dir), tensors(copy)
    tower = [k for k in ours if k.startswith("vision_tower.")]
    assert tower and not any(k.startswith("vision_tower.vision_model.") for k in ours)
    assert sorted(theirs) == sorted(k.replace("vision_tower.", "vision_tower.vision_model.", 1) for k in ours)
    assert all(theirs[k.replace("vision_tower.", "vision_tower.vision_model.", 1)].equal(ours[k]) for k in tower)
    assert json.loads((copy / "config.json").read_text()) == json.loads((llama_dir / "config.json").read_text())
    assert vllm_names(copy, tmp_path / "again") == copy  # already under vLLM's names: used as it is


def test_bench_mtp_times_drafting_and_checks_answers(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "mtp", "--layers", "2", "--batch", "1", "--max-tokens", "6",
                             "--rounds", "1")
    row = result["batch 1"]
    assert row["plain_tok_s"] > 0 and row["mtp_tok_s"] > 0 and row["step_cost_ratio"] > 0
    assert "answers identical" in printed and "it pays above" in printed


def test_bench_linear_compares_a_hybrid_with_full_attention(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "linear", "--contexts", "64", "256", "--rounds", "1",
                             "--prefill-rows", "80")
    assert set(result["tpot_ms"]) == {"64", "256"}
    assert result["layer_step_ms"]["gated_deltanet"] > 0 and result["layer_step_ms"]["kda"] > 0
    assert result["prefill"]["gated_deltanet"]["strata_tok_s"] > 0 and result["prefill"]["kda"]["strata_tok_s"] > 0
    memory = result["memory_bytes"]
    for model, ratio in (("qwen3-next-80b", 3), ("kimi-linear-48b", 3)):
        hybrid, full = memory[f"{model} hybrid"], memory[f"{model} all full attention"]
        assert hybrid["1000K"] < full["1000K"] / ratio
    assert printed.count("outputs equal") == 2


@pytest.mark.parametrize("model", ["deepseek_v32", "deepseek_v4"])
def test_bench_sparse_reads_few_spilled_blocks_and_answers_as_all_on_device(model: str, tmp_path: Path, capsys) -> None:
    """DSA's latents, and DeepSeek-V4's CSA entries, read back only where chosen; the indexer keys (and V4's HCA
    entries) kept on the device after their first read."""
    result, printed = _bench(tmp_path, capsys, "sparse", "--model", model, "--contexts", "1024", "2048",
                             "--device-blocks", "40", "--topk", "8", "--check-all-device")
    assert set(result) == {"1024", "2048"}
    for row in result.values():
        step = row["per_step"]
        assert row["identical_to_all_on_device"] and row["tpot_ms"] > 0
        assert 0 < step["share_of_spilled_blocks_read"] < 0.5 and step["index_key_bytes_spilled"] == 0  # kept
    assert result["1024"]["device_pool_bytes"] == result["2048"]["device_pool_bytes"]
    assert "identical to all-on-device" in printed and "of spilled blocks touched" in printed


def test_bench_sparse_decode_batches_reports_both_models_side_by_side(tmp_path: Path, capsys) -> None:
    result, printed = _bench(tmp_path, capsys, "sparse", "--decode-batches", "1", "2")
    assert set(result) == {"deepseek_v32", "deepseek_v4"}
    assert all(row["decode_b1_tok_s"] > 0 and row["decode_b2_tok_s"] > 0 for row in result.values())
    assert "x batch 1" in printed and "interleaved" in printed
