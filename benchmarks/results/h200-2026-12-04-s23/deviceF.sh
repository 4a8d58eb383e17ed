#!/bin/bash
# session 23 call F: the prompt attention over the cache's pages too (batch_prefill_paged_kv,
# pipelines/wgsl_prefill_attention.py): the GPU suite's Vulkan tests (cache gpu-test-cache23b, built
# here at this tree), then Llama-2-7B's prompts of 512 / 2,048 / 3,584 tokens (context 4,096,
# ab23ed/cur: a 3,584-token prompt's second chunk reads the first from the pages) and decode after
# 0 / 1,024 / 3,072 keys, next to llama.cpp's -p 512,2048,3584 in the same call
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/suite . benchmarks/device_env.sh
timeout 330 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache23b PY=python3 PYTEST_ARGS="-k vulkan -v --durations=0" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?: $(tail -1 $O/gpu_suite.log)"
grep -E "PASSED|FAILED|ERROR|s call" $O/gpu_suite.log | cut -c1-160
timeout 100 python3 benchmarks/gpu_decode.py depth --backend vulkan --cache scratch/ab23ed/cur \
  --presets llama2-7b --context 4096 --prompts 512,2048,3584 --depths 0,1024,3072 --gen 128 --repeats 2 \
  --out $O/depth_cur.json > $O/depth_cur.log 2>&1
stamp "depth rc=$?: $(grep -E '^(DECODE|PREFILL)' $O/depth_cur.log | cut -c1-90 | paste -sd'|')"
W=/tmp/lc; mkdir -p $W; tar xzf scratch/vk/lcpp/llama.cpp-gguf.tgz -C $W
xz -dc scratch/vk/lcpp/llama-bench-vulkan.xz > $W/llama-bench && chmod +x $W/llama-bench
timeout 60 python3 benchmarks/gpu_decode.py make-gguf --preset llama2-7b --gguf-py $W/llama.cpp/gguf-py \
  --vocab-dir $W/llama.cpp/models --out $W/7b.gguf > $O/gguf.log 2>&1
timeout 60 $W/llama-bench -m $W/7b.gguf -p 512,2048,3584 -n 0 -ngl 99 -r 2 -fa 1 -o json > $O/llamacpp_prompts.json 2> $O/llamacpp_prompts.log
stamp "llama-bench prompts rc=$?"
python3 - $O/llamacpp_prompts.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print("llama.cpp", "p", r.get("n_prompt"), round(r.get("avg_ts", 0), 1))
PY
cd $O && tar czf /tmp/f.tgz . && find . -mindepth 1 -maxdepth 1 ! -name commit.txt -exec rm -rf {} + && mv /tmp/f.tgz $O/callF.tgz
stamp done
