#!/bin/bash
# session 10, device call 1: the hand-scheduled WGSL GEMV sweep (scratch/q4sweep, made by
# `wgsl_gemv_sweep.py compile --out scratch/q4sweep --profiles wgsl-f16-wg49152-t256 --variants current,<Q4_SWEEP>`)
# and the decode attention A/B (split-v1 vs split-v2) on Qwen2.5-0.5B / 3B (scratch/vk/attn_v1, attn_v2)
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
S=$(date +%s); st() { echo "[$(( $(date +%s)-S ))s] $*"; }
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 || export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$O/pip.log" 2>&1 || { tail "$O/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LLMCHAT_CACHE_DIR=/tmp/llmchat-cache
nvidia-smi --query-gpu=name,driver_version --format=csv > "$O/nvidia-smi.txt" 2>&1
git log -1 --format=%H > "$O/commit.txt" 2>/dev/null
st start
timeout 240 python3 benchmarks/wgsl_gemv_sweep.py run --dir scratch/q4sweep --out "$O/q4sweep.json" > "$O/q4sweep.log" 2>&1
st "sweep rc=$?"; grep -A8 "^best per shape (against" "$O/q4sweep.log"; grep -E "WRONG|FAILED|floor" "$O/q4sweep.log" | head -5
for round in 1 2; do for v in v1 v2; do
  if [ $v = v1 ]; then export LLMCHAT_WGSL_ATTENTION=split-v1; else unset LLMCHAT_WGSL_ATTENTION; fi
  timeout 60 python3 benchmarks/vulkan_profile.py --cache scratch/vk/attn_$v --presets qwen2.5-0.5b,qwen2.5-3b --steps 64 > "$O/prof_${v}_r$round.log" 2>&1
  st "profile $v r$round rc=$?"; grep -o '"preset": "[^"]*", "steps": 64, "ms_per_step": [0-9.]*' "$O/prof_${v}_r$round.log"
done; done
for v in v1 v2; do
  if [ $v = v1 ]; then export LLMCHAT_WGSL_ATTENTION=split-v1; else unset LLMCHAT_WGSL_ATTENTION; fi
  LLMCHAT_WEBGPU_PROFILE=1 timeout 60 python3 benchmarks/vulkan_profile.py --cache scratch/vk/attn_$v --presets qwen2.5-0.5b,qwen2.5-3b --steps 64 > "$O/gpuprof_$v.log" 2>&1
  st "gpu profile $v rc=$?"; grep '"kernels"' "$O/gpuprof_$v.log" | cut -c1-420
  timeout 120 python3 benchmarks/gpu_decode.py run --backend vulkan --cache scratch/vk/attn_$v --presets qwen2.5-0.5b,qwen2.5-3b --prompt 0 --repeats 2 --out "$O/run_$v.json" > "$O/run_$v.log" 2>&1
  st "run $v rc=$?"; grep -i "tok/s" "$O/run_$v.log" | tail -4
done
cd "$O" && tar czf all.tgz *.log *.json *.txt 2>/dev/null; st end
