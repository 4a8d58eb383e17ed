#!/bin/bash
# llmchat on Vulkan (TVM's WGSL + llmchat's WebGPU device API on wgpu-native, NVIDIA's Vulkan
# driver) next to llama.cpp's Vulkan backend and llmchat's CUDA path, one H200, random weights.
#
# Prepare here (a machine with the TVM compiler and nvcc; no GPU needed):
#   python benchmarks/gpu_decode.py compile --cache scratch/vk/cache --arch wgsl-f16-wg49152-t256 \
#       --presets qwen2.5-0.5b,qwen2.5-3b,llama2-7b --plain ""
#   python benchmarks/gpu_decode.py compile --cache scratch/vk/cache --arch sm_90 --presets ... --plain ""
#   LLMCHAT_GPU_GEMV=llmchat python benchmarks/gpu_decode.py compile --cache scratch/vk/cache_gemv \
#       --arch wgsl-f16-wg49152-t256 --presets ... --plain ""
#   python benchmarks/gpu_decode.py wgsl-copy --build scratch/vk/wgsl_copy.so
#   .whl/: cp312 wheels (apache-tvm repacked runtime-only, apache-tvm-ffi, platformdirs, wgpu, gguf)
#   .gl/: the Vulkan loader and libglvnd .debs (device README)
#   scratch/vk/lcpp/: llama-bench-vulkan.xz (../shared/bench-tools) and llama.cpp-gguf.tgz (gguf-py
#     and models/ggml-vocab-{llama-spm,qwen2}.gguf from PyPI's llama-cpp-python 0.3.36 sdist)
# Run on the GPU machine from the repository root:  bash benchmarks/run_h200_vulkan.sh PHASE OUTDIR
#   PHASE vulkan: copy bandwidths, llmchat on Vulkan (the product's schedules), llama.cpp Vulkan
#     (FA=1: llama.cpp with flash attention only, its faster setting on every shape so far; default 0,1)
#   PHASE all:    both, one after the other
#   PHASE cuda:   llmchat on Vulkan checked against the CUDA library of the same random weights
#                 (logits, greedy tokens), with the CUDA figures of the same run
set -u
PHASE=${1:-vulkan}
OUTDIR=${2:-${OUT:-bench-out}}
PRESETS=${PRESETS:-qwen2.5-0.5b,qwen2.5-3b,llama2-7b}
WORK=${WORK:-/tmp/bench}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONUNBUFFERED=1
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export LLMCHAT_CACHE_DIR=/tmp/llmchat-cache  # the add-on is built here, on this machine
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total,power.limit \
  --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
python3 -m app.inference.backends.webgpu.addon > "$OUTDIR/addon_build.log" 2>&1
stamp "add-on built (rc=$?)"
python3 -c "import json; from app.inference.backends import webgpu; \
print(json.dumps([a.as_dict() for a in webgpu.adapters()], indent=1))" > "$OUTDIR/adapters.json" \
  2>> "$OUTDIR/errors.log"
stamp "adapters: $(grep -c '"name"' "$OUTDIR/adapters.json")"

if [ "$PHASE" = vulkan ] || [ "$PHASE" = all ]; then
  WBW=$(timeout 60 python3 benchmarks/gpu_decode.py wgsl-copy --lib scratch/vk/wgsl_copy.so 2>>"$OUTDIR/errors.log")
  CBW=$(timeout 60 python3 benchmarks/gpu_decode.py copy-bw 2>>"$OUTDIR/errors.log")
  echo "{\"wgsl_copy_TBps\": ${WBW:-null}, \"cuda_copy_TBps\": ${CBW:-null}}" > "$OUTDIR/copy_bw.json"
  stamp "copy bandwidth: WGSL ${WBW} TB/s, CUDA ${CBW} TB/s"
  timeout 260 python3 benchmarks/gpu_decode.py run --backend vulkan --cache "${VK_CACHE:-scratch/vk/cache}" \
    --presets "$PRESETS" --plain "" --check-steps 8 --copy-bw "${WBW:-0}" \
    --out "$OUTDIR/vulkan.json" > "$OUTDIR/vulkan.log" 2>&1
  stamp "llmchat vulkan done (rc=$?)"; grep RESULT "$OUTDIR/vulkan.log" | cut -c1-300

  tar xzf scratch/vk/lcpp/llama.cpp-gguf.tgz -C "$WORK"
  LC=$WORK/llama.cpp
  BENCH=$WORK/llama-bench
  xz -dc scratch/vk/lcpp/llama-bench-vulkan.xz > "$BENCH" && chmod +x "$BENCH"
  echo "[" > "$OUTDIR/llamacpp_vulkan.json"; first=1
  for p in ${PRESETS//,/ }; do
    timeout 60 python3 benchmarks/gpu_decode.py make-gguf --preset "$p" --gguf-py "$LC/gguf-py" \
      --vocab-dir "$LC/models" --out "$WORK/$p.gguf" >> "$OUTDIR/gguf.log" 2>&1
    timeout 75 "$BENCH" -m "$WORK/$p.gguf" -p 512 -n 512 -ngl 99 -r 3 -fa "${FA:-0,1}" -o json \
      > "$WORK/$p.json" 2>> "$OUTDIR/llamacpp_bench.log"
    [ $first -eq 0 ] && echo "," >> "$OUTDIR/llamacpp_vulkan.json"; first=0
    sed -e '1s/^\[//' -e '$s/\]$//' "$WORK/$p.json" >> "$OUTDIR/llamacpp_vulkan.json"
    rm -f "$WORK/$p.gguf"
    stamp "llama-bench (Vulkan) $p"
  done
  echo "]" >> "$OUTDIR/llamacpp_vulkan.json"
fi

if [ "$PHASE" = cuda ] || [ "$PHASE" = all ]; then
  timeout 400 python3 benchmarks/gpu_decode.py run --backend vulkan --reference cuda \
    --cache "${VK_CACHE:-scratch/vk/cache}" --presets "$PRESETS" --plain "" --check-steps 16 --repeats 2 \
    --out "$OUTDIR/vulkan_vs_cuda.json" > "$OUTDIR/vulkan_vs_cuda.log" 2>&1
  stamp "vulkan vs cuda (rc=$?)"; grep RESULT "$OUTDIR/vulkan_vs_cuda.log" | cut -c1-600
fi
# one file back (the device tool returns at most 8)
tar czf "$OUTDIR.tgz" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" && mv "$OUTDIR.tgz" "$OUTDIR/all.tgz"
stamp "done"
