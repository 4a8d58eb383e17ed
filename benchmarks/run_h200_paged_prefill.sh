#!/bin/bash
# Prompts at depth on one NVIDIA GPU (written for the H200): prefill tok/s of prompts of N tokens
# (llama-bench's -p N) with each way of running a prompt chunk's attention to the cached pages
# (issue #18): `tvm` (TVM's batch_prefill_paged_kv, CUDA cores: the code before), `sync`
# (llmchat::prefill_paged_attention, tensor cores) and `async` (the same, its key tiles copied by
# cp.async: the default). One process per mode, the modes interleaved round by round.
#
# Prepare on a machine with the TVM compiler and nvcc (no GPU needed), one library cache per mode:
#   for mode in sync async tvm; do LLMCHAT_CUDA_PAGED_PREFILL=$mode .venv/bin/python \
#     benchmarks/gpu_decode.py compile --cache scratch/pf-depth/$mode --arch sm_90 \
#     --presets llama2-7b,llama3-8b --plain "" --context 8448; done
#   .whl/: the wheels for the GPU machine (see run_h200.sh)
# Run on the GPU machine from the repository root (carry .whl and scratch/pf-depth):
#   bash benchmarks/run_h200_paged_prefill.sh OUTDIR
# Environment: PRESETS (default llama2-7b), PROMPTS (4096,8192), MODES ("tvm sync async"),
# ROUNDS (1), CACHE_ROOT (scratch/pf-depth).
set -u
OUTDIR=${1:-${OUT:-pf-out}}
PRESETS=${PRESETS:-llama2-7b}
PROMPTS=${PROMPTS:-4096,8192}
MODES=${MODES:-tvm sync async}
ROUNDS=${ROUNDS:-1}
CACHE_ROOT=${CACHE_ROOT:-scratch/pf-depth}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
START=$(date +%s)
for round in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    log="$OUTDIR/pf_${mode}_r$round.log"
    timeout 240 python3 benchmarks/gpu_decode.py depth --cache "$CACHE_ROOT/$mode" --presets "$PRESETS" \
      --plain "" --context 8448 --prompts "$PROMPTS" --depths "" --repeats 3 \
      --out "$OUTDIR/pf_${mode}_r$round.json" > "$log" 2>&1
    rc=$?
    echo "[$(( $(date +%s) - START ))s] $mode round $round rc=$rc"
    grep -E "PREFILL|Error|error" "$log" | cut -c1-300 | sed "s/^/  $mode: /"
  done
done
