#!/bin/bash
# session 20 call C: decode at depth (0 / 1,024 / 3,072 keys of context) of the new default
# (16 threads a key) next to llama.cpp's Vulkan build, same call; the GPU suite's Vulkan tests (call
# B's cache was stale: built before a comment of test_engine_vulkan.py changed, whose bytes it hashes)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
timeout 200 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache20 PY=python3 PYTEST_ARGS="-k vulkan" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?: $(tail -1 $O/gpu_suite.log)"
grep -E "max relative error|second turn|prompt \+|greedy after" $O/gpu_suite.log | cut -c1-160
timeout 80 python3 benchmarks/gpu_decode.py depth --backend vulkan --cache scratch/ab20d/cur \
  --presets llama2-7b --context 4096 --prompts 512 --depths 0,1024,3072 --gen 128 --repeats 2 \
  --out $O/depth_k16.json > $O/depth_k16.log 2>&1
stamp "depth k16 rc=$?: $(grep -E '^(DECODE|PREFILL)' $O/depth_k16.log | cut -c1-90 | paste -sd'|')"
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
cd $O && tar czf /tmp/c.tgz . && mv /tmp/c.tgz $O/callC.tgz
stamp done
