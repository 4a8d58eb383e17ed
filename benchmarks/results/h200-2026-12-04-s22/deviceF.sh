#!/bin/bash
# session 22 call F: the int8 GEMVs reading the quantized vector's words 16 bytes a load as well
# (ab22f/cur, this tree) against the weights-only vector loads (ab22d/cur, call D's libraries), by
# the bench protocol on all three shapes, then the 7B once more each
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/r
run() {  # NAME DIR PRESETS
  timeout 150 python3 benchmarks/gpu_decode.py run --backend vulkan --cache "$2" --presets "$3" \
    --plain "" --check-steps 8 --out "$O/r/bench_$1.json" > "$O/r/bench_$1.log" 2>&1
  stamp "bench $1 rc=$?: $(grep -o '"decode_tok_s": [0-9.]*\|"tokens_equal": [0-9]*' "$O/r/bench_$1.log" | paste -sd' ')"
}
run w1 scratch/ab22d/cur qwen2.5-0.5b,qwen2.5-3b,llama2-7b
run a1 scratch/ab22f/cur qwen2.5-0.5b,qwen2.5-3b,llama2-7b
run w2 scratch/ab22d/cur llama2-7b
run a2 scratch/ab22f/cur llama2-7b
cd $O && tar czf /tmp/f.tgz r env addon_build.log commit.txt && rm -rf r env && mv /tmp/f.tgz $O/callF.tgz
stamp done
