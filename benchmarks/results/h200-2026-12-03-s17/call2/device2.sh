#!/bin/bash
# session 17 call 2: Llama-3-8B at depth, the s17 library (new) against the session-start one
# (before), then llama.cpp (CUDA, built here meanwhile, niced) in the same call
set -u
R=$PWD; O=$OUT/depth; mkdir -p $O; WORK=/tmp/dw; mkdir -p $WORK
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $O/pip.log 2>&1 || { cat $O/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total,power.limit --format=csv > $O/nvidia-smi.txt 2>&1
START=$(date +%s); stamp() { echo "[$(( $(date +%s) - START ))s] $*"; }
LC=$WORK/llama.cpp
tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C $WORK
( cd $LC && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
    > $O/llamacpp_cmake.log 2>&1 && { time nice -n 19 timeout 430 cmake --build build --target llama-bench -j 15 ; } \
    > $O/llamacpp_build.log 2>&1 ) &
BP=$!
dep() {  # cache name, presets, out name
  timeout 150 python3 benchmarks/gpu_decode.py depth --cache scratch/s17/$1 --presets $2 --plain "" --context 8448 \
    --prompts 4096,8192 --depths 0,4096,8192 --gen 128 --repeats 2 --out $O/$3.json > $O/$3.log 2>&1
  stamp "$3 rc=$?"; grep -E "PREFILL|DECODE|Error" $O/$3.log | cut -c1-200
}
dep new llama3-8b new8b_r1
dep before llama3-8b before8b_r1
( cd $R && tar xzf scratch/depth/lcpp/llama.cpp-src.tgz -C $WORK llama.cpp/models llama.cpp/gguf-py 2>/dev/null;
  nice -n 5 python3 benchmarks/gpu_decode.py make-gguf --preset llama3-8b --gguf-py $LC/gguf-py --vocab-dir $LC/models --out $WORK/llama3-8b.gguf > $O/gguf.log 2>&1 ) &
GP=$!
dep new llama2-7b new7b_r1
wait $GP; stamp "gguf rc=$?"
[ $(( $(date +%s) - START )) -lt 300 ] && dep new llama3-8b new8b_r2
wait $BP; stamp "llama.cpp build rc=$?"; tail -4 $O/llamacpp_build.log
B=$LC/build/bin/llama-bench
if [ -x $B ]; then
  timeout 100 $B -m $WORK/llama3-8b.gguf -p 0 -n 128 -d 0,4096,8192 -ngl 99 -r 2 -fa 1 -o json > $O/lb_tg.json 2>> $O/lb.log; stamp "lb tg rc=$?"
  timeout 80 $B -m $WORK/llama3-8b.gguf -p 4096,8192 -n 0 -ngl 99 -r 2 -fa 1 -o json > $O/lb_pp.json 2>> $O/lb.log; stamp "lb pp rc=$?"
  python3 -c "
import json
for f in ('lb_tg','lb_pp'):
    try: rows=json.load(open('$O/'+f+'.json'))
    except Exception as e: print(f, e); continue
    for r in rows: print('llama.cpp', r['n_prompt'], r['n_gen'], r.get('n_depth',0), round(r['avg_ts'],1))
"
fi
[ $(( $(date +%s) - START )) -lt 470 ] && dep before llama3-8b before8b_r2
stamp done
