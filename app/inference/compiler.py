"""Compile a model library for a target and keep it in the user cache.

``get_library(cfg, target)`` returns a ``CompiledModel`` (path of the shared library plus the
parameter list the runtime needs), compiling only when no library with the same cache key is
cached.  The key hashes everything that changes the generated code: the model's architecture
fields, its weight formats, the target (with GPU architecture / CPU model), the TVM version,
``ENGINE_VERSION`` and the source of the model, quantization and pipeline modules.

Libraries are written atomically (temp file, then rename); the ``.json`` beside the ``.so`` is
written last and marks a complete entry: it records the library's size and sha256, checked before
every load, so a truncated or damaged library is rebuilt instead of crashing the process.  A library
runs with a runtime-only TVM.

The "source" part of the key is derived, not listed: every module reachable by imports from the
compiler and the model, quantization and pipeline packages (plus the CUDA sources next to them).
Host code is compiled for a portable CPU level on GPU targets; CPU libraries carry the host's
ISA flags in the key.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.config import ModelConfig
from app.inference.devices import DeviceSpec

#: bump when the engine's calling convention or model code changes incompatibly
ENGINE_VERSION = "1"

#: number of compilations done in this process (tests assert cache hits with it)
COMPILE_COUNT = 0

#: packages under app/inference whose modules build the IRModule and its kernels (roots of the
#: import graph the cache key hashes)
_SOURCE_DIRS = ("models", "quantization", "pipelines")
#: suffixes of non-Python files compiled into libraries (read by the modules next to them)
_KERNEL_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".c", ".cc", ".ll")


@dataclass(frozen=True)
class CompiledModel:
    """A cached model library and the parameters its functions take (in order)."""

    lib_path: Path
    params: list[dict[str, Any]]  # [{"name", "shape", "dtype"}] in the VM's packed order
    target: str
    compute_dtype: str  # activations and KV cache

    @property
    def kv_itemsize(self) -> int:
        return 2 if self.compute_dtype in ("float16", "bfloat16") else 4


def libs_dir() -> Path:
    """Where compiled libraries live."""
    return paths.cache_dir() / "libs"


# ------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------
def _host() -> dict[str, Any]:
    """The host CPU as the CPU back end compiles for it (its ISA flags are in the cache key)."""
    import tvm

    return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


def _portable_host() -> dict[str, Any]:
    """Host code of GPU libraries: LLVM's generic CPU of this architecture (no AVX-512 & co.), so a
    cached library moved to another machine with the same GPU never dies of an illegal instruction
    (the cache key of a GPU library records only the GPU)."""
    return {"kind": "llvm"}


def target_dict(device: DeviceSpec, arch: str | None = None) -> dict[str, Any]:
    """The target (dict form, as TVM 0.27 wants) for ``device``; ``arch`` overrides detection
    (``sm_90``, ``gfx1100``) for cross-compiling."""

    backend = device.backend
    if backend == "cpu":
        return _host()
    if backend == "cuda":
        arch = arch or gpu_arch(device)
        if arch is None:
            raise LlmchatError("No CUDA device found to compile for.", "pass the architecture, e.g. sm_90")
        return {"kind": "cuda", "arch": arch, "max_shared_memory_per_block": 49152,
                "max_threads_per_block": 1024, "thread_warp_size": 32, "host": _portable_host()}
    if backend == "rocm":
        arch = arch or gpu_arch(device)
        if arch is None:
            raise LlmchatError("No ROCm device found to compile for.",
                               "pass the gfx architecture, e.g. gfx1100")
        wave = 32 if arch.startswith(("gfx10", "gfx11", "gfx12")) else 64
        return {"kind": "rocm", "mcpu": arch, "mtriple": "amdgcn-amd-amdhsa-hcc",
                "max_shared_memory_per_block": 65536, "max_threads_per_block": 1024,
                "thread_warp_size": wave, "host": _portable_host()}
    if backend == "vulkan":
        # TVM's WGSL code generator (PyPI's TVM has no SPIR-V one), run by llmchat's WebGPU
        # device API on wgpu-native; sized to the adapter's limits
        from app.inference.backends import webgpu

        return webgpu.target_dict(device.index, _portable_host(), profile=arch)
    if backend == "metal":
        return {"kind": "metal", "max_threads_per_block": 1024, "max_shared_memory_per_block": 32768,
                "thread_warp_size": 32, "host": {"kind": "llvm", "mtriple": "arm64-apple-macos"}}
    raise LlmchatError(f"Unknown backend {backend!r}.", "use cpu, cuda, rocm, vulkan or metal")


def make_target(device: DeviceSpec, arch: str | None = None) -> Any:
    """A ``tvm.target.Target`` for ``device``."""
    import tvm

    try:
        return tvm.target.Target(target_dict(device, arch))
    except LlmchatError:
        raise
    except Exception as err:
        raise LlmchatError(f"TVM cannot build code for {device.backend} ({err}).",
                           "use --device cpu or a TVM build with that back end") from err


# ------------------------------------------------------------------------------------------
# Cache key
# ------------------------------------------------------------------------------------------
def _module_file(name: str, root: Path) -> Path | None:
    """The file of module ``app.X.Y`` (``root`` is the ``app`` package directory), or None."""
    parts = name.split(".")
    if parts[0] != "app":
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path) -> set[str]:
    """``app.*`` modules ``path`` imports (also inside functions) or names as strings
    (``importlib.import_module("app.inference.models.llama")``)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("app.") and node.value.replace(".", "").replace("_", "").isalnum():
            found.add(node.value)
    return {m for m in found if m == "app" or m.startswith("app.")}


def library_sources() -> list[Path]:
    """Every source file whose code can end up in a compiled library: the import closure of the
    compiler and of the model, quantization and pipeline packages, plus kernel sources (``.cu`` …)
    in the directories of those modules.  Derived from the code, so a new module is covered."""
    here = Path(__file__).parent
    app_root = here.parent
    todo = [Path(__file__)]
    for sub in _SOURCE_DIRS:
        todo += sorted((here / sub).rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_modules(path):
            found = _module_file(name, app_root)
            if found is not None and found.resolve() not in seen:
                todo.append(found)
    extra = {f.resolve() for d in {p.parent for p in seen} if d.is_relative_to(here.resolve())
             for f in d.iterdir() if f.suffix in _KERNEL_SOURCE_SUFFIXES and f.is_file()}
    return sorted(seen | extra)


@functools.cache
def _source_digest() -> str:
    app_root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in library_sources():
        h.update(str(f.relative_to(app_root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _cpu_fingerprint() -> str:
    """The host CPU, as precisely as the runtime can tell without LLVM (model name + ISA flags)."""
    import platform

    model, flags = platform.processor() or "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{platform.machine()}|{model}|{digest}"


def gpu_arch(device: DeviceSpec) -> str | None:
    """``sm_90`` / ``gfx1100`` of a present CUDA or ROCm device (None otherwise); the same name a
    cross-compile's ``--arch`` gives, so both find the same cached library."""
    import tvm

    prefix = {"cuda": "sm_", "rocm": "gfx"}.get(device.backend)
    if prefix is None:
        return None
    dev = tvm.device(device.backend, device.index)
    if not dev.exist:
        return None
    return prefix + str(dev.compute_version).replace(".", "")


def device_fingerprint(device: DeviceSpec, arch: str | None = None) -> str:
    """What distinguishes code for ``device``: CPU model and ISA, or the GPU architecture.

    Needs only the TVM runtime, so a runtime-only install finds the cached library."""
    import tvm

    if device.backend == "cpu":
        return _cpu_fingerprint()
    if device.backend == "vulkan":
        from app.inference.backends import webgpu

        return str(webgpu.Profile.parse(arch)) if arch else webgpu.fingerprint(device.index)
    arch = arch or gpu_arch(device)
    if arch:
        return arch
    if device.backend == "metal":
        dev = tvm.device(device.backend, device.index)
        if dev.exist:
            return f"{device.backend}-{dev.device_name}"
    return device.backend


def cache_key(cfg: ModelConfig, backend: str, fingerprint: str, plain_pipeline: bool | None = None) -> str:
    """Hex digest naming the library of ``cfg`` compiled for ``backend`` / ``fingerprint``
    (``plain_pipeline``: that of TVM's stock pipeline; default: as LLMCHAT_TVM_PIPELINE says)."""
    import tvm

    blob = json.dumps(
        {
            "model": cfg.code_key(),
            "backend": backend,
            "device": fingerprint,
            "tvm": tvm.__version__,
            "engine": ENGINE_VERSION,
            "source": _source_digest(),
            "plain_pipeline": _plain_pipeline() if plain_pipeline is None else plain_pipeline,
            "switches": _kernel_switches(),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------------------
# Compile
# ------------------------------------------------------------------------------------------
def export_model(cfg: ModelConfig, target: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """The Relax IRModule of the model and its named parameters (export order)."""
    from app.inference.models import model_class

    model = model_class(cfg.model_type)(cfg, target)
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return mod, named_params


def param_list(named_params: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """JSON-able ``[{"name", "shape", "dtype"}]`` from ``export_tvm``'s named params."""
    return [{"name": n, "shape": [int(x) for x in p.shape], "dtype": str(p.dtype)} for n, p in named_params]


#: environment switches that change the generated kernels (pipelines/gpu.py and cpu.py read them)
KERNEL_SWITCHES = ("LLMCHAT_GPU_GEMV", "LLMCHAT_CUDA_GEMM", "LLMCHAT_CUDA_ATTENTION", "LLMCHAT_WGSL_GEMM",
                   "LLMCHAT_WGSL_ATTENTION", "LLMCHAT_CPU_GEMM")


def _kernel_switches() -> dict[str, str]:
    """The kernel switches that are set, normalised: part of the cache key, so that setting one
    rebuilds the library instead of reusing one built without it."""
    values = {name: os.environ.get(name, "").strip().lower() for name in KERNEL_SWITCHES}
    return {name: value for name, value in values.items() if value}


def _plain_pipeline() -> bool:
    """``LLMCHAT_TVM_PIPELINE=default`` compiles with TVM's stock pipeline (a fallback when a
    schedule misbehaves; slower code)."""
    return os.environ.get("LLMCHAT_TVM_PIPELINE", "").strip().lower() == "default"


def _pass_config(target: Any) -> dict[str, Any]:
    try:
        from app.inference import pipelines

        fn = getattr(pipelines, "pass_config_for", None)
        return dict(fn(target)) if fn else {}
    except ImportError:
        return {}


_BITCODE_DIRS = (
    "/opt/rocm/amdgcn/bitcode", "/opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode",
    "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode", "/usr/lib/amdgcn/bitcode", "/usr/share/amdgcn/bitcode",
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
        bitcode = next((p for pat in _BITCODE_DIRS for p in sorted(glob.glob(pat))
                        if os.path.isfile(os.path.join(p, "ocml.bc"))), None)
        if bitcode is None:
            raise LlmchatError(
                "Compiling for ROCm needs AMD's device bitcode libraries (ocml.bc, ockl.bc).",
                "install ROCm, or the `rocm-device-libs` package, or set ROCM_PATH")
        link = shim / "rocm" / "amdgcn" / "bitcode"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(bitcode)
        env["ROCM_PATH"] = str(shim / "rocm")
    lld = None if shutil.which("ld.lld-22") else _newest_lld()
    if lld is None and not (shutil.which("ld.lld-22") or shutil.which("ld.lld")):
        raise LlmchatError("Compiling for ROCm needs the LLVM linker ld.lld (version 17 or newer).",
                           "install lld (e.g. `apt install lld-19`) or ROCm")
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


def _build_hooks(target: Any) -> contextlib.AbstractContextManager[Any]:
    """ROCm: find the toolchain; CUDA: turn kernels into prebuilt fatbins (app.inference.cuda_support)."""
    if target.kind.name == "rocm":
        return rocm_toolchain()
    if target.kind.name != "cuda":
        return contextlib.nullcontext()
    try:
        from app.inference.cuda_support import cuda_build_hooks
    except ImportError:
        return contextlib.nullcontext()
    return cuda_build_hooks(target)


def _without_device_argmax(mod: Any) -> Any:
    """``mod`` without the exported ``argmax`` and its kernel: TVM's stock pipeline cannot
    schedule that reduction for GPUs, and the runtime does without it (host argmax)."""
    import tvm
    from tvm import relax

    names = [gv.name_hint for gv in mod.functions]
    if "argmax" not in names:
        return mod
    kept = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "argmax"}
    entries = [gv.name_hint for gv, f in kept.items() if isinstance(f, relax.Function)]
    pruned = tvm.IRModule(kept, attrs=mod.attrs)
    return relax.transform.DeadCodeElimination(entries)(pruned)


@contextlib.contextmanager
def _scratch_tempdir() -> Any:
    """TVM's temporary files (export_library's object files) go to ``cache/tmp/build-PID`` instead
    of /tmp, so those of a killed compile are found and removed (app.cleanup)."""
    import shutil

    scratch = paths.cache_dir() / "tmp" / f"build-{os.getpid()}"
    try:
        scratch.mkdir(parents=True, exist_ok=True)
    except OSError:
        yield  # an unwritable cache is reported when the library is written
        return
    old = tempfile.tempdir
    tempfile.tempdir = str(scratch)
    try:
        yield
    finally:
        tempfile.tempdir = old
        shutil.rmtree(scratch, ignore_errors=True)


def _build(mod: Any, target: Any, pipeline: Any, out_path: Path, progress: ProgressCallback | None) -> None:
    """tvm.compile + export_library to ``out_path`` (written to a temp file, then renamed)."""
    import tvm

    if isinstance(pipeline, str) and pipeline == "default":
        mod = _without_device_argmax(mod)
    with _build_hooks(target), _scratch_tempdir(), \
            tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        executable = tvm.compile(mod, target, relax_pipeline=pipeline)
        if progress:
            progress(ProgressEvent("compile", "writing the library", 2, 3))
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f"{out_path.stem}.{os.getpid()}.", suffix=".so.tmp",
                                       dir=out_path.parent)
            os.close(fd)
        except OSError as err:
            raise cache_write_error(out_path.parent, err) from err
        try:
            executable.export_library(tmp)
            os.replace(tmp, out_path)
        except OSError as err:  # full or read-only cache: not a schedule problem, no fallback
            raise cache_write_error(out_path.parent, err) from err
        except Exception as err:
            # export_library runs the system compiler; a full disk surfaces as its failure
            free = _free_bytes(out_path.parent)
            if free is not None and free < (64 << 20):
                raise cache_write_error(out_path.parent, OSError(28, "No space left on device")) from err
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def compile_library(cfg: ModelConfig, target: Any, out_path: Path,
                    progress: ProgressCallback | None = None,
                    device_label: str | None = None, report_pipeline: bool = False) -> Any:
    """Compile ``cfg`` for ``target`` into the shared library ``out_path`` (atomic); the parameter
    list (with ``report_pipeline``: ``(params, stock)``, ``stock`` True when TVM's stock pipeline
    stood in for llmchat's failing schedules).

    ``device_label`` (e.g. ``"vulkan:0"``) names the device in progress messages.  A cache that
    cannot be written is reported as such (never as a schedule failure, never retried).
    """
    global COMPILE_COUNT
    import tvm

    from app.inference.pipelines import pipeline_for

    kind = target.kind.name
    if tvm.get_global_func(f"target.build.{kind}", allow_missing=True) is None:
        name = {"vulkan": "Vulkan (SPIR-V)", "rocm": "ROCm", "metal": "Metal", "cuda": "CUDA"}.get(kind, kind)
        raise LlmchatError(
            f"The installed TVM has no {name} code generator, so it cannot build a model library for {kind}.",
            "install a TVM built with it: MLC's TVM wheels, e.g. `pip install --pre -f https://mlc.ai/wheels "
            "mlc-ai-nightly-rocm62` (ROCm and Vulkan), or use another --device")
    if progress:
        where = device_label or ("cpu" if kind == "llvm" else "vulkan" if kind == "webgpu" else kind)
        progress(ProgressEvent("compile", f"compiling for {where} ({cfg.model_type}, {cfg.quantization}) …",
                               0, 3))
    try:
        mod, named_params = export_model(cfg, target)
    except LlmchatError:
        raise
    except Exception as err:
        raise LlmchatError(f"Building the {cfg.model_type} model failed: {type(err).__name__}: {err}",
                           "report this with the message above") from err
    if progress:
        progress(ProgressEvent("compile", "generating kernels", 1, 3))
    stock = _plain_pipeline()
    try:
        _build(mod, target, "default" if _plain_pipeline() else pipeline_for(target), out_path, progress)
    except LlmchatError:
        raise
    except Exception as err:  # TVM raises many types; the user gets one clear message
        first = f"{type(err).__name__}: {str(err).strip()[:2000]}"
        if _plain_pipeline():
            raise LlmchatError(f"Compiling the model for {kind} failed: {first}",
                               "run with --device cpu, or report this with the message above") from err
        # llmchat's kernel schedules failed: TVM's stock pipeline gives slower but working code
        if progress:
            progress(ProgressEvent("compile", f"llmchat's schedules failed ({first[:200]}); "
                                   "retrying with TVM's stock pipeline (slower code)", 1, 3))
        stock = True
        try:
            _build(mod, target, "default", out_path, progress)
        except LlmchatError:
            raise
        except Exception as err2:
            raise LlmchatError(
                f"Compiling the model for {kind} failed: {first}",
                "run with --device cpu, or report this with the message above",
            ) from err2
    COMPILE_COUNT += 1
    if progress:
        progress(ProgressEvent("compile", "compiled", 3, 3))
    params = param_list(named_params)
    return (params, stock) if report_pipeline else params


def _write_json_atomic(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".json.tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def compute_dtype_for(cfg: ModelConfig, backend: str) -> str | None:
    """The activation dtype to compile ``cfg`` with on ``backend`` (None: the stored dtype).

    CPUs have no fast float16 arithmetic: float16 models compute in float32 there (weights stay
    as stored).  ``LLMCHAT_COMPUTE_DTYPE=float16|float32`` overrides (tests, experiments)."""
    forced = os.environ.get("LLMCHAT_COMPUTE_DTYPE", "").strip()
    if forced:
        if forced not in ("float16", "float32"):
            raise LlmchatError(f"LLMCHAT_COMPUTE_DTYPE={forced!r} is not float16 or float32.",
                               "unset it or use one of those")
        return forced
    if backend == "cpu" and cfg.model_dtype == "float16":
        return "float32"
    return None


def file_digest(path: Path) -> str:
    """sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cached_entry(lib: Path, meta_path: Path) -> CompiledModel | None:
    """The cache entry at ``lib``/``meta_path`` when it is complete and the library is exactly the
    one written (size and sha256 recorded in the metadata); None otherwise.  Loading a truncated
    library maps past its end and dies of SIGBUS, so nothing unverified is ever loaded."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if lib.stat().st_size != int(meta["size"]) or file_digest(lib) != meta["sha256"]:
            return None
        return CompiledModel(lib, meta["params"], meta["target"], meta["compute_dtype"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _drop_entry(lib: Path, meta_path: Path) -> None:
    for path in (meta_path, lib):  # metadata first: a half-removed entry is never "complete"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


#: float16 formats and their float32 twins (same layout, float32 where float16 was)
F32_TWINS = {"q4f16_1": "q4f32_1", "q0f16": "q0f32", "ggml_f16": "q0f32"}


def without_f16_storage(cfg: ModelConfig, fingerprint: str) -> ModelConfig:
    """``cfg`` for a WGSL adapter without shader-f16 (profile ``wgsl-f32-…``): float16 weights
    become their float32 twins (widened exactly at load) and the model computes in float32."""
    if not fingerprint.startswith("wgsl-f32"):
        return cfg
    formats = {k: F32_TWINS.get(v, v) for k, v in cfg.tensor_formats.items()}
    return dataclasses.replace(cfg, quantization=F32_TWINS.get(cfg.quantization, cfg.quantization),
                               tensor_formats=formats)


def get_library(cfg: ModelConfig, device: DeviceSpec, arch: str | None = None,
                progress: ProgressCallback | None = None) -> CompiledModel:
    """The cached library for ``cfg`` on ``device``, compiling it first if needed (also when the
    cached one fails its size/checksum check)."""
    fingerprint = device_fingerprint(device, arch)
    if device.backend == "vulkan":
        cfg = without_f16_storage(cfg, fingerprint)
    cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype_for(cfg, device.backend),
                              word_storage=device.backend == "vulkan")
    key = cache_key(cfg, device.backend, fingerprint)
    base = libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{key}"
    lib, meta_path = base.with_suffix(".so"), base.with_suffix(".json")
    if meta_path.exists() or lib.exists():
        found = _cached_entry(lib, meta_path)
        if found is not None:
            return found
        if progress:
            progress(ProgressEvent("compile", f"the cached library {lib.name} is damaged or incomplete: "
                                   "rebuilding it", 0, 3))
        _drop_entry(lib, meta_path)
    target = make_target(device, arch)
    t0 = time.monotonic()
    fallback_key = cache_key(cfg, device.backend, fingerprint, plain_pipeline=True)
    params, stock = compile_library(cfg, target, lib, progress, device_label=str(device),
                                    report_pipeline=True)
    if stock and not _plain_pipeline():
        # TVM's stock pipeline stood in for llmchat's schedules: that slower library is cached under
        # the stock pipeline's key, never under this one, so a later start tries the schedules again
        fallback = libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{fallback_key}"
        os.replace(lib, fallback.with_suffix(".so"))
        lib, meta_path, key = fallback.with_suffix(".so"), fallback.with_suffix(".json"), fallback_key
    meta = {"params": params, "target": str(target), "compute_dtype": cfg.activation_dtype, "key": key,
            "compile_s": round(time.monotonic() - t0, 2), "model": cfg.code_key(),
            "pipeline": "tvm-default" if stock else "llmchat",
            "size": lib.stat().st_size, "sha256": file_digest(lib)}
    try:
        _write_json_atomic(meta_path, meta)
    except OSError as err:
        raise cache_write_error(libs_dir(), err) from err
    return CompiledModel(lib, params, meta["target"], cfg.activation_dtype)


def cache_write_error(where: Path, err: OSError) -> LlmchatError:
    """The message for a compile cache that cannot be written (full, read-only, not a directory)."""
    from app.errors import os_error

    return os_error(err, f"Cannot write the compiled model library to {where}",
                    "free some disk space, or point LLMCHAT_CACHE_DIR at a writable directory")


def parameter_specs(cfg: ModelConfig) -> list[dict[str, Any]]:
    """The model's parameters (name, shape, dtype) in export order, without compiling."""
    from app.inference.models import model_class

    model = model_class(cfg.model_type)(cfg, None)
    return param_list(list(model.named_parameters()))
