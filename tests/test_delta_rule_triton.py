"""The Triton decode step of the gated delta rule (CUDA's path for Gated DeltaNet) against the torch step, run
on CPU in Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported, so the check runs
in a child process): states read from one strided pool slot and written to another, head widths that are not
powers of two and wider than one program's columns, a decay per head (Gated DeltaNet) and per key channel
(KDA), the slots read left as they were. On a CUDA machine the same cases run compiled."""

from __future__ import annotations

import pytest
import torch
from helpers import kernel_check

pytestmark = pytest.mark.slow

_CHECK = r"""
import json, sys
import torch
from strata.kernels.delta_rule import delta_rule_step, l2_normalize
from strata.kernels.delta_rule_triton import triton_delta_rule_step
device = sys.argv[1]
g = torch.Generator().manual_seed(0)
results = []
for b, h, dk, dv, per_channel in ((1, 2, 16, 16, False), (3, 4, 24, 40, False), (2, 1, 128, 128, False),
                                  (3, 4, 24, 40, True)):
    tensors = torch.randn(2 * b, 3, h, dk, dv, generator=g)
    pool = tensors[:, 1]  # one layer's view of the pool: strided between slots
    q, k = l2_normalize(torch.randn(b, h, dk, generator=g)), l2_normalize(torch.randn(b, h, dk, generator=g))
    v, beta = torch.randn(b, h, dv, generator=g), torch.rand(b, h, generator=g)
    gg = -torch.rand(*((b, h, dk) if per_channel else (b, h)), generator=g)
    read, write = torch.arange(b), torch.arange(b, 2 * b)
    want, want_state = delta_rule_step(q, k, v, gg, beta, pool[read])
    dev = tensors.to(device)
    out = triton_delta_rule_step(*(t.to(device) for t in (q, k, v, gg, beta)), dev[:, 1], read.to(device), write.to(device))
    got = dev.cpu()
    results.append({"shape": [b, h, dk, dv, per_channel], "out": (out.cpu() - want).abs().max().item(),
                    "state": (got[:, 1][write] - want_state).abs().max().item(),
                    "read_kept": bool(torch.equal(got[:, 1][read], pool[read])),
                    "others_kept": bool(torch.equal(got[:, [0, 2]], tensors[:, [0, 2]]))})
print(json.dumps(results))
"""


def _check(results: list[dict]) -> None:
    assert len(results) == 4
    for r in results:
        assert r["out"] <= 1e-5 and r["state"] <= 1e-5 and r["read_kept"] and r["others_kept"], r


def test_the_triton_step_equals_the_torch_step_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    _check(kernel_check(_CHECK, "cpu", interpret=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_triton_step_equals_the_torch_step_on_cuda() -> None:
    _check(kernel_check(_CHECK, "cuda", interpret=False))
