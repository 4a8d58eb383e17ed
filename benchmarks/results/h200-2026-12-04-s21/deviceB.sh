#!/bin/bash
# session 21 call B: Llama-2-7B by the bench protocol (the real step, not the GPU profile): the int8
# GEMVs' rows a set by workgroup count (mw128/512/1024 against the default 256), two steps of weights
# loaded before the staging (pre2), 32 threads a key in the decode attention (k32), the norms folded
# into the GEMVs around them (q8n, session 19's, now with the key-parallel attention)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab $O/ab2
BENCH=1 BUDGET_S=330 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21b cur mw128 mw512 mw1024 pre2 k32 q8n
BENCH=1 BUDGET_S=100 OUTDIR=$O/ab2 PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21b cur
cd $O && tar czf /tmp/b.tgz --exclude=all.tgz . && mv /tmp/b.tgz $O/callB.tgz
stamp done
