#!/bin/bash
# session 22 call E: the GPU suite's Vulkan tests at this tree (cache scratch/gpu-test-cache22),
# with each test's time (call D's 200 s limit stopped it during the sixth test)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/suite . benchmarks/device_env.sh
timeout 380 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache22 PY=python3 PYTEST_ARGS="-k vulkan -v --durations=0" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?: $(tail -1 $O/gpu_suite.log)"
grep -E "PASSED|FAILED|ERROR|s call" $O/gpu_suite.log | cut -c1-160
cd $O && tar czf /tmp/e.tgz . && find . -mindepth 1 -maxdepth 1 ! -name commit.txt -exec rm -rf {} + && mv /tmp/e.tgz $O/callE.tgz
stamp done
