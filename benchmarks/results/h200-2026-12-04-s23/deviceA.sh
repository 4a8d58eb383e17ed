#!/bin/bash
# session 23 call A: the prompt GEMM (pipelines/wgsl_q4_gemm.py, ab23a/cur, this tree) against the
# scheduled GEMM of session 22's libraries (ab23a/gtiled = ab22d/cur, df91c15), interleaved, three
# shapes by the bench protocol (decode: 1-token prompt, 512 tokens; prefill: 512-token prompt)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/r
run() {  # NAME DIR [ENV=VALUE ...]
  local name=$1 dir=$2; shift 2
  env "$@" timeout 150 python3 benchmarks/gpu_decode.py run --backend vulkan --cache "$dir" \
    --presets llama2-7b,qwen2.5-3b,qwen2.5-0.5b --plain "" --check-steps 8 --out "$O/r/bench_$name.json" \
    > "$O/r/bench_$name.log" 2>&1
  stamp "bench $name rc=$?: $(grep -o '"decode_tok_s": [0-9.]*\|"prefill_tok_s": [0-9.]*\|"device_argmax": {[^}]*}' "$O/r/bench_$name.log" | paste -sd' ')"
}
run old1 scratch/ab23a/gtiled
run new1 scratch/ab23a/cur
run old2 scratch/ab23a/gtiled
run new2 scratch/ab23a/cur
cd $O && tar czf /tmp/a.tgz r env addon_build.log commit.txt && rm -rf r && mv /tmp/a.tgz $O/callA.tgz
stamp done
