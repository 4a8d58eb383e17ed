#!/bin/bash
# session 19 call C: int8-q8n (four-thread epilogue) A/B; then the default next to llama.cpp's
# Vulkan build, and int8-q8n's libraries by the same protocol in the same call
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/ab
BENCH=1 BUDGET_S=150 OUTDIR=$O/ab PRESETS=qwen2.5-3b,llama2-7b bash benchmarks/wgsl_gemv_ab.sh run scratch/ab19c cur q8n cur q8n
FA=1 VK_CACHE=scratch/ab19c/cur timeout 300 bash benchmarks/run_h200_vulkan.sh vulkan $O/vk
stamp "run_h200_vulkan rc=$?"
WBW=$(python3 -c "import json; print(json.load(open('$O/vk/copy_bw.json'))['wgsl_copy_TBps'] or 0)" 2>/dev/null)
LLMCHAT_WGSL_FUSION=int8-q8n timeout 150 python3 benchmarks/gpu_decode.py run --backend vulkan --cache scratch/ab19c/q8n \
  --presets qwen2.5-0.5b,qwen2.5-3b,llama2-7b --plain "" --check-steps 8 --copy-bw "${WBW:-0}" \
  --out $O/vk_q8n.json > $O/vk_q8n.log 2>&1
stamp "q8n run rc=$?: $(grep -o '"decode_tok_s": [0-9.]*' $O/vk_q8n.log | paste -sd' ')"
grep -o '"decode_tok_s": [0-9.]*' $O/vk/vulkan.log | paste -sd' '
python3 - $O/vk/llamacpp_vulkan.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r.get("model_filename", "?")[-30:], r.get("n_prompt"), r.get("n_gen"), round(r.get("avg_ts", 0), 1), [round(x, 1) for x in r.get("samples_ts", [])])
PY
cd $O && tar czf /tmp/c.tgz --exclude=all.tgz . && mv /tmp/c.tgz $O/callC.tgz
stamp done
