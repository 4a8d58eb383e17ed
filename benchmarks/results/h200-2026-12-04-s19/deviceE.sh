#!/bin/bash
# session 19 call E: the Vulkan dispatch floor by copy size (informational, issue #15)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
python3 -m app.inference.backends.webgpu.addon > $O/addon_build.log 2>&1; stamp "addon rc=$?"
# floor.py's loop is now: python3 benchmarks/vulkan_profile.py --presets "" --copy-lib scratch/vk/wgsl_copy.so
timeout 150 python3 scratch/s19/floor.py scratch/vk/wgsl_copy.so > $O/floor.jsonl 2> $O/floor.err
stamp "floor rc=$?"; cat $O/floor.jsonl; tail -3 $O/floor.err
