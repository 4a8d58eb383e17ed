#!/bin/bash
# session 20 call A: the 7B's decode attention with keys in parallel (split-v2-keyN) against v2:
# bench protocol A/B, GPU profile per kernel, decode at depth next to llama.cpp's Vulkan build
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab $O/prof
BENCH=1 BUDGET_S=260 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab20 cur k8 k16 k4 k8s0 k8s512 cur k8
BUDGET_S=90 OUTDIR=$O/prof PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab20 cur k8
for s in cur k8; do
  a=split-v2; [ $s = k8 ] && a=split-v2-key8
  LLMCHAT_WGSL_ATTENTION=$a timeout 70 python3 benchmarks/gpu_decode.py depth --backend vulkan --cache scratch/ab20/$s \
    --presets llama2-7b --context 4096 --prompts 512 --depths 0,1024,3072 --gen 128 --repeats 2 \
    --out $O/depth_$s.json > $O/depth_$s.log 2>&1
  stamp "depth $s rc=$?: $(grep -E '^(DECODE|PREFILL)' $O/depth_$s.log | cut -c1-90 | paste -sd'|')"
done
W=/tmp/lc; mkdir -p $W; tar xzf scratch/vk/lcpp/llama.cpp-gguf.tgz -C $W
xz -dc scratch/vk/lcpp/llama-bench-vulkan.xz > $W/llama-bench && chmod +x $W/llama-bench
timeout 60 python3 benchmarks/gpu_decode.py make-gguf --preset llama2-7b --gguf-py $W/llama.cpp/gguf-py \
  --vocab-dir $W/llama.cpp/models --out $W/7b.gguf > $O/gguf.log 2>&1
timeout 100 $W/llama-bench -m $W/7b.gguf -p 0 -n 128 -d 0,1024,3072 -ngl 99 -r 2 -fa 1 -o json > $O/llamacpp_depth.json 2> $O/llamacpp_depth.log
stamp "llama-bench depth rc=$?"
python3 - $O/llamacpp_depth.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print("llama.cpp", r.get("n_depth"), r.get("n_gen"), round(r.get("avg_ts", 0), 1))
PY
cd $O && tar czf /tmp/a.tgz --exclude=all.tgz . && mv /tmp/a.tgz $O/callA.tgz
stamp done
