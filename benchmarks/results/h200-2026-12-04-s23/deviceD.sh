#!/bin/bash
# session 23 call D: the GPU suite's Vulkan tests with the prompt GEMM and the prompt attention
# (cache scratch/gpu-test-cache23, built here at this tree's library sources)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/suite . benchmarks/device_env.sh
timeout 420 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache23 PY=python3 PYTEST_ARGS="-k vulkan -v --durations=0" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?: $(tail -1 $O/gpu_suite.log)"
grep -E "PASSED|FAILED|ERROR|s call" $O/gpu_suite.log | cut -c1-160
cd $O && tar czf /tmp/d.tgz . && find . -mindepth 1 -maxdepth 1 ! -name commit.txt -exec rm -rf {} + && mv /tmp/d.tgz $O/callD.tgz
stamp done
