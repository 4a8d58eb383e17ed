#!/bin/bash
# session 19 call B: int8-q8n in half groups (16 rows a producing workgroup) against the default
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
BENCH=1 BUDGET_S=200 OUTDIR=$O PRESETS=qwen2.5-3b,llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19b cur q8n q8nr1 cur q8n
mkdir -p $O/prof
BUDGET_S=100 OUTDIR=$O/prof PRESETS=qwen2.5-3b,llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19b q8n
stamp done
