#!/bin/bash
# session 20 call D: 16 threads a key lost at depth to 8 (call C: 259 against call A's 282 tok/s at
# 3,072 keys): more chunks a KV head at long contexts (wg256 / wg512: 8 / 16 chunks of the 7B's 32
# KV heads instead of 4), by the bench protocol and at depth, next to llama.cpp's depth run
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab
BENCH=1 BUDGET_S=150 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab20e cur k16wg256 k16wg512 k8 cur
for s in cur k16wg256 k16wg512 k8; do
  case $s in cur) a=split-v2;; k8) a=split-v2-key8;; *) a=split-v2-key16-wg${s#k16wg};; esac
  LLMCHAT_WGSL_ATTENTION=$a timeout 60 python3 benchmarks/gpu_decode.py depth --backend vulkan --cache scratch/ab20e/$s \
    --presets llama2-7b --context 4096 --prompts 512 --depths 0,1024,3072 --gen 128 --repeats 2 \
    --out $O/depth_$s.json > $O/depth_$s.log 2>&1
  stamp "depth $s rc=$?: $(grep -E '^DECODE' $O/depth_$s.log | grep -o "llama2-7b [0-9]* {'tok_s': [0-9.]*" | paste -sd'|')"
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
cd $O && tar czf /tmp/d.tgz . && mv /tmp/d.tgz $O/callD.tgz
stamp done
