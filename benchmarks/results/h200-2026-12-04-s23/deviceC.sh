#!/bin/bash
# session 23 call C: the prompt attention (pipelines/wgsl_prefill_attention.py) with the prompt
# GEMM (ab23b/cur, this tree) against the GEMM alone (ab23b/gemm = ab23a/cur) and session 22's
# libraries (ab23b/gtiled = ab22d/cur), three shapes by the bench protocol; then where a 512-token
# prompt's GPU time goes with the new libraries (vulkan_profile.py --prefill 512)
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
  stamp "bench $name rc=$?: $(grep -o '"decode_tok_s": [0-9.]*\|"prefill_tok_s": [0-9.]*\|"tokens_equal": [0-9]*' "$O/r/bench_$name.log" | paste -sd' ')"
}
run new1 scratch/ab23b/cur
run gemm scratch/ab23b/gemm
run old scratch/ab23b/gtiled
run new2 scratch/ab23b/cur
LLMCHAT_WEBGPU_PROFILE=1 timeout 200 python3 benchmarks/vulkan_profile.py --cache scratch/ab23b/cur \
  --presets llama2-7b,qwen2.5-0.5b --steps 16 --prefill 512 > $O/r/prof_cur.log 2>&1
stamp "profile rc=$?"
python3 - $O/r/prof_cur.log <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if '"prefill_tokens"' in line:
        d = json.loads(line)
        top = " ".join(f"{k['name'][:34]}:{k['ms']}" for k in d["kernels"][:9])
        print(f"  {d['preset']} wall {d['wall_ms']} ms GPU {d['gpu_ms']} ms; {top}")
PY
cd $O && tar czf /tmp/c.tgz r env addon_build.log commit.txt && rm -rf r && mv /tmp/c.tgz $O/callC.tgz
stamp done
