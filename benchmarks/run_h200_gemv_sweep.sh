#!/bin/bash
# The WGSL decode-GEMV variant sweep (benchmarks/wgsl_gemv_sweep.py) on the H200 through NVIDIA's
# Vulkan driver, with a runtime-only TVM: ~2 minutes, ~6 with the whole-model phase (under 10).
#
# Prepare here (the TVM compiler, no GPU; ~4 minutes on 2 cores, ~10 MB):
#   python benchmarks/wgsl_gemv_sweep.py compile --out scratch/gemv_sweep
#   .whl/: cp312 wheels (apache-tvm repacked runtime-only, apache-tvm-ffi, platformdirs, wgpu, ...)
#   .gl/:  the Vulkan loader and libglvnd .debs (as for benchmarks/run_h200_vulkan.sh)
#   and, for the whole-model A/B of the WGSL GEMV default (optional; ~20-40 s each here, ~2 MB each):
#   python benchmarks/gpu_decode.py compile --cache scratch/vk_new/cache --arch wgsl-f16-wg49152-t256 \
#       --presets llama2-7b --plain ""
#   python benchmarks/gpu_decode.py compile --cache scratch/vk_new/cache --arch sm_90 --presets llama2-7b --plain ""
#   LLMCHAT_WGSL_GEMV=t32-b256-l16-u4 python benchmarks/gpu_decode.py compile --cache scratch/vk_old/cache \
#       --arch wgsl-f16-wg49152-t256 --presets llama2-7b --plain ""
# Device tool (nvidia-h200, timeout_s 600): carry [".whl", ".gl", "scratch/gemv_sweep", "scratch/vk_new",
#   "scratch/vk_old"], command  bash benchmarks/run_h200_gemv_sweep.sh scratch/gemv_sweep "$OUT"
#   (SWEEP=0 skips the GEMV sweep: then scratch/gemv_sweep need not be carried; SWEEP_ARGS are
#   passed to the sweep's run, e.g. "--assume-subgroup 32")
# Phases: the GEMV sweep (every variant checked against numpy, then timed); then, where the model
# caches are there, Llama-2-7B decode on Vulkan with the library of the new GEMV default (its logits
# checked against the CUDA library of the same random weights), the one of the layout before, the
# new one again (interleaved: the same session, A B A).
set -u
DIR=${1:-scratch/gemv_sweep}
OUTDIR=${2:-${OUT:-bench-out}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export LLMCHAT_CACHE_DIR=/tmp/llmchat-cache  # the add-on is built here, on this machine
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
python3 -m app.inference.backends.webgpu.addon > "$OUTDIR/addon_build.log" 2>&1 || {
  echo "add-on build failed"; tail -20 "$OUTDIR/addon_build.log"; exit 1; }
rc=0
if [ "${SWEEP:-1}" != 0 ]; then
timeout 400 python3 benchmarks/wgsl_gemv_sweep.py run --dir "$DIR" --out "$OUTDIR/gemv_sweep.json" ${SWEEP_ARGS:-} \
  > "$OUTDIR/gemv_sweep.log" 2>&1
rc=$?
echo "sweep rc=$rc (full table: gemv_sweep.log)"
grep "^adapter\|WRONG\|SKIPPED\|Error" "$OUTDIR/gemv_sweep.log" | head -20
sed -n '/^launch floor/,$p' "$OUTDIR/gemv_sweep.log"
[ $rc -ne 0 ] && tail -30 "$OUTDIR/gemv_sweep.log"
fi

decode() {  # NAME CACHE TIMEOUT [extra args]: Llama-2-7B decode tok/s on Vulkan from CACHE's library
  local name=$1 cache=$2 limit=$3; shift 3
  [ -f "$cache/manifest.json" ] || { echo "no $cache/manifest.json: $name skipped"; return; }
  timeout "$limit" python3 benchmarks/gpu_decode.py run --backend vulkan --cache "$cache" --presets llama2-7b \
    --plain "" --prompt 0 --repeats 2 --check-steps 8 --out "$OUTDIR/decode_$name.json" "$@" \
    > "$OUTDIR/decode_$name.log" 2>&1
  echo "decode $name rc=$?"; grep RESULT "$OUTDIR/decode_$name.log" | cut -c1-700
}
decode new scratch/vk_new/cache 200 --reference cuda
decode old scratch/vk_old/cache 120
decode new_again scratch/vk_new/cache 120
exit "$rc"
