# Sourced at the start of a device script on the GPU machine (the device tool's H200), in the
# repository root: unpacks the carried Vulkan loader (.gl/*.deb), points the loader at NVIDIA's ICD
# where the image does not register it, installs the carried wheels (.whl/, and scratch/whl-hub/
# where carried) into /tmp/site, and exports what llmchat's code needs there. Made by
# benchmarks/device_kit.sh on the developer's machine; carry .whl and .gl (and scratch/whl-hub).
# Sets OUTDIR (default $OUT) and a stamp function: `stamp "text"` prints "[Ns] text".
for f in .gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
ldconfig
if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1 \
    && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
OUTDIR=${OUTDIR:-${OUT:-/tmp/out}}
mkdir -p "$OUTDIR"
_wheels=$(ls .whl/*.whl scratch/whl-hub/*.whl 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $_wheels > "$OUTDIR/pip.log" 2>&1 || { tail "$OUTDIR/pip.log"; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export LLMCHAT_CACHE_DIR=${LLMCHAT_CACHE_DIR:-/tmp/llmchat-cache}  # the add-on is built there
git log -1 --format=%H > "$OUTDIR/commit.txt" 2>/dev/null
nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1
_device_env_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - _device_env_start ))s] $*"; }
