#!/bin/bash
# session 23 call B: where a 512-token prompt's GPU time goes (vulkan_profile.py --prefill, the
# profiler's timestamps), new prompt GEMM (ab23a/cur) and the scheduled one (ab23a/gtiled)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
mkdir -p $O/r
for set in cur gtiled; do
  LLMCHAT_WEBGPU_PROFILE=1 timeout 200 python3 benchmarks/vulkan_profile.py --cache scratch/ab23a/$set \
    --presets llama2-7b,qwen2.5-0.5b --steps 16 --prefill 512 > $O/r/prof_$set.log 2>&1
  stamp "profile $set rc=$?"
  python3 - $O/r/prof_$set.log <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if '"prefill_tokens"' in line:
        d = json.loads(line)
        top = " ".join(f"{k['name'][:34]}:{k['ms']}" for k in d["kernels"][:9])
        print(f"  {d['preset']} wall {d['wall_ms']} ms GPU {d['gpu_ms']} ms; {top}")
PY
done
cd $O && tar czf /tmp/b.tgz r env addon_build.log commit.txt && rm -rf r && mv /tmp/b.tgz $O/callB.tgz
stamp done
