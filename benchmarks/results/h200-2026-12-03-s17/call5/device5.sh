#!/bin/bash
# session 17 call 5: the GPU suite's CUDA tests on the final code (cache built here), then the
# Llama-3-8B and Llama-2-7B shapes at depth next to llama.cpp (CUDA, built here meanwhile, niced)
set -u
R=$PWD; O=$OUT; WORK=/tmp/dw; mkdir -p $WORK $O/depth
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
LC=$WORK/llama.cpp
tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C $WORK
( cd $LC && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
    > $O/depth/llamacpp_cmake.log 2>&1 && { time nice -n 19 timeout 450 cmake --build build --target llama-bench -j 14 ; } \
    > $O/depth/llamacpp_build.log 2>&1 ) &
BP=$!
timeout 260 make test-gpu-prebuilt GPU_CACHE=scratch/gpu-test-cache17 PY=python3 PYTEST_ARGS="-k 'not vulkan'" > $O/gpu_suite.log 2>&1
stamp "suite rc=$?"; tail -3 $O/gpu_suite.log
( nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset llama3-8b --gguf-py $LC/gguf-py --vocab-dir $LC/models --out $WORK/llama3-8b.gguf > $O/depth/gguf.log 2>&1
  nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset llama2-7b --gguf-py $LC/gguf-py --vocab-dir $LC/models --out $WORK/llama2-7b.gguf >> $O/depth/gguf.log 2>&1 ) &
GP=$!
dep() {  # presets, out name
  timeout 150 python3 benchmarks/gpu_decode.py depth --cache scratch/s17/final --presets $1 --plain "" --context 8448 \
    --prompts 4096,8192 --depths 0,4096,8192 --gen 128 --repeats 2 --out $O/depth/$2.json > $O/depth/$2.log 2>&1
  stamp "$2 rc=$?"; grep -E "PREFILL|DECODE|Error" $O/depth/$2.log | cut -c1-200
}
dep llama3-8b final8b_r1
dep llama2-7b final7b_r1
dep llama3-8b final8b_r2
wait $GP; stamp "gguf rc=$?"
wait $BP; stamp "llama.cpp build rc=$?"; tail -4 $O/depth/llamacpp_build.log
B=$LC/build/bin/llama-bench
if [ -x $B ]; then
  for m in llama3-8b llama2-7b; do
    timeout 100 $B -m $WORK/$m.gguf -p 0 -n 128 -d 0,4096,8192 -ngl 99 -r 2 -fa 1 -o json > $O/depth/lb_tg_$m.json 2>> $O/depth/lb.log; stamp "lb tg $m rc=$?"
    timeout 80 $B -m $WORK/$m.gguf -p 4096,8192 -n 0 -ngl 99 -r 2 -fa 1 -o json > $O/depth/lb_pp_$m.json 2>> $O/depth/lb.log; stamp "lb pp $m rc=$?"
  done
  python3 -c "
import json
for m in ('llama3-8b','llama2-7b'):
  for f in ('lb_tg_','lb_pp_'):
    try: rows=json.load(open('$O/depth/'+f+m+'.json'))
    except Exception as e: print(m, f, e); continue
    for r in rows: print('llama.cpp', m, r['n_prompt'], r['n_gen'], r.get('n_depth',0), round(r['avg_ts'],1), [round(x,1) for x in r.get('samples_ts',[])])
"
fi
[ $(( $(date +%s) - _device_env_start )) -lt 500 ] && dep llama3-8b final8b_r3
(cd $O && tar czf depth.tgz depth env && rm -rf depth env)
stamp done
