"""Build and load llmchat's WebGPU device API for TVM (``native/llmchat_webgpu.cc``).

The add-on is compiled once per (source, TVM, wgpu-native, compiler) into the cache directory
with the system C++ compiler (``c++``/``g++``/``clang++``) or, where there is none (SteamOS),
PyPI's ``ziglang`` (``python -m ziglang c++``).  ``make`` builds it at install time
(``python -m app.inference.backends.webgpu.addon``); the first Vulkan use builds it if the cache
was cleared.  Loading it registers ``device_api.webgpu`` and the module loader in TVM's runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from app import paths
from app.errors import LlmchatError

SOURCE = Path(__file__).parent / "native" / "llmchat_webgpu.cc"
LIB_NAME = "libllmchat_webgpu"
#: bump when the compiler or linker flags change (part of the add-on's cache key)
BUILD_FLAGS = "3"

_lock = threading.Lock()
_loaded: Path | None = None


@dataclass(frozen=True)
class Toolchain:
    """The compiler command that builds the add-on."""

    argv: tuple[str, ...]
    name: str  # "g++ 12.2.0", "zig 0.17.1"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def wgpu_library() -> Path | None:
    """wgpu-native as bundled in PyPI's ``wgpu`` package (None when it is not installed)."""
    pkg = _package_dir("wgpu")
    if pkg is None:
        return None
    found = sorted((pkg / "resources").glob("libwgpu_native*.so"))
    return found[0] if found else None


def find_toolchain() -> Toolchain | None:
    """A C++17 compiler: ``LLMCHAT_CXX``, the system's, or ``ziglang`` from PyPI."""
    forced = os.environ.get("LLMCHAT_CXX", "").strip()
    if forced:
        if forced == "zig":
            return _zig()
        return Toolchain(tuple(forced.split()), forced)
    for cxx in ("c++", "g++", "clang++"):
        path = shutil.which(cxx)
        if path:
            return Toolchain((path,), _version_of(path))
    return _zig()


def _zig() -> Toolchain | None:
    if importlib.util.find_spec("ziglang") is None:
        return None
    return Toolchain((sys.executable, "-m", "ziglang", "c++"), f"zig {_zig_version()}")


def _zig_version() -> str:
    try:
        from importlib.metadata import version

        return version("ziglang")
    except Exception:  # metadata missing: still usable
        return "unknown"


def _version_of(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return path
    return (out.splitlines() or [path])[0].strip()


def _inputs() -> tuple[Path, Path, Path, Path, Path]:
    import tvm
    import tvm_ffi

    tvm_pkg = Path(tvm.__file__).parent
    ffi_pkg = Path(tvm_ffi.__file__).parent
    wgpu_lib = wgpu_library()
    if wgpu_lib is None:
        raise LlmchatError("Vulkan needs the `wgpu` package (it bundles wgpu-native).",
                           f"`{sys.executable} -m pip install wgpu`")
    runtime = tvm_pkg / "lib" / "libtvm_runtime.so"
    ffi_lib = ffi_pkg / "lib" / "libtvm_ffi.so"
    return tvm_pkg, ffi_pkg, wgpu_lib, runtime, ffi_lib


def library_path(toolchain: Toolchain | None = None) -> Path:
    """Where the add-on for this source, TVM, wgpu-native and compiler lives in the cache."""
    import tvm

    _tvm_pkg, _ffi_pkg, wgpu_lib, runtime, _ffi_lib = _inputs()
    toolchain = toolchain or find_toolchain()
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(tvm.__version__.encode())
    h.update(str(runtime.resolve()).encode())
    h.update(str(wgpu_lib.resolve()).encode())
    h.update(str(wgpu_lib.stat().st_size).encode())
    h.update((toolchain.name if toolchain else "none").encode())
    h.update(BUILD_FLAGS.encode())
    return paths.cache_dir() / "native" / f"{LIB_NAME}-{h.hexdigest()[:16]}.so"


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the add-on into the cache (atomically) unless it is there; returns its path."""
    toolchain = find_toolchain()
    out = library_path(toolchain)
    if out.is_file() and not force:
        return out
    if toolchain is None:
        raise LlmchatError(
            "Vulkan needs llmchat's small native add-on, and no C++ compiler was found to build it.",
            f"install one (`sudo apt install g++`, `sudo pacman -S gcc`) or `{sys.executable} -m pip install "
            "ziglang` (a compiler in a Python package; works on SteamOS)")
    tvm_pkg, ffi_pkg, wgpu_lib, runtime, ffi_lib = _inputs()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    is_zig = "ziglang" in toolchain.argv
    rpath = ":".join(str(p.parent.resolve()) for p in (runtime, ffi_lib, wgpu_lib))
    argv = [
        *toolchain.argv, "-std=c++17", "-O2", "-fPIC", "-shared", "-o", tmp, str(SOURCE),
        f"-I{tvm_pkg / 'include'}", f"-I{ffi_pkg / 'include'}", f"-I{tvm_pkg / 'src' / 'runtime'}",
        f"-I{wgpu_lib.parent}",
        # by file name, found through the rpath: wgpu-native has no SONAME, and a path here would
        # be recorded as is
        f"-L{runtime.parent.resolve()}", "-ltvm_runtime", f"-L{ffi_lib.parent.resolve()}", "-ltvm_ffi",
        f"-L{wgpu_lib.parent.resolve()}", f"-l:{wgpu_lib.name}",
        f"-Wl,-rpath,{rpath}",
    ]
    if is_zig:
        # zig's clang links its own libc++ (TVM's libraries use libstdc++): the add-on passes no
        # C++ types across, but an exception from a device-API call cannot cross (printed first)
        argv += ["-target", "native-linux-gnu", "-DLLMCHAT_PRINT_ERRORS"]
    else:
        argv += ["-Wl,--no-undefined"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise LlmchatError(f"Building the Vulkan add-on with {toolchain.name} failed: {err}",
                           "install g++ (or `pip install ziglang`) and try again") from err
    if proc.returncode != 0:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        raise LlmchatError(
            f"Building the Vulkan add-on with {toolchain.name} failed:\n" + "\n".join(tail),
            "report this with the message above; meanwhile use --device cpu")
    if verbose:
        print(f"built {out} with {toolchain.name}", file=sys.stderr)
    os.replace(tmp, out)
    return out


def _runtime_env() -> None:
    # Vulkan WSI loaders look for XDG_RUNTIME_DIR; headless sessions (CI, ssh) often have none
    if not os.environ.get("XDG_RUNTIME_DIR"):
        d = Path(tempfile.gettempdir()) / f"llmchat-xdg-{os.getuid()}"
        d.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(d)


def load() -> Path:
    """Build if needed and load the add-on into this process (once); returns its path."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        import tvm

        _runtime_env()
        path = build()
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            # a damaged cached build: rebuild once
            try:
                path = build(force=True)
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as err2:
                raise LlmchatError(f"Could not load the Vulkan add-on {path}: {err2}",
                                   "delete it (it is rebuilt) or use --device cpu") from err
        if tvm.get_global_func("llmchat.webgpu.version", allow_missing=True) is None:
            raise LlmchatError(f"The Vulkan add-on {path} loaded but registered nothing.",
                               "delete it (it is rebuilt) or use --device cpu")
        _loaded = path
        return path


def loaded() -> bool:
    return _loaded is not None


if __name__ == "__main__":  # `make` builds the add-on at install time
    try:
        print(build(force="--force" in sys.argv, verbose=True))
    except LlmchatError as err:
        print(f"llmchat: the Vulkan add-on was not built: {err}", file=sys.stderr)
        sys.exit(0 if "--optional" in sys.argv else 1)
