"""Build and load llmchat's native add-ons for TVM's runtime (the Vulkan/WebGPU one, the ROCm one).

An add-on is one C++ file compiled against the apache-tvm wheel's headers (``tvm/include``,
``tvm_ffi/include``, ``tvm/src/runtime`` for ``workspace_pool.h``) and linked with its
``libtvm_runtime``/``libtvm_ffi``.  It is compiled once per (source, TVM, extra inputs,
compiler, flags) into ``<cache>/native/<name>-<hash>.so`` with the system C++ compiler
(``c++``/``g++``/``clang++``) or, where there is none (SteamOS), PyPI's ``ziglang``
(``python -m ziglang c++``), written atomically, and loaded with ``RTLD_GLOBAL`` so that its
static initialisers register its device API and module loader in TVM's runtime.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app import paths
from app.errors import LlmchatError

#: headers the add-ons share (TVM's function-table format)
COMMON_HEADERS = Path(__file__).parent / "native"


@dataclass(frozen=True)
class Toolchain:
    """The compiler command that builds an add-on."""

    argv: tuple[str, ...]
    name: str  # "g++ 12.2.0", "zig 0.17.1"

    @property
    def is_zig(self) -> bool:
        return "ziglang" in self.argv


def package_dir(name: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


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


@dataclass(frozen=True)
class TvmInputs:
    """The wheel's include directories and runtime libraries an add-on builds against."""

    tvm_pkg: Path
    ffi_pkg: Path
    runtime: Path  # libtvm_runtime.so
    ffi_lib: Path  # libtvm_ffi.so

    @classmethod
    def installed(cls) -> TvmInputs:
        import tvm
        import tvm_ffi

        tvm_pkg = Path(tvm.__file__).parent
        ffi_pkg = Path(tvm_ffi.__file__).parent
        return cls(tvm_pkg, ffi_pkg, tvm_pkg / "lib" / "libtvm_runtime.so", ffi_pkg / "lib" / "libtvm_ffi.so")


@dataclass
class AddOn:
    """One native add-on: its source, what it is called in messages, and what else it links.

    ``extra_inputs`` returns files that are part of the cache key (a bundled library it links);
    ``extra_flags`` the compiler/linker flags for them; ``what`` names the feature in messages
    ("Vulkan", "ROCm"); ``registered`` is a global function the add-on registers when loaded."""

    source: Path
    lib_name: str
    what: str
    registered: str
    build_flags: str = "1"
    extra_inputs: Callable[[], Sequence[Path]] = field(default=lambda: ())
    extra_flags: Callable[[], Sequence[str]] = field(default=lambda: ())
    extra_rpath: Callable[[], Sequence[Path]] = field(default=lambda: ())
    before_load: Callable[[], None] = field(default=lambda: None)
    _loaded: Path | None = None

    def library_path(self, toolchain: Toolchain | None = None) -> Path:
        """Where the add-on for this source, TVM, inputs and compiler lives in the cache."""
        import tvm

        tvm_in = TvmInputs.installed()
        toolchain = toolchain or find_toolchain()
        h = hashlib.sha256()
        h.update(self.source.read_bytes())
        for header in sorted(COMMON_HEADERS.glob("*.h")):  # shared by the add-ons (#include "../../native/…")
            h.update(header.name.encode())
            h.update(header.read_bytes())
        h.update(tvm.__version__.encode())
        h.update(str(tvm_in.runtime.resolve()).encode())
        for extra in self.extra_inputs():
            h.update(str(extra.resolve()).encode())
            h.update(str(extra.stat().st_size).encode())
        h.update((toolchain.name if toolchain else "none").encode())
        h.update(self.build_flags.encode())
        return paths.cache_dir() / "native" / f"{self.lib_name}-{h.hexdigest()[:16]}.so"

    def buildable(self) -> bool:
        """Whether the add-on is built for this install, or a compiler is there to build it."""
        if find_toolchain() is not None:
            return True
        try:
            return self.library_path(None).is_file()
        except Exception:  # no TVM or no wgpu: not buildable
            return False

    def build(self, force: bool = False, verbose: bool = False) -> Path:
        """Compile the add-on into the cache (atomically) unless it is there; returns its path."""
        toolchain = find_toolchain()
        out = self.library_path(toolchain)
        if out.is_file() and not force:
            return out
        if toolchain is None:
            raise LlmchatError(
                f"{self.what} needs llmchat's small native add-on, and no C++ compiler was found "
                "to build it.",
                "install one (`sudo apt install g++`, `sudo pacman -S gcc`) or "
                f"`{sys.executable} -m pip install ziglang` (a compiler in a Python package; "
                "works on SteamOS)",
            )
        tvm_in = TvmInputs.installed()
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".so.tmp", dir=out.parent)
        os.close(fd)
        rpath_dirs = [
            tvm_in.runtime.parent.resolve(),
            tvm_in.ffi_lib.parent.resolve(),
            *(p.resolve() for p in self.extra_rpath()),
        ]
        rpath = ":".join(str(p) for p in dict.fromkeys(rpath_dirs))
        argv = [
            *toolchain.argv,
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-o",
            tmp,
            str(self.source),
            f"-I{tvm_in.tvm_pkg / 'include'}",
            f"-I{tvm_in.ffi_pkg / 'include'}",
            f"-I{tvm_in.tvm_pkg / 'src' / 'runtime'}",
            *self.extra_flags(),
            f"-L{tvm_in.runtime.parent.resolve()}",
            "-ltvm_runtime",
            f"-L{tvm_in.ffi_lib.parent.resolve()}",
            "-ltvm_ffi",
            "-ldl",
            f"-Wl,-rpath,{rpath}",
        ]
        if toolchain.is_zig:
            # zig's clang links its own libc++ (TVM's libraries use libstdc++): the add-ons pass no
            # C++ types across, but an exception from a device-API call cannot unwind through TVM's
            # frames, so the add-ons print their message first (LLMCHAT_PRINT_ERRORS)
            argv += ["-target", "native-linux-gnu", "-DLLMCHAT_PRINT_ERRORS"]
        else:
            argv += ["-Wl,--no-undefined"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as err:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise LlmchatError(
                f"Building the {self.what} add-on with {toolchain.name} failed: {err}",
                "install g++ (or `pip install ziglang`) and try again",
            ) from err
        if proc.returncode != 0:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            raise LlmchatError(
                f"Building the {self.what} add-on with {toolchain.name} failed:\n" + "\n".join(tail),
                "report this with the message above; meanwhile use --device cpu",
            )
        if verbose:
            print(f"built {out} with {toolchain.name}", file=sys.stderr)
        os.replace(tmp, out)
        return out

    def load(self, lock: object) -> Path:
        """Build if needed and load the add-on into this process (once); returns its path."""
        with lock:  # type: ignore[attr-defined]
            if self._loaded is not None:
                return self._loaded
            import tvm

            self.before_load()
            path = self.build()
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as err:
                # a damaged cached build: rebuild once
                try:
                    path = self.build(force=True)
                    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                except OSError as err2:
                    raise LlmchatError(
                        f"Could not load the {self.what} add-on {path}: {err2}",
                        "delete it (it is rebuilt) or use --device cpu",
                    ) from err
            if tvm.get_global_func(self.registered, allow_missing=True) is None:
                raise LlmchatError(
                    f"The {self.what} add-on {path} loaded but registered nothing.",
                    "delete it (it is rebuilt) or use --device cpu",
                )
            self._loaded = path
            return path

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def main(self, argv: Sequence[str]) -> int:
        """``python -m <addon module> [--force] [--optional]``: build at install time."""
        try:
            print(self.build(force="--force" in argv, verbose=True))
        except LlmchatError as err:
            print(f"llmchat: the {self.what} add-on was not built: {err}", file=sys.stderr)
            return 0 if "--optional" in argv else 1
        return 0
