#!/bin/bash
# final device call of session 9: the GPU suite (CUDA + Vulkan), TVM's WGSL ragged prefill probe,
# the Vulkan A/B of the RMSNorm/argmax change (scratch/vkp: before, scratch/vkp2: after)
set -u
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
S=$(date +%s); st() { echo "[$(( $(date +%s)-S ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$OUTDIR/pip.log" 2>&1 || { tail "$OUTDIR/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
git log -1 --format=%H > "$OUTDIR/commit.txt" 2>/dev/null
timeout 420 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache PY=python3 > "$OUTDIR/gpu_suite.log" 2>&1
st "GPU suite rc=$?"; tail -n 25 "$OUTDIR/gpu_suite.log" | cut -c1-300
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 || export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export LLMCHAT_CACHE_DIR=/tmp/llmchat-cache
timeout 120 python3 scratch/probe/ragged_check.py > "$OUTDIR/ragged_probe.log" 2>&1; st "ragged probe rc=$?"; cat "$OUTDIR/ragged_probe.log" | grep -v XDG | tail -12
for round in 1 2; do for v in vkp vkp2; do
  timeout 100 python3 benchmarks/vulkan_profile.py --cache scratch/$v --presets qwen2.5-0.5b,llama2-7b --steps 64 > "$OUTDIR/ab_${v}_r$round.log" 2>&1
  st "A/B $v r$round rc=$?"; grep -o '"preset": "[^"]*", "steps": 64, "ms_per_step": [0-9.]*' "$OUTDIR/ab_${v}_r$round.log"
done; done
LLMCHAT_WEBGPU_PROFILE=1 timeout 100 python3 benchmarks/vulkan_profile.py --cache scratch/vkp2 --presets qwen2.5-0.5b,llama2-7b --steps 64 > "$OUTDIR/profile_vkp2.log" 2>&1; st "profile rc=$?"
grep '"kernels"' "$OUTDIR/profile_vkp2.log" | cut -c1-700
