#!/bin/bash
set -u
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
for s in A I E; do
  timeout 60 python3 scratch/depth/repro.py $s qwen2.5-0.5b > $R/$s.log 2>&1; stamp "fence $s rc=$? $(grep -c ' ok ' $R/$s.log)"
done
for m in qwen2.5-0.5b llama2-7b; do
  NO_FENCE=1 timeout 60 python3 scratch/depth/repro.py R $m > $R/R_nofence_$m.log 2>&1; stamp "R nofence $m rc=$?"; grep "^R " $R/R_nofence_$m.log
  timeout 60 python3 scratch/depth/repro.py R $m > $R/R_fence_$m.log 2>&1; stamp "R fence $m rc=$?"; grep "^R " $R/R_fence_$m.log
done
for p in llama2-7b llama3-8b; do
  timeout 90 python3 benchmarks/gpu_decode.py depth --cache scratch/depth/cache --presets $p --plain "" \
    --context 8448 --prompts 512,4096,8192 --depths 0,4096,8192 --gen 128 --repeats 2 \
    --out $R/llmchat_depth_$p.json > $R/llmchat_depth_$p.log 2>&1; stamp "depth $p rc=$?"
  grep -E "PREFILL|DECODE" $R/llmchat_depth_$p.log | cut -c1-200
done
timeout 60 python3 benchmarks/gpu_decode.py depth --cache scratch/depth/cache --presets qwen2.5-0.5b --plain "" \
    --context 8448 --prompts 512 --depths 0,4096 --gen 256 --repeats 2 --out $R/llmchat_depth_q05.json > $R/llmchat_depth_q05.log 2>&1; stamp "depth 0.5b rc=$?"
grep -E "PREFILL|DECODE" $R/llmchat_depth_q05.log | cut -c1-200
cd $OUT && tar czf r.tgz r && rm -rf r
