"""Our Triton paged-attention kernel against the torch reference (bf16, fp32 and e4m3 caches), run on CPU in
Triton's interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported, so the check runs in a child process).
On a CUDA machine the same cases run compiled (``make gpu-check``)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_python

pytestmark = pytest.mark.slow

_CHECK = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
from helpers import BS, dense_reference
from strata.kernels import AttentionMetadata, get_attention_backend, merge_attention_states, write_kv
from strata.kernels.attention_triton import TritonAttentionBackend
device = sys.argv[2]
results = []
# latent: MLA's layout, one tensor passed as both keys and values (one "KV head"); fp8: an e4m3 cache
# (``kv_cache_dtype: fp8``) read by a query in ``dtype``
for hq, hkv, d, window, dtype, latent, fp8 in [
        (4, 2, 16, None, "float32", False, False), (6, 1, 24, 7, "float32", False, False),
        (8, 8, 32, None, "bfloat16", False, False), (8, 1, 40, None, "float32", True, False),
        (4, 1, 72, None, "bfloat16", True, False), (4, 2, 16, None, "float32", False, True),
        (8, 8, 32, 9, "bfloat16", False, True), (4, 1, 72, None, "float32", True, True)]:
    gen = torch.Generator().manual_seed(hq + d)
    # decodes, a whole prompt, chunks after context; the last two have spilled blocks before their table
    seq_lens, query_lens, spilled = [1, 17, 33, 50, 70], [1, 17, 1, 19, 30], [0, 0, 1, 0, 2]
    k_cache = torch.zeros(40, BS, hkv, d); v_cache = k_cache if latent else torch.zeros(40, BS, hkv, d)
    free = torch.randperm(40, generator=gen).tolist(); tables = []; slots = []
    for n, ql, sp in zip(seq_lens, query_lens, spilled):
        off = sp * BS
        blocks = [free.pop() for _ in range(-(-(n - off) // BS))]
        k = torch.randn(n, hkv, d, generator=gen); v = torch.randn(n, hkv, d, generator=gen)
        sl = torch.tensor([blocks[(p - off) // BS] * BS + (p - off) % BS for p in range(off, n)])
        write_kv(k_cache, v_cache, k[off:], v[off:], sl)
        tables.append(blocks); slots.extend(sl[len(sl) - ql:].tolist())
    dt = getattr(torch, dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, BS, device, kv_offsets=[s * BS for s in spilled])
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    cache_dt = torch.float8_e4m3fn if fp8 else dt
    kc = k_cache.to(device, cache_dt); vc = kc if latent else v_cache.to(device, cache_dt)
    args = (q.to(device, dt), kc, vc, meta, d ** -0.5, window)
    out, lse = TritonAttentionBackend().forward(*args, return_lse=True)
    cpu_meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, BS, "cpu", kv_offsets=[s * BS for s in spilled])
    kr = k_cache.to(cache_dt); vr = kr if latent else v_cache.to(cache_dt)
    ref, ref_lse = get_attention_backend("torch").forward(q.to(dt), kr, vr, cpu_meta, d ** -0.5, window, return_lse=True)
    results.append({"case": [hq, hkv, d, window, dtype, latent, fp8], "out": (out.float().cpu() - ref.float()).abs().max().item(),
                    "lse": (lse.cpu() - ref_lse).abs().max().item()})
print(json.dumps(results))
"""


def _run(device: str, env: dict[str, str]) -> list[dict]:
    from helpers import REPO

    res = run_python("-c", _CHECK, str(REPO / "tests"), device, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_triton_kernel_equals_the_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    for r in _run("cpu", {"TRITON_INTERPRET": "1"}):
        tol = 1e-5 if r["case"][4] == "float32" else 2e-2
        assert r["out"] < tol and r["lse"] < 1e-4, r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_triton_kernel_equals_the_reference_on_cuda() -> None:
    for r in _run("cuda", {}):
        tol = 1e-4 if r["case"][4] == "float32" else 2e-2
        assert r["out"] < tol and r["lse"] < 1e-3, r


def test_heads_share_a_program_and_block_sizes_are_checked() -> None:
    """Query heads of one KV head share a program (each K/V block is read once for the group), within
    a register-sized tile; a block size the kernel cannot tile is a clear error, not a wrong answer."""
    pytest.importorskip("triton")
    from strata.kernels import AttentionMetadata
    from strata.kernels.attention_triton import TritonAttentionBackend, heads_per_program

    assert [heads_per_program(g, 128) for g in (1, 2, 4, 6, 8, 16)] == [1, 2, 4, 2, 8, 8]
    assert heads_per_program(128, 1024) == 1  # MLA's latent (576 -> 1024 wide): one head per program
    meta = AttentionMetadata.build([1], [24], [[0, 1]], [23], 24)
    kv = torch.zeros(2, 24, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        TritonAttentionBackend().forward(torch.zeros(1, 2, 16), kv, kv, meta, 0.25)
