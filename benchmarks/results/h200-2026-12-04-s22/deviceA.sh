#!/bin/bash
# session 22 call A: what each of the 7B's kernels costs the real decode step where it runs
# (LLMCHAT_WEBGPU_SKIP=NAME: the kernels whose name contains NAME dispatch nothing), by the bench
# protocol (gpu_decode.py run: 1-token prompt, 512 tokens, best of 3), the default's libraries
# (scratch/ab21f, compiled at 0ab7ada: TIR identical at this tree). A repeat (call F of session 21)
# finds the weights of its first dispatch in the L2 cache; a skip does not change what the others find
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
i=0
for s in "" dequant_matmul5_ batch_decode_paged_kv dequant_matmul6_ dequant_matmul7_ dequant_matmul8_ dequant_matmul4_ ""; do
  i=$((i+1))
  LLMCHAT_WEBGPU_SKIP="$s" timeout 90 python3 benchmarks/gpu_decode.py run --backend vulkan --cache scratch/ab21f/cur \
    --presets llama2-7b --plain "" --check-steps 2 --out "$O/skip_$i.json" > "$O/skip_$i.log" 2>&1
  stamp "skip '$s' rc=$?: $(grep -o '"decode_tok_s": [0-9.]*' "$O/skip_$i.log" | paste -sd' ')"
done
LLMCHAT_WEBGPU_PROFILE=1 timeout 60 python3 benchmarks/vulkan_profile.py --cache scratch/ab21f/cur --presets llama2-7b \
  --steps 64 > $O/gpuprof.log 2>&1; stamp "profile rc=$?"
cd $O && tar czf /tmp/a.tgz . && mv /tmp/a.tgz $O/callA.tgz
stamp done
