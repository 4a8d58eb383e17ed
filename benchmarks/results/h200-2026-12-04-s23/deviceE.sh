#!/bin/bash
# session 23 call E: the product (prompt GEMM and prompt attention; libraries of this tree,
# ab23c/cur, WGSL identical to call C's ab23b/cur) next to llama.cpp's Vulkan llama-bench (fa 1):
# the WGSL copy, all three shapes by the bench protocol and pp512; then Llama-2-7B's prompts of
# 512 / 2,048 / 3,584 tokens and decode after 0 / 1,024 / 3,072 keys (context 4,096) next to
# llama.cpp's -p 512,2048,3584 and -d 0,1024,3072
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
stamp "copy: $(timeout 60 python3 benchmarks/gpu_decode.py wgsl-copy --lib scratch/vk/wgsl_copy.so 2>&1 | tail -1) TB/s"
FA=1 VK_CACHE=scratch/ab23c/cur timeout 240 bash benchmarks/run_h200_vulkan.sh vulkan $O/vk
stamp "run_h200_vulkan rc=$?"
grep -o '"decode_tok_s": [0-9.]*\|"prefill_tok_s": [0-9.]*\|"roofline_pct": [0-9.]*' $O/vk/vulkan.log | paste -sd' '
cat $O/vk/copy_bw.json
python3 - $O/vk/llamacpp_vulkan.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r.get("model_filename", "?")[-24:], r.get("n_prompt"), r.get("n_gen"), round(r.get("avg_ts", 0), 1), [round(x, 1) for x in r.get("samples_ts", [])])
PY
timeout 120 python3 benchmarks/gpu_decode.py depth --backend vulkan --cache scratch/ab23dd/cur \
  --presets llama2-7b --context 4096 --prompts 512,2048,3584 --depths 0,1024,3072 --gen 128 --repeats 2 \
  --out $O/depth_cur.json > $O/depth_cur.log 2>&1
stamp "depth rc=$?: $(grep -E '^(DECODE|PREFILL)' $O/depth_cur.log | cut -c1-90 | paste -sd'|')"
W=/tmp/lc; mkdir -p $W; tar xzf scratch/vk/lcpp/llama.cpp-gguf.tgz -C $W
xz -dc scratch/vk/lcpp/llama-bench-vulkan.xz > $W/llama-bench && chmod +x $W/llama-bench
timeout 60 python3 benchmarks/gpu_decode.py make-gguf --preset llama2-7b --gguf-py $W/llama.cpp/gguf-py \
  --vocab-dir $W/llama.cpp/models --out $W/7b.gguf > $O/gguf.log 2>&1
timeout 80 $W/llama-bench -m $W/7b.gguf -p 512,2048,3584 -n 0 -ngl 99 -r 2 -fa 1 -o json > $O/llamacpp_prompts.json 2> $O/llamacpp_prompts.log
stamp "llama-bench prompts rc=$?"
timeout 80 $W/llama-bench -m $W/7b.gguf -p 0 -n 128 -d 0,1024,3072 -ngl 99 -r 2 -fa 1 -o json > $O/llamacpp_depth.json 2> $O/llamacpp_depth.log
stamp "llama-bench depth rc=$?"
python3 - $O/llamacpp_prompts.json $O/llamacpp_depth.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f)):
        print("llama.cpp", "p", r.get("n_prompt"), "n", r.get("n_gen"), "d", r.get("n_depth"), round(r.get("avg_ts", 0), 1))
PY
cd $O && tar czf /tmp/e.tgz --exclude=all.tgz . && find . -mindepth 1 -maxdepth 1 ! -name commit.txt -exec rm -rf {} + && mv /tmp/e.tgz $O/callE.tgz
stamp done
