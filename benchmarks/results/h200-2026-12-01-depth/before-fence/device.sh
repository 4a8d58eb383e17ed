#!/bin/bash
# one device call: llama.cpp build in the background, the crash repro, the llmchat depth sweep, llama-bench
set -u
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; D=$OUT/d; W=/tmp/dw; mkdir -p $R $D $W
tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C $W
( cd $W/llama.cpp && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
    > $D/llamacpp_cmake.log 2>&1 && nice -n 19 timeout 420 cmake --build build --target llama-bench -j 14 \
    > $D/llamacpp_build.log 2>&1 ) &
BP=$!
for s in ${SCEN:-A B C D E F G I}; do
  timeout 60 python3 scratch/depth/repro.py $s qwen2.5-0.5b > $R/$s.log 2>&1; stamp "$s rc=$? $(grep -c ' ok ' $R/$s.log)"
done
REPRO_CACHE=scratch/depth/cache_nograph timeout 60 python3 scratch/depth/repro.py A qwen2.5-0.5b > $R/A_nograph.log 2>&1; stamp "A nograph rc=$?"
CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 scratch/depth/repro.py A qwen2.5-0.5b > $R/A_blocking.log 2>&1; stamp "A blocking rc=$?"
timeout 80 python3 scratch/depth/repro.py A llama2-7b > $R/A_7b.log 2>&1; stamp "A 7b rc=$?"
# the depth sweep, each preset in its own process; decode depths first, then prompts
for p in llama2-7b llama3-8b; do
  timeout 100 python3 benchmarks/gpu_decode.py depth --cache scratch/depth/cache --presets $p --plain "" \
    --context 8448 --prompts "${PROMPTS:-512,4096,8192}" --depths "${DEPTHS:-0,4096,8192}" --gen 128 --repeats 2 \
    --out $D/llmchat_depth_$p.json > $D/llmchat_depth_$p.log 2>&1; stamp "depth $p rc=$?"
  grep -E "PREFILL|DECODE" $D/llmchat_depth_$p.log | cut -c1-200
done
for p in llama2-7b llama3-8b; do
  nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset $p --gguf-py $W/llama.cpp/gguf-py \
    --vocab-dir $W/llama.cpp/models --out $W/$p.gguf >> $D/gguf.log 2>&1; stamp "gguf $p rc=$?"
done
wait $BP; stamp "llama.cpp build rc=$?"
B=$W/llama.cpp/build/bin/llama-bench
if [ -x $B ]; then
  for p in llama2-7b llama3-8b; do
    timeout 100 $B -m $W/$p.gguf -p 512,4096,8192 -n 0 -ngl 99 -r 2 -fa 0,1 -o json > $D/lcpp_pp_$p.json 2>> $D/lcpp.log; stamp "lcpp pp $p rc=$?"
    timeout 100 $B -m $W/$p.gguf -p 0 -n 128 -d 0,4096,8192 -ngl 99 -r 2 -fa 0,1 -o json > $D/lcpp_tg_$p.json 2>> $D/lcpp.log; stamp "lcpp tg $p rc=$?"
  done
fi
cd $OUT && tar czf all.tgz r d && rm -rf r d
