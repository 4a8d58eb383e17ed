#!/bin/bash
# session 21 call F: what one more dispatch of each of the 7B's per-layer kernels costs the real
# decode step (LLMCHAT_WEBGPU_REPEAT through vulkan_profile.py --repeat: the GPU wait per step with
# that kernel dispatched twice, minus the wait without), the new default's libraries (scratch/ab21f)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
for r in "" dequant_matmul5_ batch_decode_paged_kv_kernel dequant_matmul6_ dequant_matmul7_ dequant_matmul8_ ""; do
  timeout 40 python3 benchmarks/vulkan_profile.py --cache scratch/ab21f/cur --presets llama2-7b --steps 64 \
    --repeat "$r" >> $O/repeat.log 2>&1
  stamp "repeat '$r' rc=$?: $(tail -1 $O/repeat.log | grep -o '"ms_per_step": [0-9.]*, "dispatches_per_step": [0-9.]*\|"wait_ms_per_step": [0-9.]*' | paste -sd' ')"
done
stamp done
