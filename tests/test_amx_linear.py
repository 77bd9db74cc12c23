"""The AMX bf16 linear kernel (``csrc/amx_linear_cpu.cpp``) against the torch reference, and its routing.

A bf16 model's decode linears run on it for up to ``AMX_ROWS`` rows where the CPU has AMX: every shape
it takes must equal an fp32-accumulated product of the same bf16 values, and a row's result must not
depend on the rows beside it (speculative verification and batch-invariant greedy answers rely on it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import linear
from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.linear import AMX_ROWS, SMALL_ROWS

_KERNELS = cpu_kernels()
_AMX = _KERNELS is not None and _KERNELS.amx_bf16_available()
needs_amx = pytest.mark.skipif(not _AMX, reason="this CPU or kernel has no AMX bf16 tiles")


def _cpu_has_amx_flags() -> bool:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return {"amx_tile", "amx_bf16"} <= set(flags.split())


def _case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    return x, w, torch.randn(n, generator=gen)


@pytest.mark.skipif(_KERNELS is None, reason="no C++ toolchain here")
def test_amx_is_used_exactly_where_the_cpu_offers_it() -> None:
    """Availability follows the CPU's flags (Linux grants the tile state on request), so a host with AMX
    never silently runs the slower path, and one without never reaches the tile instructions."""
    assert _KERNELS.amx_bf16_available() == _cpu_has_amx_flags()
    if not _AMX:
        x, w, b = _case(2, 16, 32, 0)
        with pytest.raises(RuntimeError, match="AMX bf16 tiles are not available"):
            _KERNELS.amx_bf16_linear(x, w, b)


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 31, 32, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (96, 576), (64, 1536)])
def test_amx_linear_equals_the_fp32_product_of_its_bf16_inputs(rows: int, n: int, k: int) -> None:
    """One output block or an odd count of them, one or two groups of x rows and more than one pass
    over W: all within fp32 rounding of the exact product (plus the fp32 bias)."""
    x, w, b = _case(rows, n, k, rows * 1000 + n + k)
    out = _KERNELS.amx_bf16_linear(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert ((out.double() - exact).abs() <= bound).all()
    no_bias = _KERNELS.amx_bf16_linear(x, w, torch.empty(0))
    torch.testing.assert_close(no_bias, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-4)


@needs_amx
def test_an_amx_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """Bit for bit, for every batch size the decode path sends to the kernel."""
    x, w, b = _case(AMX_ROWS, 96, 576, 5)
    alone = torch.cat([linear(x[r : r + 1], w, b.bfloat16()) for r in range(AMX_ROWS)])
    for rows in (2, 8, 9, 16, 17, 32, 33, AMX_ROWS):
        assert torch.equal(linear(x[:rows], w, b.bfloat16()), alone[:rows]), rows
        assert torch.equal(linear(x[rows - 1 : AMX_ROWS], w, b.bfloat16()), alone[rows - 1 :]), rows


@needs_amx
def test_bf16_decode_linears_take_the_amx_kernel_and_the_rest_keep_their_path() -> None:
    x, w, b = _case(12, 96, 576, 9)
    assert torch.equal(linear(x, w, b.bfloat16()), _KERNELS.amx_bf16_linear(x, w, b.bfloat16().float()).bfloat16())
    # fp32 activations with bf16 weights would lose precision in bf16 tiles: the streaming kernel keeps them
    x32 = x[:SMALL_ROWS].float()
    assert torch.equal(linear(x32, w), _KERNELS.small_linear(x32, w, torch.empty(0)))
    # shapes off the tile grid, and prefill-sized batches, stay on their previous paths
    odd_k, odd_w, _ = _case(4, 96, 200, 10)
    assert torch.equal(linear(odd_k, odd_w), _KERNELS.small_linear(odd_k.float(), odd_w, torch.empty(0)).bfloat16())
    big, _, _ = _case(AMX_ROWS + 1, 96, 576, 11)
    assert torch.equal(linear(big, w), F.linear(big, w))
