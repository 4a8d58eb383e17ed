#!/bin/bash
# session 10, device call 5: the GPU suite (CUDA kernels incl. the GQA decode choice, engines, the
# ROCm twin, Vulkan with the new GEMV default) from scratch/gpu-test-cache (`make gpu-cache` here)
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
S=$(date +%s); st() { echo "[$(( $(date +%s)-S ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$O/pip.log" 2>&1 || { tail "$O/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
git log -1 --format=%H > "$O/commit.txt" 2>/dev/null
timeout 520 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache PY=python3 > "$O/gpu_suite.log" 2>&1
st "GPU suite rc=$?"; tail -n 30 "$O/gpu_suite.log" | cut -c1-300
