#!/usr/bin/env bash
# One GPU session's checks of the Triton kernels: their tests compiled for the GPU (bfloat16 and
# large shapes included), then the CUDA benchmark suite. Extra arguments go to `octlm bench`:
#   scripts/gpu_check.sh --backends flash triton --lengths 4096 16384
# Needs CUDA builds of torch and Triton (PYTHON=... picks the interpreter). Logs and records go
# to $OUT when the device tool sets it, else to runs/. Exits non-zero if either step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-runs}
mkdir -p "$OUT"
"$PYTHON" -c 'import torch, triton; assert torch.cuda.is_available(), "torch sees no CUDA GPU"
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())' || exit 1
status=0
"$PYTHON" -m pytest -q -ra --durations=10 tests/attention/test_triton.py 2>&1 | tee "$OUT/gpu-tests.log" ||
    status=1
"$PYTHON" -m octlm bench cuda --output "$OUT/bench-cuda.jsonl" "$@" 2>&1 |
    tee "$OUT/gpu-bench.log" || status=1
exit "$status"
