#!/usr/bin/env bash
# The checks that need a CUDA device, in one run of at most ~8 minutes: the CUDA tests (our Triton kernel
# compiled (attention, fp8 KV reads, the quantized linear), each attention backend against the reference in
# fp32 and bf16 (vendor kernels if installed),
# numerics, bf16, compiled steps, tp=2 on the device, the tier path) and the decode roofline benchmark.
# Run it whenever a GPU machine is available: `make gpu-check` (after `make install`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('device:', torch.cuda.get_device_name(0))"
"$PY" -c "import torch; from strata.kernels import available_backends as a; print('attention backends on cuda:', 'fp32', a('cuda'), 'bf16', a('cuda', torch.bfloat16))"
timeout 420 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_kernels_triton.py tests/test_quant_linear_triton.py \
    --junitxml "$OUT/cuda-tests.xml"
timeout 240 "$PY" -m strata bench offline --device cuda --sections throughput prefill bandwidth \
    --models small --dtypes float32 bfloat16 --batches 1 32 --repeats 1 --json "$OUT/bench-offline-cuda.json"
