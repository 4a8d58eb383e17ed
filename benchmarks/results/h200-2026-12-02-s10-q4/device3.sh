#!/bin/bash
# session 10, device call 3: per-kernel GPU time (LLMCHAT_WEBGPU_PROFILE=1) of the Vulkan libraries
# base / candA / auto (3B and 7B), then #18: Llama-3-8B CUDA decode after 0-8k tokens with the
# decode attention chosen by page count (auto) against the cluster kernel alone, rounds interleaved
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
S=$(date +%s); st() { echo "[$(( $(date +%s)-S ))s] $*"; }
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 || export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$O/pip.log" 2>&1 || { tail "$O/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LLMCHAT_CACHE_DIR=/tmp/llmchat-cache
git log -1 --format=%H > "$O/commit.txt" 2>/dev/null
nvidia-smi > "$O/nvidia-smi.txt" 2>&1
OLD="t8-b256-l16-u4-mb128,t8-b256-l4-u4-mb128-nopad-k8192-n4096"
for v in base candA auto; do
  case $v in base) unset LLMCHAT_WGSL_GEMV;; candA) export LLMCHAT_WGSL_GEMV=q4-r4-l32-t256-dp4a-kmax8191,q4-r4-l32-t256-f32,$OLD;; auto) export LLMCHAT_WGSL_GEMV=q4-auto,$OLD;; esac
  timeout 60 python3 benchmarks/vulkan_profile.py --cache scratch/vk/$v --presets qwen2.5-3b,llama2-7b --steps 64 > "$O/loop_$v.log" 2>&1
  st "loop $v rc=$?"; grep -o '"preset": "[^"]*", "steps": 64, "ms_per_step": [0-9.]*' "$O/loop_$v.log" | paste -sd' '
  LLMCHAT_WEBGPU_PROFILE=1 timeout 60 python3 benchmarks/vulkan_profile.py --cache scratch/vk/$v --presets qwen2.5-3b,llama2-7b --steps 64 > "$O/gpuprof_$v.log" 2>&1
  st "gpu profile $v rc=$?"
done
unset LLMCHAT_WGSL_GEMV
for round in 1 2; do for v in auto cluster; do
  LLMCHAT_CUDA_GQA_DECODE=$v timeout 150 python3 benchmarks/gpu_decode.py depth --cache scratch/c18/$v --presets llama3-8b --context 8448 \
    --prompts "" --depths 0,1024,4096,8192 --gen 128 --repeats 1 --out "$O/gqa_${v}_r$round.json" > "$O/gqa_${v}_r$round.log" 2>&1
  st "8B depth $v r$round rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=list(d['presets'].values())[0] if 'presets' in d else d; print({k: v['tok_s'] for k, v in r['decode_at_depth'].items()})" "$O/gqa_${v}_r$round.json"
done; done
cd "$O" && tar czf all.tgz *.log *.json *.txt 2>/dev/null; st end
