"""Linear layers for the decoder: a weight-streaming GEMV for small decode batches on the CPU.

With a few tokens per step a linear layer is bound by reading its weights; on the CPU this project
is measured on, torch's GEMM path reads them at ~11 GB/s while ``csrc/small_linear_cpu.cpp`` streams
them at ~30 GB/s (near the machine's copy bandwidth), which is most of a batch-1 decode step. Larger
batches, other devices, and code being traced by ``torch.compile`` use ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.quant_linear import quant_linear
from strata.kernels.quant_weight import QuantWeight

SMALL_ROWS = 8  # most rows of x the streaming kernel takes (beyond it, GEMM blocking wins)
_NO_BIAS = torch.empty(0)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x``; the streaming kernel when it applies; a weight kept
    quantized is dequantized tile by tile inside the product (``kernels.quant_linear``)."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias)
    if (x.shape[0] <= SMALL_ROWS and x.dim() == 2 and x.device.type == "cpu" and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()):
        kernels = cpu_kernels()
        if kernels is not None:
            b = _NO_BIAS if bias is None else bias.float()
            return kernels.small_linear(x.float().contiguous(), weight, b).to(x.dtype)
    return F.linear(x, weight, bias)
