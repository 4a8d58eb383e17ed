#!/bin/bash
# session 19 call A: the RMSNorm folded into the GEMVs around it (int8-q8n) against the default,
# three layouts of the GEMV writing the norm's words; bench protocol, then loop + GPU profile
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
BENCH=1 BUDGET_S=330 OUTDIR=$O PRESETS=qwen2.5-3b,llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19 cur q8n q8nr4 q8nr1 cur q8n
mkdir -p $O/prof
BUDGET_S=200 OUTDIR=$O/prof PRESETS=qwen2.5-3b,llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19 cur q8n
stamp done
