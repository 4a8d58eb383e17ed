#!/bin/bash
# session 19 call D: the new default (the norm folded for rows up to 2,048) next to llama.cpp's
# Vulkan build; A/B against session 16's default (int8-q8s); the GPU suite's Vulkan tests
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
FA=1 VK_CACHE=scratch/ab19d/cur timeout 200 bash benchmarks/run_h200_vulkan.sh vulkan $O/vk
stamp() { echo "[$SECONDS s] $*"; }
stamp "run_h200_vulkan rc=$?"
grep -o '"decode_tok_s": [0-9.]*' $O/vk/vulkan.log | paste -sd' '
python3 - $O/vk/llamacpp_vulkan.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r.get("model_filename", "?")[-24:], r.get("n_prompt"), r.get("n_gen"), round(r.get("avg_ts", 0), 1), [round(x, 1) for x in r.get("samples_ts", [])])
PY
mkdir -p $O/ab
BENCH=1 BUDGET_S=80 OUTDIR=$O/ab PRESETS=qwen2.5-3b,llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19d q8s cur q8s
OUTDIR=$O/suite . benchmarks/device_env.sh
timeout 290 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache19 PY=python3 PYTEST_ARGS="-k vulkan" > $O/gpu_suite.log 2>&1
echo "suite rc=$?"; tail -4 $O/gpu_suite.log
cd $O && tar czf /tmp/d.tgz --exclude=all.tgz . && mv /tmp/d.tgz $O/callD.tgz
echo done
