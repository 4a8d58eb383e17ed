#!/bin/bash
# session 21 call A: the norm's kernel prefetching the next GEMV's weights into the L2 cache
# (LLMCHAT_WGSL_PREFETCH=N MiB) on Llama-2-7B, bench protocol A/B and GPU profiles;
# scratch/ab21 built before the norm's weights moved ahead of its barriers, scratch/ab21ne after
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab $O/abne $O/prof
BENCH=1 BUDGET_S=200 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21 cur pf8 pf16 pf32
BENCH=1 BUDGET_S=300 OUTDIR=$O/abne PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21ne cur pf8 pf16
BENCH=1 BUDGET_S=340 OUTDIR=$O/ab PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21 cur pf16
BUDGET_S=420 OUTDIR=$O/prof PRESETS=llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab21 cur pf16
cd $O && tar czf /tmp/a.tgz --exclude=all.tgz . && mv /tmp/a.tgz $O/callA.tgz
stamp done
