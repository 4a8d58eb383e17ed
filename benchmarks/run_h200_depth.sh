#!/bin/bash
# llmchat vs llama.cpp at depth on one NVIDIA GPU (written for the H200), random weights, same run:
# prefill speed at prompts of N tokens and decode speed after N tokens of context (llama-bench's
# -p N and -n 128 -d N), for the Llama-2-7B and Llama-3-8B shapes (issue #18, target 3).
#
# Prepare on a machine with the TVM compiler and nvcc (no GPU needed):
#   python benchmarks/gpu_decode.py compile --cache scratch/depth/cache --arch sm_90 \
#       --presets llama2-7b,llama3-8b --plain "" --context 8448
#   .whl/: cp312 wheels for the GPU machine (see run_h200.sh)
#   llama.cpp's source (vendor/llama.cpp of PyPI's llama-cpp-python 0.3.36 sdist, without docs/ and
#   the vocab files other than llama-spm and llama-bpe) as scratch/depth/lcpp/llama.cpp-src.tgz
# Run on the GPU machine, from the repository root, in one call or in two (each under ten minutes):
#   bash benchmarks/run_h200_depth.sh OUTDIR [all|llmchat|llamacpp]
# llama.cpp is built (CUDA, sm_90, niced) while llmchat runs; the build log says how long it took.
# Stage llamacpp finishes the build if it was cut (WORK persists on the machine between calls).
set -u
OUTDIR=${1:-${OUT:-depth-out}}
STAGE=${2:-all}
CACHE=${LLMCHAT_BENCH_CACHE:-scratch/depth/cache}
LCPP_TGZ=${LLAMA_CPP_TGZ:-scratch/depth/lcpp/llama.cpp-src.tgz}
PRESETS=${PRESETS:-llama2-7b,llama3-8b}
PROMPTS=${PROMPTS:-512,4096,8192}
DEPTHS=${DEPTHS:-0,4096,8192}
WORK=${WORK:-build/depth-work}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total,power.limit \
  --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
START=$(date +%s)
stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }

LC=$WORK/llama.cpp
BENCH=$LC/build/bin/llama-bench
build_llamacpp() {
  cd "$LC" && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
    > "$OUTDIR/llamacpp_cmake.log" 2>&1 \
  && time nice -n 19 timeout ${BUILD_TIMEOUT:-480} cmake --build build --target llama-bench -j "$(( $(nproc) - 2 ))" \
    >> "$OUTDIR/llamacpp_build.log" 2>&1
}
make_ggufs() {
  tar xzf "$LCPP_TGZ" -C "$WORK" llama.cpp/models llama.cpp/gguf-py
  for p in ${PRESETS//,/ }; do
    [ -s "$WORK/$p.gguf" ] || nice -n 10 python3 benchmarks/gpu_decode.py make-gguf --preset "$p" \
      --gguf-py "$LC/gguf-py" --vocab-dir "$LC/models" --out "$WORK/$p.gguf" >> "$OUTDIR/gguf.log" 2>&1
  done
  stamp "GGUFs written"
}
if [ "$STAGE" != llamacpp ]; then
[ -d "$LC" ] || tar xzf "$LCPP_TGZ" -C "$WORK"
( build_llamacpp ) &
BUILD_PID=$!

timeout 420 python3 benchmarks/gpu_decode.py depth --cache "$CACHE" --presets "$PRESETS" --plain "" \
  --context 8448 --prompts "$PROMPTS" --depths "$DEPTHS" --gen 128 --repeats 2 \
  --out "$OUTDIR/llmchat_depth.json" > "$OUTDIR/llmchat_depth.log" 2>&1
stamp "llmchat done (rc=$?)"; cp "$OUTDIR/llmchat_depth.json" "$WORK/" 2>/dev/null; grep -E "PREFILL|DECODE|Error" "$OUTDIR/llmchat_depth.log" | cut -c1-300

make_ggufs
wait $BUILD_PID; stamp "llama.cpp build rc=$?"
fi
[ "$STAGE" = llmchat ] && exit 0
[ -f "$OUTDIR/llmchat_depth.json" ] || cp "$WORK/llmchat_depth.json" "$OUTDIR/"
[ -x "$BENCH" ] || { ( build_llamacpp ); stamp "llama.cpp build (resumed) rc=$?"; }
make_ggufs
if [ -x "$BENCH" ]; then
  echo "[" > "$OUTDIR/llamacpp_depth.json"; first=1
  for p in ${PRESETS//,/ }; do
    for args in "-p $PROMPTS -n 0" "-p 0 -n 128 -d $DEPTHS"; do
      timeout 200 "$BENCH" -m "$WORK/$p.gguf" $args -ngl 99 -r 2 -fa 0,1 -o json \
        > "$WORK/$p.json" 2>> "$OUTDIR/llamacpp_bench.log"
      [ $first -eq 0 ] && echo "," >> "$OUTDIR/llamacpp_depth.json"; first=0
      sed -e '1s/^\[//' -e '$s/\]$//' "$WORK/$p.json" >> "$OUTDIR/llamacpp_depth.json"
      stamp "llama-bench $p $args"
    done
  done
  echo "]" >> "$OUTDIR/llamacpp_depth.json"
fi

python3 - "$OUTDIR" "$PRESETS" <<'PY'
import json, os, sys
out, presets = sys.argv[1], sys.argv[2].split(",")
ll = json.load(open(os.path.join(out, "llmchat_depth.json")))
try:
    lc = json.load(open(os.path.join(out, "llamacpp_depth.json")))
except Exception:
    lc = []
def lcpp(preset, prompt, gen, depth):
    rows = [r for r in lc if r.get("model_filename", "").endswith(preset + ".gguf")
            and r.get("n_prompt") == prompt and r.get("n_gen") == gen and r.get("n_depth", 0) == depth]
    return max((r["avg_ts"] for r in rows), default=None)
lines = [f"device {ll.get('device')}  context {ll.get('context')}", "",
         "| shape | test | llmchat tok/s | llama.cpp tok/s (best of fa 0/1) | llmchat / llama.cpp |",
         "|---|---|---|---|---|"]
for p in presets:
    r = ll["presets"].get(p, {})
    if "error" in r:
        lines.append(f"| {p} | ERROR {r['error'][:300]} | | | |")
    for n, v in r.get("prefill", {}).items():
        c = lcpp(p, int(n), 0, 0)
        lines.append(f"| {p} | pp{n} | {v['tok_s']} | {c and round(c, 1)} | {c and round(v['tok_s'] / c, 2)} |")
    for d, v in r.get("decode_at_depth", {}).items():
        c = lcpp(p, 0, 128, int(d))
        lines.append(f"| {p} | tg128 @ d{d} | {v['tok_s']} | {c and round(c, 1)} | {c and round(v['tok_s'] / c, 2)} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
stamp "done"
