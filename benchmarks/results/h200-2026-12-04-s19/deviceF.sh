#!/bin/bash
# session 19 call F: the 7B's decode attention split settings (informational, issue #15)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
BENCH=1 BUDGET_S=100 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19e cur s0 wg256 wg512 cur
cd $O && tar czf /tmp/f.tgz . && mv /tmp/f.tgz $O/callF.tgz
