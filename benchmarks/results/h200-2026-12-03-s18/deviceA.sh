#!/bin/bash
# session 18 call A: the GPU suite's CUDA tests (cache built here), then Llama-3-8B prompts with the
# mma.sync GEMM and with the WMMA one (LLMCHAT_CUDA_GEMM=wmma), next to llama.cpp (CUDA, built here meanwhile)
set -u
R=$PWD; O=$OUT; LCW=$R/scratch/lcw; mkdir -p $LCW $O/depth
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
LC=$LCW/llama.cpp
[ -d $LC ] || tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C $LCW
( cd $LC && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
    > $O/depth/llamacpp_cmake.log 2>&1 && { time nice -n 19 timeout 420 cmake --build build --target llama-bench -j 14 ; } \
    > $O/depth/llamacpp_build.log 2>&1 ) &
BP=$!
timeout 250 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache18 PY=python3 PYTEST_ARGS="-k 'not vulkan'" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?"; tail -3 $O/gpu_suite.log
dep() {  # cache, presets, out name, env
  env $4 timeout 120 python3 benchmarks/gpu_decode.py depth --cache $1 --presets $2 --plain "" --context 8448 \
    --prompts 4096,8192 --depths 0 --gen 128 --repeats 2 --out $O/depth/$3.json > $O/depth/$3.log 2>&1
  stamp "$3 rc=$?"; grep -E "PREFILL|DECODE|Error" $O/depth/$3.log | cut -c1-200
}
dep scratch/s18/mma llama3-8b mma8b_r1 LLMCHAT_CUDA_GEMM=
dep scratch/s18/wmma llama3-8b wmma8b_r1 LLMCHAT_CUDA_GEMM=wmma
( nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset llama3-8b --gguf-py $LC/gguf-py --vocab-dir $LC/models --out $LCW/llama3-8b.gguf > $O/depth/gguf.log 2>&1
  nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset llama2-7b --gguf-py $LC/gguf-py --vocab-dir $LC/models --out $LCW/llama2-7b.gguf >> $O/depth/gguf.log 2>&1 ) &
GP=$!
dep scratch/s18/mma llama3-8b mma8b_r2 LLMCHAT_CUDA_GEMM=
wait $GP; stamp "gguf rc=$?"
wait $BP; stamp "llama.cpp build rc=$?"; tail -4 $O/depth/llamacpp_build.log
B=$LC/build/bin/llama-bench
if [ -x $B ]; then
  timeout 80 $B -m $LCW/llama3-8b.gguf -p 4096,8192 -n 0 -ngl 99 -r 2 -fa 1 -o json > $O/depth/lb_pp_llama3-8b.json 2>> $O/depth/lb.log; stamp "lb pp rc=$?"
  python3 -c "
import json
for r in json.load(open('$O/depth/lb_pp_llama3-8b.json')): print('llama.cpp', r['n_prompt'], r['n_gen'], r.get('n_depth',0), round(r['avg_ts'],1), [round(x,1) for x in r.get('samples_ts',[])])
"
fi
(cd $O && tar czf depth.tgz depth env && rm -rf depth env)
stamp done
