"""CUDA without a compiler at run time.

apache-tvm 0.27 stores the kernels of a CUDA module as CUDA C source and compiles them when the
module is loaded, through the Python callback ``tvm_callback_cuda_compile`` (NVRTC or nvcc). A
runtime-only TVM has no working callback, and a user's machine may have no CUDA compiler at all.

llmchat compiles the kernels at BUILD time instead: while the model library is generated,
:func:`cuda_build_hooks` registers TVM's ``tvm_callback_cuda_postproc`` hook, compiles the generated
source with ``nvcc`` into a fatbin (machine code for the target GPU plus PTX for newer ones) and
stores the fatbin, base64-encoded behind a marker line, in place of the source inside the module.
At run time :func:`prepare_cuda_runtime` loads ``libcudart`` (so ``tvm.cuda(0).exist`` works) and
registers a ``tvm_callback_cuda_compile`` that decodes such a payload — no compiler involved. Plain
source (a library built without nvcc) is still compiled with nvcc when one is installed; otherwise
the load fails with an :class:`~app.errors.LlmchatError` that says what to do.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.errors import LlmchatError
from app.inference.pipelines.cuda_kernels import add_device_helpers

#: First line of a CUDA module payload that carries a prebuilt fatbin instead of source.
FATBIN_MARKER = "//llmchat-fatbin:v1"

_runtime_state: dict[str, Any] = {"prepared": False, "cudart": None, "error": None}


# ----------------------------------------------------------------------------------------------
# build time
# ----------------------------------------------------------------------------------------------
def find_nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin, PATH, then /usr/local/cuda*/bin."""
    candidates = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", "nvcc"))
    found = shutil.which("nvcc")
    if found:
        candidates.append(found)
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)
    for cand in candidates:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cuda_arch_of(target: Any) -> str:
    """``sm_90`` style architecture of a CUDA target (``arch`` attribute), default sm_80."""
    arch = str(target.attrs.get("arch", "")) if target is not None else ""
    return arch if arch.startswith("sm_") else "sm_80"


def compile_fatbin(source: str, arch: str, nvcc: str | None = None) -> bytes:
    """Compile CUDA source to a fatbin holding SASS for ``arch`` and PTX (for newer GPUs)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise LlmchatError(
            "nvcc (the CUDA compiler) was not found", "install the CUDA toolkit or set CUDA_HOME"
        )
    number = arch.split("_", 1)[1]
    with tempfile.TemporaryDirectory(prefix="llmchat-nvcc-") as tmp:
        src, out = Path(tmp, "kernels.cu"), Path(tmp, "kernels.fatbin")
        src.write_text(source)
        cmd = [
            nvcc,
            "--fatbin",
            "-O3",
            "-std=c++17",
            "-w",
            f"-gencode=arch=compute_{number},code=sm_{number}",
            f"-gencode=arch=compute_{number},code=compute_{number}",
            "-o",
            str(out),
            str(src),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise LlmchatError(
                f"nvcc failed to compile the model's CUDA kernels for {arch}:\n{proc.stderr[-3000:]}",
                "check that the CUDA toolkit supports this GPU architecture",
            )
        return out.read_bytes()


def encode_fatbin(fatbin: bytes, source: str) -> str:
    """The payload that replaces the source in the module: marker, source hash, base64 fatbin."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"{FATBIN_MARKER}:{digest}\n{base64.b64encode(fatbin).decode()}\n"


def decode_fatbin(code: str) -> bytes | None:
    """The fatbin inside a payload made by :func:`encode_fatbin`, or None for plain source."""
    if not code.startswith(FATBIN_MARKER):
        return None
    _header, _, body = code.partition("\n")
    return base64.b64decode(body.strip())


@contextlib.contextmanager
def cuda_build_hooks(target: Any, nvcc: str | None = None, require: bool = False) -> Iterator[dict[str, Any]]:
    """Context for ``tvm.compile`` of a CUDA target: kernels become prebuilt fatbins.

    Yields a dict that records what happened (``compiled``: number of modules turned into
    fatbins, ``sources``: the generated CUDA sources, ``nvcc``: the compiler used). Without nvcc
    the source is kept (the library then needs nvcc where it runs) unless ``require`` is set, in
    which case an LlmchatError is raised.
    """
    import tvm_ffi

    nvcc = nvcc or find_nvcc()
    info: dict[str, Any] = {"compiled": 0, "sources": [], "nvcc": nvcc}
    if nvcc is None and require:
        raise LlmchatError(
            "nvcc (the CUDA compiler) was not found; it is needed to build the CUDA model library",
            "install the CUDA toolkit or set CUDA_HOME",
        )
    arch = cuda_arch_of(target)
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_postproc", allow_missing=True)

    def _postproc(code: str, _target: Any = None) -> str:
        if previous is not None:
            code = previous(code, _target)
        code = add_device_helpers(code)
        info["sources"].append(code)
        if nvcc is None:
            return code
        info["compiled"] += 1
        return encode_fatbin(compile_fatbin(code, arch, nvcc), code)

    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", _postproc, override=True)
    try:
        yield info
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", previous, override=True)
        else:
            _remove_global("tvm_callback_cuda_postproc")


def _remove_global(name: str) -> None:
    import tvm_ffi

    remove = tvm_ffi.get_global_func("ffi.FunctionRemoveGlobal", allow_missing=True)
    if remove is not None:
        remove(name)
    else:  # keep the hook harmless: pass the code through unchanged
        tvm_ffi.register_global_func(name, lambda code, _t=None: code, override=True)


# ----------------------------------------------------------------------------------------------
# run time
# ----------------------------------------------------------------------------------------------
def _cudart_candidates() -> list[str]:
    names = ["libcudart.so.13"]
    bases = [
        os.environ.get("CUDA_HOME", ""),
        os.environ.get("CUDA_PATH", ""),
        "/usr/local/cuda",
        *sorted(glob.glob("/usr/local/cuda-*"), reverse=True),
    ]
    for base in filter(None, bases):
        names += glob.glob(os.path.join(base, "lib*", "libcudart.so.13*"))
        names += glob.glob(os.path.join(base, "targets", "*", "lib", "libcudart.so.13*"))
    for path in sys.path:
        names += glob.glob(os.path.join(path, "nvidia", "cu13", "lib", "libcudart.so.13*"))
        names += glob.glob(os.path.join(path, "nvidia", "cuda_runtime", "lib", "libcudart.so.13*"))
    return names


def load_cudart() -> Any:
    """Load libcudart.so.13 globally (TVM's CUDA runtime links it). Raises LlmchatError."""
    if _runtime_state["cudart"] is not None:
        return _runtime_state["cudart"]
    errors = []
    for cand in _cudart_candidates():
        try:
            lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(f"{cand}: {exc}")
            continue
        _runtime_state["cudart"] = lib
        return lib
    raise LlmchatError(
        "the CUDA runtime library libcudart.so.13 could not be loaded "
        f"({'; '.join(errors[:3]) or 'not found'})",
        "install the NVIDIA driver and the CUDA 13 runtime "
        "(pip install nvidia-cuda-runtime), or set CUDA_HOME",
    )


def _tvm_cuda_runtime_error() -> str | None:
    """Why TVM's CUDA runtime library did not load (TVM swallows this error at import)."""
    import tvm

    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    if not lib.exists():
        return f"{lib} is missing (this TVM build has no CUDA runtime)"
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return str(exc)
    return None


def _runtime_compile(code: str) -> bytes:
    """``tvm_callback_cuda_compile`` for run time: prebuilt fatbin, else nvcc, else a clear error."""
    fatbin = decode_fatbin(code)
    if fatbin is not None:
        return fatbin
    nvcc = find_nvcc()
    if nvcc is None:
        _runtime_state["error"] = LlmchatError(
            "this model library holds CUDA source, and no CUDA compiler is installed to build it",
            "rebuild the model library on a machine with nvcc (llmchat compiles the kernels "
            "ahead of time when nvcc is present), or install the CUDA toolkit",
        )
        raise RuntimeError(str(_runtime_state["error"]))
    arch = _runtime_state.get("arch") or "sm_80"
    return compile_fatbin(code, arch, nvcc)


def prepare_cuda_runtime(arch: str | None = None) -> None:
    """Make TVM's CUDA runtime usable: cudart first, then the compile callback. Idempotent.

    Call before ``import tvm`` where possible (TVM loads its CUDA runtime at import); calling it
    afterwards still works because the runtime library is loaded here explicitly.
    Raises LlmchatError naming the real cause when the CUDA runtime cannot be loaded.
    """
    if _runtime_state["prepared"]:
        return
    if _twin_mode():
        _prepare_twin(arch)
        return
    load_cudart()
    import tvm
    import tvm_ffi

    if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is None:
        reason = _tvm_cuda_runtime_error()
        if tvm_ffi.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is None:
            raise LlmchatError(
                f"TVM's CUDA runtime did not load: {reason or 'unknown reason'}",
                "install the NVIDIA driver (libcuda.so.1) and the CUDA 13 runtime",
            )
    _runtime_state["arch"] = arch or _device_arch(tvm)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _runtime_compile, override=True)
    _runtime_state["prepared"] = True


def _twin_mode() -> bool:
    return os.environ.get("LLMCHAT_GPU_RUNTIME", "").strip().lower() == "twin"


def _prepare_twin(arch: str | None) -> None:
    """``LLMCHAT_GPU_RUNTIME=twin``: CUDA through llmchat's own GPU runtime (the ROCm runtime's
    code bound to NVIDIA's driver, app.inference.backends.hip) instead of TVM's CUDA runtime and
    libcudart.  The compile callback is the same (prebuilt fatbins decoded, nvcc otherwise)."""
    import tvm
    import tvm_ffi

    from app.inference.backends.hip import addon

    addon.load()
    st = addon.status()
    if st.get("runtime") != "cuda-twin":
        raise LlmchatError(
            "llmchat's GPU runtime was loaded as ROCm before LLMCHAT_GPU_RUNTIME=twin was set",
            "set LLMCHAT_GPU_RUNTIME=twin before starting llmchat",
        )
    if not st.get("driver_found"):
        raise LlmchatError(
            f"the CUDA twin runtime cannot run: {st.get('error')}", "install the NVIDIA driver (libcuda.so.1)"
        )
    _runtime_state["arch"] = arch or _device_arch(tvm)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _runtime_compile, override=True)
    _runtime_state["prepared"] = True


def _device_arch(tvm: Any) -> str | None:
    try:
        dev = tvm.cuda(0)
        if dev.exist:
            return "sm_" + str(dev.compute_version).replace(".", "")
    except Exception:  # no device: the arch only matters for the nvcc fallback
        return None
    return None


def load_cuda_library(path: str | os.PathLike[str]) -> Any:
    """``tvm.runtime.load_module`` for a CUDA model library, with errors as LlmchatError."""
    prepare_cuda_runtime()
    import tvm

    _runtime_state["error"] = None
    try:
        return tvm.runtime.load_module(str(path))
    except Exception as exc:  # TVM raises its own error types
        if _runtime_state["error"] is not None:
            raise _runtime_state["error"] from exc
        raise LlmchatError(
            f"the CUDA model library {path} could not be loaded: {exc}",
            "delete it from the cache so that llmchat rebuilds it",
        ) from exc
