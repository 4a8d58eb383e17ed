#!/bin/bash
# session 10, device call 4: the Vulkan path with the new GEMV default (scratch/vk/final) next to
# llama.cpp's Vulkan llama-bench, same session (benchmarks/run_h200_vulkan.sh vulkan), then the
# libraries with the GEMV rules before (scratch/vk/base2, LLMCHAT_WGSL_GEMV=the old two), bench protocol
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
S=$(date +%s); st() { echo "[$(( $(date +%s)-S ))s] $*"; }
pip_site() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$O/pip.log" 2>&1; }
pip_site || { tail "$O/pip.log"; exit 1; }
git log -1 --format=%H > "$O/commit.txt" 2>/dev/null
VK_CACHE=scratch/vk/final timeout 420 bash benchmarks/run_h200_vulkan.sh vulkan "$O/final"
st "run_h200_vulkan rc=$?"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LLMCHAT_CACHE_DIR=/tmp/llmchat-cache
ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 || export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
LLMCHAT_WGSL_GEMV=t8-b256-l16-u4-mb128,t8-b256-l4-u4-mb128-nopad-k8192-n4096 timeout 120 python3 benchmarks/gpu_decode.py run --backend vulkan --cache scratch/vk/base2 --presets qwen2.5-0.5b,qwen2.5-3b,llama2-7b --plain "" --prompt 0 --repeats 2 --out "$O/base2.json" > "$O/base2.log" 2>&1
st "base2 rc=$?"; grep -o '"decode_tok_s": [0-9.]*' "$O/base2.log" | paste -sd' '
timeout 100 python3 benchmarks/gpu_decode.py run --backend vulkan --cache scratch/vk/final --presets qwen2.5-0.5b,qwen2.5-3b,llama2-7b --plain "" --prompt 0 --repeats 2 --out "$O/final2.json" > "$O/final2.log" 2>&1
st "final again rc=$?"; grep -o '"decode_tok_s": [0-9.]*' "$O/final2.log" | paste -sd' '
cd "$O" && tar czf all.tgz $(find . -name "*.log" -o -name "*.json" -o -name "*.txt") 2>/dev/null; st end
