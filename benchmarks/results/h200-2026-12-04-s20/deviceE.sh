#!/bin/bash
# session 20 call E: the final default (16 threads a key, 256 workgroups at long contexts for
# Llama-2-7B's decode attention) on the GPU suite's Vulkan tests, then next to llama.cpp's Vulkan
# build by the bench protocol (all three shapes)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/suite . benchmarks/device_env.sh
timeout 200 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache20 PY=python3 PYTEST_ARGS="-k vulkan" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?: $(tail -1 $O/gpu_suite.log)"
grep -E "max relative error|second turn|prompt \+|greedy after" $O/gpu_suite.log | cut -c1-160
FA=1 VK_CACHE=scratch/ab20f/cur timeout 250 bash benchmarks/run_h200_vulkan.sh vulkan $O/vk
stamp "run_h200_vulkan rc=$?"
grep -o '"decode_tok_s": [0-9.]*' $O/vk/vulkan.log | paste -sd' '
python3 - $O/vk/llamacpp_vulkan.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r.get("model_filename", "?")[-24:], r.get("n_prompt"), r.get("n_gen"), round(r.get("avg_ts", 0), 1), [round(x, 1) for x in r.get("samples_ts", [])])
PY
cd $O && tar czf /tmp/e.tgz --exclude=all.tgz . && mv /tmp/e.tgz $O/callE.tgz
stamp done
