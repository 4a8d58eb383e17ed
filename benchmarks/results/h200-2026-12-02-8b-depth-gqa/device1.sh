#!/bin/bash
# device run 1 (2026-12-02, session 9): #21 gpu_decode vs llmchat bench on CUDA; #18 8B cluster chunks 8 vs 16 at depth; llama.cpp same run
set -u
R=$PWD
OUTDIR=${OUT:-/tmp/out}
WORK=/tmp/dw
mkdir -p "$OUTDIR" "$WORK"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/whl-hub/*.whl > "$OUTDIR/pip.log" 2>&1 || { cat "$OUTDIR/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$R/scratch/t21
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total,power.limit --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
START=$(date +%s); stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }
LC=$WORK/llama.cpp
if [ ! -x "$LC/build/bin/llama-bench" ]; then
  tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C "$WORK"
  ( cd "$LC" && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
    > "$OUTDIR/llamacpp_cmake.log" 2>&1 && { time nice -n 19 cmake --build build --target llama-bench -j 12 ; } \
    >> "$OUTDIR/llamacpp_build.log" 2>&1 ) &
  BUILD_PID=$!
fi
cd scratch/t21
export LLMCHAT_DATA_DIR=/tmp/ldata
# A: issue 21, the same 0.5B library through gpu_decode.py run and through `llmchat bench`, alternating
for round in 1 2; do
  timeout 120 python3 benchmarks/gpu_decode.py run --cache ../c21/base --presets qwen2.5-0.5b --plain "" \
    --context 2048 --gen 512 --prompt 512 --repeats 3 --check-steps 0 --copy-bw 0 --forbid-nvcc \
    --out "$OUTDIR/gd_r$round.json" > "$OUTDIR/gd_r$round.log" 2>&1
  stamp "gpu_decode run r$round rc=$?"; grep -o '"decode_tok_s": [0-9.]*\|"prefill_tok_s": [0-9.]*' "$OUTDIR/gd_r$round.json" | head -2
  LLMCHAT_CACHE_DIR=$R/scratch/c21/base timeout 120 python3 -m app.cli bench --random-weights qwen2.5-0.5b \
    --device cuda --context-window 2048 --gen 512 --prompt-tokens 512 --runs 3 --json \
    > "$OUTDIR/cli_r$round.log" 2>&1
  stamp "llmchat bench r$round rc=$?"; tail -c 1500 "$OUTDIR/cli_r$round.log"; echo
done
# B: issue 18, Llama-3-8B: clusters of 8 chunks (main) vs 16 (kv heads x chunks >= 256), interleaved
for round in 1 2; do
  for v in base8 wide8; do
    timeout 200 python3 benchmarks/gpu_decode.py depth --cache ../c21/$v --presets llama3-8b --plain "" \
      --context 8448 --prompts "$( [ $round = 1 ] && echo 4096,8192 || echo '' )" --depths 0,4096,8192 --gen 128 --repeats 2 \
      --out "$OUTDIR/depth_${v}_r$round.json" > "$OUTDIR/depth_${v}_r$round.log" 2>&1
    stamp "depth $v r$round rc=$?"; grep -E "PREFILL|DECODE|Error" "$OUTDIR/depth_${v}_r$round.log" | cut -c1-200
  done
done
cd "$R"
[ -n "${BUILD_PID:-}" ] && { wait $BUILD_PID; stamp "llama.cpp build rc=$?"; tail -3 "$OUTDIR/llamacpp_build.log"; }
echo done
