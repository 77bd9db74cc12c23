"""Weight formats, in-process: each encoding dequantizes exactly as its format defines (partial blocks,
asymmetric groups, fused rows, stacked experts), the tiled matmul equals the dense product, and a
``quantization_config`` Strata does not implement is refused in one line that names what it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_cases import fp8_block_case, ggml_weight_case, pack_int4, streamed_weights

import strata.kernels.quant_linear as quant_linear_module
from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.quant_linear import dequantize_rows, quant_linear, tile_rows, tiled_linear
from strata.kernels.quant_weight import (
    FP8BlockWeight,
    FP8RowWeight,
    GGMLBlockWeight,
    cat_rows,
    stack_experts,
)
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.weight_formats import FP8Block, Int4Group, WeightFormatError, parse_quantization

pytestmark = pytest.mark.unit


def test_fp8_blocks_dequantize_exactly_with_partial_blocks() -> None:
    codes, scale, exact = fp8_block_case(48, 40, 32, 16, seed=0)  # rows: 1.5 blocks, cols: 2.5 blocks
    w = FP8Block(32, 16).build("q_proj", 48, 40, {"weight": codes, "weight_scale_inv": scale})
    assert torch.equal(w.dequantize(), exact)
    assert torch.equal(w.tile(17, 45, torch.float32), exact[17:45])


def test_fused_rows_keep_each_parts_blocks() -> None:
    """q (48 rows, a partial last block) fused with k: k's first row reads k's first scale row, not q's."""
    parts = [fp8_block_case(rows, 40, 32, 16, seed=i) for i, rows in enumerate((48, 20, 33))]
    weights = [FP8Block(32, 16).build(f"p{i}", c.shape[0], 40, {"weight": c, "weight_scale_inv": s})
               for i, (c, s, _) in enumerate(parts)]
    fused = cat_rows(weights)
    assert torch.equal(fused.dequantize(), torch.cat([e for _, _, e in parts]))
    assert torch.equal(fused.row_range(48, 68).dequantize(), parts[1][2])
    assert torch.equal(dequantize_rows(fused, 40, 90, torch.float32), fused.tile(40, 90, torch.float32))  # C++ tiles
    whole = cat_rows([weights[0].row_range(0, 32), weights[2]])  # whole blocks, then a partial last part
    assert whole.row_block is None and torch.equal(whole.dequantize(), torch.cat([parts[0][2][:32], parts[2][2]]))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups_dequantize_exactly(symmetric: bool, group: int) -> None:
    g = torch.Generator().manual_seed(group)
    rows, cols = 24, 256 + 40  # a partial last group
    q = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
    groups = -(-cols // group)
    scale = (torch.rand(rows, groups, generator=g) + 0.05).to(torch.bfloat16)
    zero = torch.randint(-8, 8, (rows, groups), generator=g, dtype=torch.int8)
    parts = {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": torch.tensor([rows, cols])}
    if not symmetric:
        parts["weight_zero_point"] = pack_int4(zero.T.contiguous()).T.contiguous()  # packed along the rows
    w = Int4Group(group, symmetric).build("experts.0.up_proj", rows, cols, parts)
    col_group = torch.arange(cols) // group
    expected = q.float() - (zero.float()[:, col_group] if not symmetric else 0)
    expected = expected * scale.float()[:, col_group]
    assert torch.equal(w.dequantize(), expected)
    assert w.nbytes == rows * ((cols + 7) // 8) * 4 + scale.numel() * 2 + (0 if symmetric else zero.numel())


def test_stacked_experts_index_to_each_expert() -> None:
    experts = [FP8RowWeight(8, 16, (torch.randn(8, 16) * 9).to(torch.float8_e4m3fn), torch.rand(8)) for _ in range(3)]
    stack = stack_experts(experts)
    assert stack.shape == (3, 8, 16)
    for e in range(3):
        assert torch.equal(stack[e].dequantize(), experts[e].dequantize())


def test_the_tiled_product_equals_the_dense_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_linear_module, "TILE_ELEMENTS", 128 * 64)  # 128-row tiles of a 64-wide matrix
    rows = tile_rows(64) * 2 + 77  # three tiles, the last partial
    codes, scale, exact = fp8_block_case(rows, 64, 128, 32, seed=3)
    w = FP8BlockWeight(rows, 64, codes, scale, 128, 32)
    x, bias = torch.randn(5, 64), torch.randn(rows)
    for kernels in (False, True):
        torch.testing.assert_close(tiled_linear(x, w, bias, kernels), F.linear(x, exact, bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_dequantize_as_gguf_py_does(kind: str) -> None:
    """Bit for bit, including rows gathered for an embedding lookup and the C++ tile."""
    w, exact = ggml_weight_case(kind, 24, 96, seed=20)
    assert w.data.shape == (24, 96 // 32 * GGMLBlockWeight.BLOCK_BYTES[kind])
    assert torch.equal(w.dequantize(), exact)
    rows = torch.tensor([5, 0, 23, 5])
    assert torch.equal(w.take_rows(rows).dequantize(), exact[rows])
    assert torch.equal(dequantize_rows(w, 3, 21, torch.float32), exact[3:21])  # the C++ tile a prefill multiplies by


@pytest.mark.parametrize("rows_of_x", [1, 3, 8, 9, 40, 70, 128])
def test_the_cpu_kernels_equal_the_tiled_reference(rows_of_x: int) -> None:
    """The decode kernels against the torch reference, for every layout they tell apart: up to 8 rows
    streamed (codes widened in registers, x in their lanes' order, scales applied once a block or group),
    past that the GEMM that dequantizes a few rows of W at a time into cache (one vector of x^T a pass up
    to 16 rows, two past it, and a last pass of fewer rows than its width)."""
    assert cpu_kernels() is not None, "the CPU kernels must build here"
    for w in streamed_weights():
        x, bias = torch.randn(rows_of_x, w.cols), torch.randn(w.rows)
        # fp32 sums in another order: within a few ulps of the sum of the products' magnitudes
        scale_of_sum = (x.abs() @ w.dequantize().abs().T).max().item()
        for b in (bias, None):
            got, want = quant_linear(x, w, b), tiled_linear(x, w, b, kernels=False)
            assert (got - want).abs().max().item() <= 1e-6 * scale_of_sum, (type(w).__name__, w.shape)
        assert quant_linear(x[:0], w).shape == (0, w.rows)  # a prefill chunk that asks for no logits


def test_a_row_streams_the_same_alone_or_in_a_batch() -> None:
    """Batch invariance: a row of x gives the same bits alone as among up to eight rows (a draft verified with
    its row, a request decoded with others), and among 9 rows as among 70 in the GEMM; activations too
    large to carry the FP8 kernel's 2^100 still compute right."""
    for w in streamed_weights():
        x = torch.randn(8, w.cols)
        together = quant_linear(x, w)
        for r in (0, 3, 7):
            assert torch.equal(quant_linear(x[r:r + 1], w)[0], together[r]), (type(w).__name__, w.shape, r)
        assert torch.equal(quant_linear(x[2:5], w), together[2:5])
    for w in streamed_weights():  # the GEMM's rows: the same bits among 9 rows as among 70
        x = torch.randn(70, w.cols)
        assert torch.equal(quant_linear(x[:9], w), quant_linear(x, w)[:9]), (type(w).__name__, w.shape)
    w = streamed_weights()[0]
    big = torch.randn(2, w.cols) * 1e8
    scale_of_sum = (big.abs() @ w.dequantize().abs().T).max().item()
    assert (quant_linear(big, w) - tiled_linear(big, w, kernels=False)).abs().max().item() <= 1e-6 * scale_of_sum


def test_a_split_that_cuts_a_block_is_refused_by_name() -> None:
    fmt = FP8Block(128, 128)
    assert fmt.part_slice("layers.0.mlp.down_proj.weight_scale_inv", "weight_scale_inv", 1, 128, 256) == (1, 1, 2)
    with pytest.raises(WeightFormatError, match="layers.0.mlp.down_proj.weight.*column 64 cuts a 128-wide"):
        fmt.part_slice("layers.0.mlp.down_proj.weight", "weight", 1, 64, 128)
    with pytest.raises(WeightFormatError, match="column 16 cuts a 32-wide"):
        Int4Group(32).part_slice("o_proj.weight_packed", "weight_packed", 1, 16, 32)


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _ct(weights: dict, fmt: str = "pack-quantized", **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **extra}}, "ignore": ["lm_head"]}


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


def test_the_release_configs_parse_into_their_formats() -> None:
    assert parse_quantization({"quantization_config": FP8}).describe() == "fp8: fp8-e4m3-block128x128"
    assert parse_quantization({"quantization_config": _ct(INT4)}).describe() == "compressed-tensors: int4-group32-sym"
    channel = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    acts = {"input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    assert parse_quantization({"quantization_config": _ct(channel, "float-quantized", **acts)}).describe() == \
        "compressed-tensors: fp8-e4m3-per-channel"
    assert parse_quantization({"text_config": {"quantization_config": FP8}}) is not None  # a VLM's text config
    assert parse_quantization({}) is None


def test_deepseek_v4s_release_reads_fp4_experts_and_scales_named_scale() -> None:
    """``expert_dtype: fp4`` (in the quantization_config, or at the top level as V4 ships it) makes the routed
    experts MXFP4 bytes; every other linear with a ``scale`` beside its ``weight`` is FP8 blocks; a ``scale`` with
    no ``weight`` beside it (an mHC parameter) is no weight's scale."""
    from strata.pipeline.models.quant_loading import quantized_modules
    from strata.pipeline.models.weight_formats import MXFP4

    v4 = {**FP8, "scale_fmt": "ue8m0"}
    scheme = parse_quantization({"quantization_config": v4, "expert_dtype": "fp4"})
    assert scheme.describe() == "fp8: fp8-e4m3-block128x128, mxfp4-e2m1-group32"
    assert parse_quantization({"quantization_config": {**v4, "expert_dtype": "fp4"}}) == scheme
    names = [(f"layers.0.{m}", f"layers.0.{o}") for m, o in (
        ("ffn.experts.3.w1.weight", "mlp.experts.3.w1.weight"), ("ffn.experts.3.w1.scale", "mlp.experts.3.w1.scale"),
        ("attn.wq_a.weight", "self_attn.q_a_proj.weight"), ("attn.wq_a.scale", "self_attn.q_a_proj.scale"),
        ("attn_hc.scale", "attn_hc.scale"))]
    formats = quantized_modules(scheme, names)
    assert formats == {"layers.0.mlp.experts": MXFP4("weight", "scale"),
                       "layers.0.self_attn.q_a_proj": FP8Block(128, 128, "scale")}
    assert parse_quantization({"quantization_config": FP8}).format_for("model.layers.0.mlp.experts.3.down_proj") == \
        FP8Block(128, 128)  # V3's experts: FP8 like the rest
    from strata.bringup.weight_format_report import format_lines

    lines, unclaimed = format_lines({"quantization_config": v4, "expert_dtype": "fp4"}, [c for c, _ in names])
    assert [need for _, need, _ in lines[1:]] == ["layers.*.attn.wq_a in fp8-e4m3-block128x128 (1)",
                                                  "layers.*.ffn.experts.*.w1 in mxfp4-e2m1-group32 (1)"]
    assert unclaimed == []  # what ops prints is what the loader reads


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not implemented"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not implemented"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ({**FP8, "fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**FP8, "weight_block_size": None}, "without weight_block_size"),
    ({**FP8, "weight_block_size": [128, 0]}, "two positive integers"),
    ({**FP8, "expert_dtype": "fp6"}, "fp8 expert_dtype 'fp6' is not implemented"),
    ({**FP8, "scale_fmt": "ue5m3"}, "fp8 scale_fmt 'ue5m3' is not implemented"),
    (_ct({**INT4, "num_bits": 8}), "pack-quantized int8 group is not implemented"),
    (_ct({**INT4, "strategy": "channel"}), "pack-quantized int4 channel is not implemented"),
    (_ct({**INT4, "group_size": 0}), "positive group_size"),
    (_ct({**INT4, "actorder": "group"}), "actorder 'group'"),
    (_ct(INT4, input_activations={"num_bits": 8, "type": "float", "dynamic": False}), "static input activation"),
    ({**_ct(INT4), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({**_ct(INT4), "quantization_status": "frozen"}, "quantization_status 'frozen'"),
    (_ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}, "nvfp4-pack-quantized"),
     "nvfp4-pack-quantized float4 group is not implemented"),
])
def test_what_is_not_implemented_is_refused_in_one_line(config: dict, named: str) -> None:
    with pytest.raises(ModelConfigError, match=named) as exc:
        parse_quantization({"quantization_config": config})
    assert "\n" not in str(exc.value)


def test_a_marked_tensor_in_an_ignored_module_is_refused() -> None:
    scheme = parse_quantization({"quantization_config": {**_ct(INT4), "ignore": ["re:.*self_attn.*"]}})
    assert scheme.format_of("model.layers.0.mlp.experts.3.up_proj", "weight_packed") == Int4Group(32, True)
    with pytest.raises(ModelConfigError, match="ignore list says model.layers.0.self_attn.q_proj is not quantized"):
        scheme.format_of("model.layers.0.self_attn.q_proj", "weight_packed")


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel", "int4", "int4-asym", "mxfp4"])
def test_every_format_reads_what_compressed_tensors_writes(fmt: str) -> None:
    """A weight encoded by compressed-tensors (the library vLLM and llm-compressor use), read by the format the
    config names: Strata's dequantization equals the library's decompression bit for bit, and the decode
    kernel's product equals the tiled reference (blocks of 16 over 40 x 96: a partial last row block)."""
    from strata.checkpoints.quantized_checkpoint import decompress, encode, recipe

    g = torch.Generator().manual_seed(11)
    dense = {"layer.proj.weight": torch.randn(40, 96, generator=g) * 0.05}
    r = recipe(fmt, block=16, group=32)
    encoded, ct_config = encode(dense, ["layer.proj"], r)
    parts = {k.rpartition(".")[2]: v for k, v in encoded.items()}
    quant = ct_config.model_dump(exclude_none=True)
    scheme = parse_quantization({"quantization_config": {**quant, "quant_method": "compressed-tensors"}})
    marker = next(m for m in scheme.markers() if m in parts)
    weight = scheme.format_of("layer.proj", marker).build("layer.proj", 40, 96, parts)
    assert torch.equal(weight.dequantize(), decompress(parts, quant))
    # resident: the stored tensors, with asymmetric zero points a byte each
    stored = sum(t.numel() * t.element_size() for k, t in parts.items() if k not in ("weight_shape", "weight_zero_point"))
    extra = {"int4-asym": 40 * 3}.get(fmt, 0)
    assert weight.nbytes == stored + extra
    x = torch.randn(2, 96, generator=g)
    scale_of_sum = (x.abs() @ weight.dequantize().abs().T).max().item()
    assert (quant_linear(x, weight) - tiled_linear(x, weight, kernels=False)).abs().max().item() <= 1e-6 * scale_of_sum
    # the C++ tile a prefill multiplies by is the torch tile, bit for bit, from any row
    assert torch.equal(dequantize_rows(weight, 3, 37, torch.float32), weight.tile(3, 37, torch.float32))
