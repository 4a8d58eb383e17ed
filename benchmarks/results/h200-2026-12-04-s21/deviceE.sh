#!/bin/bash
# session 21 call E: A/B on top of the new default (norms folded on every row width), Llama-2-7B by
# the bench protocol: 8 threads a key in the decode attention (k8), two steps of weights loaded
# before the staging (pre2), several threads quantizing a norm's vector (nr2p), gate_up in 8 rows a
# set of 32 lanes (r8)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab
BENCH=1 BUDGET_S=230 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21e cur k8 pre2 nr2p r8 cur
cd $O && tar czf /tmp/e.tgz --exclude=all.tgz . && mv /tmp/e.tgz $O/callE.tgz
stamp done
