#!/bin/bash
# session 21 call C: the norms folded on every row width as the new default (cur), against the old
# default (q8ns: rows up to 2,048 only) and the producing GEMV's layouts (nr1) and epilogue (nr2p,
# nr1p: several threads quantize), by the bench protocol on Llama-2-7B; then the GPU suite's
# Vulkan tests (cache scratch/gpu-test-cache21, with the new llama-w4096 model)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab $O/ab2
BENCH=1 BUDGET_S=200 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21c cur q8ns nr2p nr1 nr1p
BENCH=1 BUDGET_S=60 OUTDIR=$O/ab2 PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21c cur nr2p
OUTDIR=$O/suite . benchmarks/device_env.sh
timeout 280 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache21 PY=python3 PYTEST_ARGS="-k vulkan" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?: $(tail -1 $O/gpu_suite.log)"
grep -E "max relative error|second turn|prompt \+|greedy after" $O/gpu_suite.log | cut -c1-160
cd $O && tar czf /tmp/c.tgz --exclude=all.tgz . && mv /tmp/c.tgz $O/callC.tgz
stamp done
