#!/bin/bash
# session 22 call C: Llama-2-7B by the bench protocol with the kernels' weight (and vector) loads
# as single 16-byte (8-byte) WGSL loads (pipelines/wgsl_vector_params.py; ab22c/cur, this tree)
# against the libraries before (ab21f/cur), interleaved; then what each GEMV costs where it runs
# (LLMCHAT_WEBGPU_SKIP) with the new libraries
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/r
run() {  # NAME DIR [ENV=VALUE ...]
  local name=$1 dir=$2; shift 2
  env "$@" timeout 90 python3 benchmarks/gpu_decode.py run --backend vulkan --cache "$dir" --presets llama2-7b \
    --plain "" --check-steps 8 --out "$O/r/bench_$name.json" > "$O/r/bench_$name.log" 2>&1
  stamp "bench $name rc=$?: $(grep -o '"decode_tok_s": [0-9.]*\|"device_argmax": {[^}]*}' "$O/r/bench_$name.log" | paste -sd' ')"
}
run old1 scratch/ab21f/cur
run vec1 scratch/ab22c/cur
run old2 scratch/ab21f/cur
run vec2 scratch/ab22c/cur
for s in dequant_matmul5_ dequant_matmul6_ dequant_matmul7_ dequant_matmul8_; do
  run "vecskip_$s" scratch/ab22c/cur LLMCHAT_WEBGPU_SKIP=$s
done
cd $O && tar czf /tmp/c.tgz r env addon_build.log commit.txt && rm -rf r && mv /tmp/c.tgz $O/callC.tgz
stamp done
