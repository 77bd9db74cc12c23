"""The Triton quantized-linear kernel (CUDA's path for every weight format) against the torch reference,
run on CPU in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported, so the
check runs in a child process). Every layout the CPU streaming kernels are tested on (partial FP8 blocks,
fused rows with a scale-row map, narrow blocks, INT4 groups with and without zero points, MXFP4, GGUF
blocks) plus FP8 per-channel rows, with 1, 5 and 37 rows of x, with and without a bias. On a CUDA
machine the same cases run compiled, in fp32 and bf16."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_python

pytestmark = pytest.mark.slow

_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from quant_cases import streamed_weights
from strata.kernels.quant_linear import tiled_linear
from strata.kernels.quant_linear_triton import triton_quant_linear
from strata.kernels.quant_weight import FP8RowWeight
device, dtype = sys.argv[2], getattr(torch, sys.argv[3])
g = torch.Generator().manual_seed(0)
codes = (torch.randn(72, 136, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
weights = [*streamed_weights(), FP8RowWeight(72, 136, codes, torch.rand(72, generator=g) + 0.01)]
results = []
for w in weights:
    for rows in (1, 5, 37):
        x = torch.randn(rows, w.cols, generator=g)
        bias = torch.randn(w.rows, generator=g) if rows == 5 else None
        want = tiled_linear(x.to(dtype).float(), w, bias, kernels=False)
        dev = type(w)(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v) for f, v in vars(w).items()})
        got = triton_quant_linear(x.to(device, dtype), dev, None if bias is None else bias.to(device)).float().cpu()
        scale_of_sum = (x.abs() @ w.dequantize().abs().T).max().item()
        results.append({"weight": f"{type(w).__name__} {w.shape}", "rows": rows,
                        "err": (got - want).abs().max().item() / scale_of_sum})
print(json.dumps(results))
"""


def _run(device: str, dtype: str, env: dict[str, str]) -> list[dict]:
    from helpers import REPO

    res = run_python("-c", _CHECK, str(REPO / "tests"), device, dtype, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_triton_quant_kernel_equals_the_reference_in_the_interpreter() -> None:
    """fp32 dots in IEEE fp32: the reference to summation order (a few ulps of the sum of magnitudes)."""
    pytest.importorskip("triton")
    results = _run("cpu", "float32", {"TRITON_INTERPRET": "1"})
    assert len(results) == 3 * 17
    for r in results:
        assert r["err"] <= 1e-6, r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_the_triton_quant_kernel_equals_the_reference_on_cuda(dtype: str, tol: float) -> None:
    for r in _run("cuda", dtype, {}):
        assert r["err"] <= tol, r
