"""Build and load llmchat's ROCm runtime for TVM (``native/llmchat_hip.cc``), or its CUDA twin.

Built like the Vulkan add-on (:mod:`app.inference.backends.native_build`: the system C++
compiler or PyPI's ``ziglang``) against the apache-tvm wheel alone: HIP is opened at run time
(``dlopen`` of ``libamdhip64.so.7``/``.6``/``.5``), so no ROCm is needed to build or to load it.

The runtime it registers is chosen when it is loaded, by ``LLMCHAT_GPU_RUNTIME``:
unset (or ``hip``): ``device_api.rocm`` and ``ffi.Module.load_from_bytes.hip`` over HIP;
``twin``: the same code over NVIDIA's driver API (libcuda.so.1), registered as
``device_api.cuda`` and ``ffi.Module.load_from_bytes.cuda`` in place of TVM's own CUDA
runtime, for testing the ROCm runtime's shared code on an NVIDIA GPU.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from app.inference.backends.native_build import AddOn, Toolchain, find_toolchain

__all__ = [
    "SOURCE",
    "Toolchain",
    "build",
    "describe",
    "find_toolchain",
    "library_path",
    "load",
    "loaded",
    "mode",
    "status",
]

SOURCE = Path(__file__).parent / "native" / "llmchat_hip.cc"
#: bump when the compiler or linker flags change (part of the add-on's cache key)
BUILD_FLAGS = "1"
TWIN = "twin"

_lock = threading.Lock()

#: declarations the wheel's tvm/runtime/vm/vm.h includes but the wheel does not ship
SHIM = Path(__file__).parent / "native" / "shim"

ADDON = AddOn(
    source=SOURCE,
    lib_name="libllmchat_hip",
    what="ROCm",
    registered="llmchat.gpu.version",
    build_flags=BUILD_FLAGS,
    extra_inputs=lambda: sorted(SHIM.rglob("*.h")),
    extra_flags=lambda: (f"-I{SHIM}",),
)


def mode() -> str:
    """``"twin"`` when ``LLMCHAT_GPU_RUNTIME=twin`` (the CUDA twin), else ``"hip"``."""
    return TWIN if os.environ.get("LLMCHAT_GPU_RUNTIME", "").strip().lower() == TWIN else "hip"


def library_path(toolchain: Toolchain | None = None) -> Path:
    """Where the add-on for this source, TVM and compiler lives in the cache."""
    return ADDON.library_path(toolchain)


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the add-on into the cache (atomically) unless it is there; returns its path."""
    return ADDON.build(force=force, verbose=verbose)


def load() -> Path:
    """Build if needed and load the add-on (once per process, in the mode of ``LLMCHAT_GPU_RUNTIME``
    at that moment); returns its path."""
    return ADDON.load(_lock)


def loaded() -> bool:
    return ADDON.loaded


def status() -> dict[str, Any]:
    """The runtime's view (loads the add-on): which runtime, the driver library found or why
    not, and the devices with their gfx/sm architecture, wave size and memory."""
    load()
    import tvm

    return json.loads(str(tvm.get_global_func("llmchat.gpu.status")()))


def describe(module: Any) -> dict[str, Any]:
    """What a GPU module loaded by this runtime holds: format, kernels with their argument
    types and launch tags, and for a ROCm code object its gfx target, each kernel's wave size
    (from its kernel descriptor) and the undefined symbols it has."""
    import tvm

    return json.loads(str(tvm.get_global_func("llmchat.gpu.describe")(module)))


if __name__ == "__main__":  # `make` builds the add-on at install time
    sys.exit(ADDON.main(sys.argv[1:]))
