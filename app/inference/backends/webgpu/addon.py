"""Build and load llmchat's WebGPU device API for TVM (``native/llmchat_webgpu.cc``).

The add-on is compiled once per (source, TVM, wgpu-native, compiler) into the cache directory
by :mod:`app.inference.backends.native_build` (the system C++ compiler or PyPI's ``ziglang``).
``make`` builds it at install time (``python -m app.inference.backends.webgpu.addon``); the
first Vulkan use builds it if the cache was cleared.  Loading it registers ``device_api.webgpu``
and the module loader in TVM's runtime.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

from app.errors import LlmchatError
from app.inference.backends.native_build import AddOn, Toolchain, find_toolchain, package_dir

__all__ = ["SOURCE", "Toolchain", "build", "find_toolchain", "library_path", "load", "loaded", "wgpu_library"]

SOURCE = Path(__file__).parent / "native" / "llmchat_webgpu.cc"
LIB_NAME = "libllmchat_webgpu"
#: bump when the compiler or linker flags change (part of the add-on's cache key)
BUILD_FLAGS = "3"

_lock = threading.Lock()


def wgpu_library() -> Path | None:
    """wgpu-native as bundled in PyPI's ``wgpu`` package (None when it is not installed)."""
    pkg = package_dir("wgpu")
    if pkg is None:
        return None
    found = sorted((pkg / "resources").glob("libwgpu_native*.so"))
    return found[0] if found else None


def _wgpu_or_fail() -> Path:
    lib = wgpu_library()
    if lib is None:
        raise LlmchatError(
            "Vulkan needs the `wgpu` package (it bundles wgpu-native).",
            f"`{sys.executable} -m pip install wgpu`",
        )
    return lib


def _flags() -> list[str]:
    lib = _wgpu_or_fail()
    # by file name, found through the rpath: wgpu-native has no SONAME, and a path here would be
    # recorded as is
    return [f"-I{lib.parent}", f"-L{lib.parent.resolve()}", f"-l:{lib.name}"]


def _runtime_env() -> None:
    # Vulkan WSI loaders look for XDG_RUNTIME_DIR; headless sessions (CI, ssh) often have none
    if not os.environ.get("XDG_RUNTIME_DIR"):
        d = Path(tempfile.gettempdir()) / f"llmchat-xdg-{os.getuid()}"
        d.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(d)


ADDON = AddOn(
    source=SOURCE,
    lib_name=LIB_NAME,
    what="Vulkan",
    registered="llmchat.webgpu.version",
    build_flags=BUILD_FLAGS,
    extra_inputs=lambda: (_wgpu_or_fail(),),
    extra_flags=_flags,
    extra_rpath=lambda: (_wgpu_or_fail().parent,),
    before_load=_runtime_env,
)


def library_path(toolchain: Toolchain | None = None) -> Path:
    """Where the add-on for this source, TVM, wgpu-native and compiler lives in the cache."""
    return ADDON.library_path(toolchain)


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the add-on into the cache (atomically) unless it is there; returns its path."""
    return ADDON.build(force=force, verbose=verbose)


def load() -> Path:
    """Build if needed and load the add-on into this process (once); returns its path."""
    return ADDON.load(_lock)


def loaded() -> bool:
    return ADDON.loaded


if __name__ == "__main__":  # `make` builds the add-on at install time
    sys.exit(ADDON.main(sys.argv[1:]))
