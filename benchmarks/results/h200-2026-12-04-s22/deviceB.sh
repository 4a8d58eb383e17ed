#!/bin/bash
# session 22 call B: Llama-2-7B by the bench protocol: the GEMVs' epilogue loads (bias, residual,
# norm weight) at the kernel's start (ab22b/cur, this tree) against before (ab21f/cur, 0ab7ada's
# libraries), and the norm-writing GEMVs (o, down) in 4 rows of 64 lanes / 8 rows of 128 lanes
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
run() {  # NAME DIR [ENV=VALUE ...]
  local name=$1 dir=$2; shift 2
  env "$@" timeout 90 python3 benchmarks/gpu_decode.py run --backend vulkan --cache "$dir" --presets llama2-7b \
    --plain "" --check-steps 8 --out "$O/bench_$name.json" > "$O/bench_$name.log" 2>&1
  stamp "bench $name rc=$?: $(grep -o '"decode_tok_s": [0-9.]*\|"device_argmax": {[^}]*}' "$O/bench_$name.log" | paste -sd' ')"
}
run old1 scratch/ab21f/cur
run early1 scratch/ab22b/cur
run r4l64 scratch/ab22b/nr4l64 LLMCHAT_WGSL_NORM_OUT_LAYOUT=r4l64
run r8l128 scratch/ab22b/nr8l128 LLMCHAT_WGSL_NORM_OUT_LAYOUT=r8l128
run old2 scratch/ab21f/cur
run early2 scratch/ab22b/cur
cd $O && tar czf /tmp/b.tgz . && mv /tmp/b.tgz $O/callB.tgz
stamp done
