#!/usr/bin/env bash
# Every kernel and bench that matters on CUDA, in one run (under ten minutes on one GPU), as one table:
# the Triton fused Linear, int8 _int_mm, fp8 _scaled_mm, the nvfp4 path, one H3 step at the released
# layer width, then bench/kernels.py, quantized.py, sparse_attention.py and memory.py on the GPU
# (bench/gpu_check.py says what each measures). On a machine without a CUDA device it says so and
# exits 0. Run from anywhere: bash bench/gpu_check.sh [--skip-children]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device on this machine; nothing to measure (run it where a GPU is present)"
    exit 0
fi
exec timeout 600 "$PYTHON" bench/gpu_check.py "$@"
