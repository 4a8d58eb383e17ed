#!/bin/bash
# The WGSL decode-GEMV variant sweep (benchmarks/wgsl_gemv_sweep.py) on the H200 through NVIDIA's
# Vulkan driver, with a runtime-only TVM: ~1-2 minutes.
#
# Prepare here (the TVM compiler, no GPU; ~4 minutes on 2 cores, ~10 MB):
#   python benchmarks/wgsl_gemv_sweep.py compile --out scratch/gemv_sweep
#   .whl/: cp312 wheels (apache-tvm repacked runtime-only, apache-tvm-ffi, platformdirs, wgpu, ...)
#   .gl/:  the Vulkan loader and libglvnd .debs (as for benchmarks/run_h200_vulkan.sh)
# Device tool: carry [".whl", ".gl", "scratch/gemv_sweep"], command
#   bash benchmarks/run_h200_gemv_sweep.sh scratch/gemv_sweep "$OUT"
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
timeout 400 python3 benchmarks/wgsl_gemv_sweep.py run --dir "$DIR" --out "$OUTDIR/gemv_sweep.json" ${SWEEP_ARGS:-} \
  > "$OUTDIR/gemv_sweep.log" 2>&1
rc=$?
echo "sweep rc=$rc (full table: gemv_sweep.log)"
grep "^adapter\|WRONG\|SKIPPED\|Error" "$OUTDIR/gemv_sweep.log" | head -20
sed -n '/^launch floor/,$p' "$OUTDIR/gemv_sweep.log"
[ $rc -ne 0 ] && tail -30 "$OUTDIR/gemv_sweep.log"
exit "$rc"
