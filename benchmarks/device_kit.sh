#!/bin/bash
# The carry kit for the GPU machine (the device tool's H200: Python 3.12, no TVM, no Vulkan loader,
# no network), made here from PyPI and Debian, into paths git ignores:
#   .whl/            apache-tvm repacked without lib/libtvm_compiler.so (runtime only, a few MB: the
#                    full wheel is over the carry limit; compile here, run there), apache-tvm-ffi,
#                    platformdirs, gguf, wgpu (+ cffi), keyring and its deps
#   scratch/whl-hub/ huggingface_hub of the version llmchat's venv has (the image's is older), with
#                    the needs the image lacks (httpx2, httpcore2) or has older (hf-xet, click)
#   .gl/             Debian's Vulkan loader and libglvnd (NVIDIA's ICD, from the driver, links libGLdispatch)
# Versions are those of this checkout's .venv, so what runs there is what was tested here.
# Usage: bash benchmarks/device_kit.sh   (then carry .whl, .gl, scratch/whl-hub)
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for p in /.whl/ /.gl/ /scratch/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
mkdir -p .whl scratch/whl-hub .gl /tmp/device-kit
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64"
get() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$1" "$2"; }
get /tmp/device-kit "apache-tvm==$(ver apache-tvm)"
get .whl "apache-tvm-ffi==$(ver apache-tvm-ffi)"
for n in platformdirs gguf wgpu cffi keyring jaraco.classes jaraco.context jaraco.functools \
         more-itertools SecretStorage jeepney; do get .whl "$n==$(ver "$n")"; done
for n in huggingface_hub httpx2 httpcore2 hf-xet click; do get scratch/whl-hub "$n==$(ver "$n")"; done
# the runtime-only TVM wheel: the same files less the compiler library and 3rdparty sources
rm -rf /tmp/device-kit/tvm && mkdir -p /tmp/device-kit/tvm
(cd /tmp/device-kit/tvm && unzip -q ../apache_tvm-*.whl && rm -rf tvm/lib/libtvm_compiler.so tvm/3rdparty \
  && "$OLDPWD/$PY" - <<'PY'
import base64, hashlib, pathlib, zipfile, glob
rec = glob.glob("*.dist-info/RECORD")[0]
lines = []
for p in sorted(pathlib.Path(".").rglob("*")):
    if p.is_file() and str(p) != rec:
        h = base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=").decode()
        lines.append(f"{p},sha256={h},{p.stat().st_size}")
lines.append(f"{rec},,")
pathlib.Path(rec).write_text("\n".join(lines) + "\n")
name = glob.glob("../apache_tvm-*.whl")[0].split("/")[-1]
with zipfile.ZipFile(f"../runtime-{name}", "w", zipfile.ZIP_DEFLATED) as z:
    for p in sorted(pathlib.Path(".").rglob("*")):
        if p.is_file():
            z.write(p, str(p))
PY
)
cp /tmp/device-kit/runtime-apache_tvm-*.whl .whl/"$(basename /tmp/device-kit/apache_tvm-*.whl)"
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
mkdir -p /tmp/amd64/partial
ls .gl/libglvnd0_*.deb >/dev/null 2>&1 || { apt-get $o update -qq && (cd .gl && apt-get $o download -qq libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2); }
du -sh .whl scratch/whl-hub .gl
