#!/bin/bash
# session 18 call B: the GPU suite's CUDA tests (cache built here); Llama-2-7B and Llama-3-8B prompts, mma.sync GEMM against WMMA (LLMCHAT_CUDA_GEMM=wmma),
# interleaved, next to llama.cpp (CUDA, built here meanwhile unless still there); the GEMM kernel check
set -u
R=$PWD; O=$OUT; LCW=$R/scratch/lcw; mkdir -p $LCW $O/depth
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
(which nsys ncu; ls /usr/local/cuda*/bin 2>&1 | head -40) > $O/tools.txt 2>&1
LC=$LCW/llama.cpp
B=$LC/build/bin/llama-bench
if [ ! -x $B ]; then
  [ -d $LC ] || tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C $LCW
  ( cd $LC && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
      > $O/depth/llamacpp_cmake.log 2>&1 && { time nice -n 19 timeout 420 cmake --build build --target llama-bench -j 14 ; } \
      > $O/depth/llamacpp_build.log 2>&1 ) &
  BP=$!
else
  BP=
fi
timeout 300 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache18 PY=python3 PYTEST_ARGS="-k 'not vulkan'" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?"; tail -3 $O/gpu_suite.log
dep() {  # cache, presets, out name, env
  env $4 timeout 120 python3 benchmarks/gpu_decode.py depth --cache $1 --presets $2 --plain "" --context 8448 \
    --prompts 4096,8192 --depths 0 --gen 128 --repeats 2 --out $O/depth/$3.json > $O/depth/$3.log 2>&1
  stamp "$3 rc=$?"; grep -E "PREFILL|DECODE|Error" $O/depth/$3.log | cut -c1-200
}
dep scratch/s18/mma llama2-7b mma7b_r1 LLMCHAT_CUDA_GEMM=
dep scratch/s18/wmma llama2-7b wmma7b_r1 LLMCHAT_CUDA_GEMM=wmma
dep scratch/s18/mma llama2-7b mma7b_r2 LLMCHAT_CUDA_GEMM=
dep scratch/s18/wmma llama3-8b wmma8b_r2 LLMCHAT_CUDA_GEMM=wmma
dep scratch/s18/mma llama3-8b mma8b_r3 LLMCHAT_CUDA_GEMM=
( cd scratch/s18 && ./gemm_check > $O/depth/gemm_check.log 2>&1 ); stamp "gemm_check rc=$?"
for m in llama3-8b llama2-7b; do
  [ -f $LCW/$m.gguf ] || nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset $m --gguf-py $LC/gguf-py --vocab-dir $LC/models --out $LCW/$m.gguf >> $O/depth/gguf.log 2>&1
done
stamp gguf
[ -n "$BP" ] && { wait $BP; stamp "llama.cpp build rc=$?"; tail -4 $O/depth/llamacpp_build.log; }
if [ -x $B ]; then
  for m in llama2-7b llama3-8b; do
    timeout 80 $B -m $LCW/$m.gguf -p 4096,8192 -n 0 -ngl 99 -r 2 -fa 1 -o json > $O/depth/lb_pp_$m.json 2>> $O/depth/lb.log; stamp "lb pp $m rc=$?"
  done
  python3 -c "
import json
for m in ('llama2-7b','llama3-8b'):
  for r in json.load(open('$O/depth/lb_pp_'+m+'.json')): print('llama.cpp', m, r['n_prompt'], round(r['avg_ts'],1), [round(x,1) for x in r.get('samples_ts',[])])
"
fi
(cd $O && tar czf depth.tgz depth env && rm -rf depth env)
stamp done
