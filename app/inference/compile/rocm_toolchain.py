"""Make TVM's ROCm back end find AMD's device bitcode and a new enough ``ld.lld`` while it compiles
(shims in the cache directory point at what the distribution installed)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from app import paths
from app.errors import LlmchatError

_BITCODE_DIRS = (
    "/opt/rocm/amdgcn/bitcode",
    "/opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode",
    "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode",
    "/usr/lib/amdgcn/bitcode",
    "/usr/share/amdgcn/bitcode",
)


def _newest_lld() -> str | None:
    """The newest ``ld.lld-NN`` (NN >= 17: older ones reject LLVM 22's code objects), or None."""
    import glob
    import re

    found = []
    for d in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/lib/llvm-*/bin"]:
        for path in glob.glob(os.path.join(d, "ld.lld*")):
            m = re.search(r"ld\.lld-(\d+)$", path) or re.search(r"llvm-(\d+)/bin/ld\.lld$", path)
            if m and int(m.group(1)) >= 17 and os.access(path, os.X_OK):
                found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


@contextlib.contextmanager
def rocm_toolchain() -> Any:
    """Make TVM's ROCm back end find device bitcode and a new enough ``ld.lld`` while compiling.

    TVM wants ``$ROCM_PATH/amdgcn/bitcode`` and tries ``ld.lld-22`` then ``ld.lld``; distributions
    ship the bitcode elsewhere (Debian: rocm-device-libs) and lld as ``ld.lld-NN``, so shims in the
    cache directory point at what is installed.  Raises LlmchatError naming what is missing."""
    import glob
    import shutil

    shim = paths.cache_dir() / "toolchain"
    env: dict[str, str] = {}
    rocm = os.environ.get("ROCM_PATH")
    if not (rocm and os.path.isdir(os.path.join(rocm, "amdgcn", "bitcode"))):
        bitcode = next(
            (
                p
                for pat in _BITCODE_DIRS
                for p in sorted(glob.glob(pat))
                if os.path.isfile(os.path.join(p, "ocml.bc"))
            ),
            None,
        )
        if bitcode is None:
            raise LlmchatError(
                "Compiling for ROCm needs AMD's device bitcode libraries (ocml.bc, ockl.bc).",
                "install ROCm, or the `rocm-device-libs` package, or set ROCM_PATH",
            )
        link = shim / "rocm" / "amdgcn" / "bitcode"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(bitcode)
        env["ROCM_PATH"] = str(shim / "rocm")
    lld = None if shutil.which("ld.lld-22") else _newest_lld()
    if lld is None and not (shutil.which("ld.lld-22") or shutil.which("ld.lld")):
        raise LlmchatError(
            "Compiling for ROCm needs the LLVM linker ld.lld (version 17 or newer).",
            "install lld (e.g. `apt install lld-19`) or ROCm",
        )
    if lld is not None:
        bindir = shim / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        target = bindir / "ld.lld"
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(lld)
        env["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
