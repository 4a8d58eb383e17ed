#!/bin/bash
# llmchat vs llama.cpp on one NVIDIA GPU (written for the H200), random weights, same run.
#
# Prepare on a machine with the TVM compiler and nvcc (no GPU needed):
#   python benchmarks/gpu_decode.py compile --cache scratch/gpu/cache --arch sm_90 \
#       --presets llama2-7b,qwen2.5-3b,qwen2.5-0.5b --plain llama2-7b
#   .whl/: cp312 wheels for the GPU machine's Python: apache-tvm 0.27.0.post1 repacked without
#     tvm/lib/libtvm_compiler.so (and tvm/3rdparty; runtime-only, 5 MB), apache-tvm-ffi 0.1.15.post2,
#     platformdirs
#   llama.cpp's source: vendor/llama.cpp of PyPI's llama-cpp-python 0.3.36 sdist, as a .tgz
#     (LLAMA_CPP_TGZ; only gguf-py/ and models/ggml-vocab-{llama-spm,qwen2}.gguf are needed when a
#     llama-bench binary is given as LLAMA_BENCH_XZ: xz-compressed, split files allowed, built on the
#     same kind of machine with the cmake flags below)
# Run on the GPU machine, from the repository root:
#   LLMCHAT_BENCH_CACHE=scratch/gpu/cache LLAMA_BENCH_XZ=scratch/gpu/lbench/llama-bench.xz.part- \
#   LLAMA_CPP_TGZ=scratch/gpu/lcpp/llama.cpp-gguf.tgz bash benchmarks/run_h200.sh OUTDIR
# Writes OUTDIR/llmchat.json, OUTDIR/llamacpp.json (llama-bench -o json), logs, and summary.md.
set -u
OUTDIR=${1:-${OUT:-bench-out}}
CACHE=${LLMCHAT_BENCH_CACHE:-scratch/gpu/cache}
LCPP_TGZ=${LLAMA_CPP_TGZ:-scratch/gpu/lcpp/llama.cpp.tgz}
PRESETS=${PRESETS:-llama2-7b,qwen2.5-3b,qwen2.5-0.5b}
WORK=${WORK:-/tmp/bench}
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

# 1. device copy bandwidth (the roofline's denominator)
BW=$(python3 benchmarks/gpu_decode.py copy-bw 2>>"$OUTDIR/errors.log")
stamp "copy bandwidth ${BW} TB/s"

# 2. llmchat: decode (1-token prompt + 512 tokens) and prefill (512 tokens), GPU otherwise idle
timeout 300 python3 benchmarks/gpu_decode.py run --cache "$CACHE" --presets "$PRESETS" \
  --plain "${PLAIN:-llama2-7b}" --check-steps "${CHECK_STEPS:-8}" --copy-bw "${BW:-0}" --forbid-nvcc \
  --out "$OUTDIR/llmchat.json" \
  > "$OUTDIR/llmchat.log" 2>&1
stamp "llmchat done (rc=$?)"; grep RESULT "$OUTDIR/llmchat.log" | cut -c1-400

# 3. llama.cpp: build from source (CUDA, sm_90) while the GGUFs are written; a llama-bench
#    built earlier on the same kind of machine can be given as LLAMA_BENCH_XZ (xz, split allowed)
tar xzf "$LCPP_TGZ" -C "$WORK"
LC=$WORK/llama.cpp
BENCH=$LC/build/bin/llama-bench
BUILD_PID=
if [ -n "${LLAMA_BENCH_XZ:-}" ] && ls ${LLAMA_BENCH_XZ}* >/dev/null 2>&1; then
  mkdir -p "$LC/build/bin" && cat ${LLAMA_BENCH_XZ}* | xz -d > "$BENCH" && chmod +x "$BENCH"
  stamp "llama-bench from ${LLAMA_BENCH_XZ} (built from the same source with the same cmake flags)"
else
  ( cd "$LC" && cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
      > "$OUTDIR/llamacpp_cmake.log" 2>&1 \
    && timeout 480 cmake --build build --target llama-bench -j "$(nproc)" > "$OUTDIR/llamacpp_build.log" 2>&1 ) &
  BUILD_PID=$!
fi
for p in ${PRESETS//,/ }; do
  python3 benchmarks/gpu_decode.py make-gguf --preset "$p" --gguf-py "$LC/gguf-py" \
    --vocab-dir "$LC/models" --out "$WORK/$p.gguf" >> "$OUTDIR/gguf.log" 2>&1
done
stamp "GGUFs written"
if [ -n "$BUILD_PID" ]; then wait $BUILD_PID; stamp "llama.cpp build rc=$?"; fi
if [ -x "$BENCH" ]; then
  echo "[" > "$OUTDIR/llamacpp.json"; first=1
  for p in ${PRESETS//,/ }; do
    timeout 150 "$BENCH" -m "$WORK/$p.gguf" -p 512 -n 512 -ngl 99 -r 3 -fa 0,1 -o json \
      > "$WORK/$p.json" 2>> "$OUTDIR/llamacpp_bench.log"
    [ $first -eq 0 ] && echo "," >> "$OUTDIR/llamacpp.json"; first=0
    sed -e '1s/^\[//' -e '$s/\]$//' "$WORK/$p.json" >> "$OUTDIR/llamacpp.json"
    stamp "llama-bench $p"
  done
  echo "]" >> "$OUTDIR/llamacpp.json"
fi

# 4. summary table
python3 - "$OUTDIR" <<'PY'
import json, os, sys
out = sys.argv[1]
ll = json.load(open(os.path.join(out, "llmchat.json")))
try:
    lc = json.load(open(os.path.join(out, "llamacpp.json")))
except Exception:
    lc = []
files = {"llama2-7b": "llama2-7b.gguf", "qwen2.5-3b": "qwen2.5-3b.gguf", "qwen2.5-0.5b": "qwen2.5-0.5b.gguf"}
def best(preset, test):
    rows = [r for r in lc if r.get("model_filename", "").endswith(files.get(preset, "?"))
            and ((test == "tg" and r.get("n_gen") == 512 and r.get("n_prompt") == 0)
                 or (test == "pp" and r.get("n_prompt") == 512 and r.get("n_gen") == 0))]
    return max((r["avg_ts"] for r in rows), default=None), (rows[0]["model_size"] if rows else None)
lines = [f"device {ll.get('device')}  copy bandwidth {ll.get('copy_bw_TBps')} TB/s  runtime-only TVM {ll.get('runtime_only')}",
         "| shape | llmchat decode tok/s | % roofline | llmchat prefill pp512 tok/s | weights MB | llama.cpp tg512 | llama.cpp pp512 | llama.cpp weights MB | decode vs llama.cpp |",
         "|---|---|---|---|---|---|---|---|---|"]
for preset, r in ll["presets"].items():
    tg, size = best(preset, "tg"); pp, _ = best(preset, "pp")
    dec = r.get("decode_tok_s")
    ratio = f"{dec / tg:.2f}" if dec and tg else "-"
    lines.append(f"| {preset} | {dec} | {r.get('roofline_pct')} | {r.get('prefill_tok_s')} | "
                 f"{round(r.get('weight_bytes', 0) / 1e6)} | {tg and round(tg, 1)} | {pp and round(pp, 1)} | "
                 f"{size and round(size / 1e6)} | {ratio} |")
    if "check_vs_plain_pipeline" in r:
        lines.append(f"  check vs plain TVM pipeline: {r['check_vs_plain_pipeline']}; plain decode "
                     f"{r.get('plain_pipeline', {}).get('decode_tok_s')} tok/s")
    if "error" in r:
        lines.append(f"  ERROR {r['error'][:500]}")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
stamp "done"
