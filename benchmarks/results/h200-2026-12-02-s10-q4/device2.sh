#!/bin/bash
# session 10, device call 2: the GEMV sweep over the 7B and Qwen2.5 shapes with the hand-scheduled
# kernel's layouts (scratch/carry2/q4sweep2.txz), then whole models on Vulkan, bench protocol
# (1-token prompt, 512 greedy tokens, best of 2), three libraries of the same presets:
# base (the GEMV default before), candA (one-level int8 dot4 below K 8192, fp32 from it),
# auto (q4-auto: two-level int8 dot4, workgroup size by shape)
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
S=$(date +%s); st() { echo "[$(( $(date +%s)-S ))s] $*"; }
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 || export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$O/pip.log" 2>&1 || { tail "$O/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LLMCHAT_CACHE_DIR=/tmp/llmchat-cache
git log -1 --format=%H > "$O/commit.txt" 2>/dev/null
mkdir -p /tmp/sw && tar xJf scratch/carry2/q4sweep2.txz -C /tmp/sw
st start
timeout 330 python3 benchmarks/wgsl_gemv_sweep.py run --dir /tmp/sw/q4sweep2 --out "$O/q4sweep2.json" --launches 100 --repeats 2 > "$O/q4sweep2.log" 2>&1
st "sweep rc=$?"; grep -A14 "^best per shape (against" "$O/q4sweep2.log"; grep -E "WRONG|FAILED" "$O/q4sweep2.log" | head -5
OLD="t8-b256-l16-u4-mb128,t8-b256-l4-u4-mb128-nopad-k8192-n4096"
for v in base candA auto; do
  case $v in base) unset LLMCHAT_WGSL_GEMV;; candA) export LLMCHAT_WGSL_GEMV=q4-r4-l32-t256-dp4a-kmax8191,q4-r4-l32-t256-f32,$OLD;; auto) export LLMCHAT_WGSL_GEMV=q4-auto,$OLD;; esac
  timeout 100 python3 benchmarks/gpu_decode.py run --backend vulkan --cache scratch/vk/$v --presets qwen2.5-0.5b,qwen2.5-3b,llama2-7b --prompt 0 --repeats 2 --out "$O/run_$v.json" > "$O/run_$v.log" 2>&1
  st "run $v rc=$?"; grep -o '"decode_tok_s": [0-9.]*\|"tokens_equal": [0-9]*' "$O/run_$v.log" | paste -sd' '
done
cd "$O" && tar czf all.tgz *.log *.json *.txt 2>/dev/null; st end
