"""Compile a model library for a target and keep it in the user cache.

``get_library(cfg, target)`` returns a ``CompiledModel`` (path of the shared library plus the
parameter list the runtime needs), compiling only when no library with the same cache key is
cached.  The key (``LibraryKey``) holds everything that changes the generated code: the model's architecture
fields and weight formats (hashed), the target (GPU architecture, WGSL adapter profile or portable CPU
level), the host code's CPU level, the TVM version, ``ENGINE_VERSION`` and the source of the model,
quantization and pipeline modules.  Its digest names the cache entry; a prebuilt library's manifest
carries the same key, so one comparison decides both "cached already" and "this bundle fits"
(app/inference/compile/prebuilt.py).

Libraries are written atomically (temp file, then rename); the ``.json`` beside the ``.so`` is
written last and marks a complete entry: it records the library's size and sha256, checked before
every load, so a truncated or damaged library is rebuilt instead of crashing the process.  A library
runs with a runtime-only TVM.

The "source" part of the key is derived, not listed: every module reachable by imports from the
compiler and the model, quantization and pipeline packages (plus the CUDA sources next to them).
Host code is compiled for a portable CPU level: the architecture's baseline on GPU targets, the
newest x86-64-vN level this CPU has on the CPU target (never the build machine's own ``-mcpu``).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.hardware.device_spec import DeviceSpec
from app.inference.store.config import ModelConfig

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
    origin: str = "compiled"  # "compiled" here or "prebuilt" (downloaded, verified)

    @property
    def kv_itemsize(self) -> int:
        return 2 if self.compute_dtype in ("float16", "bfloat16") else 4


def libs_dir() -> Path:
    """Where compiled libraries live."""
    return paths.cache_dir() / "libs"


# ------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------
#: x86-64 micro-architecture levels (psABI) and the /proc/cpuinfo flags each adds to the one before
_X86_LEVELS = (
    ("x86-64-v2", ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")),
    ("x86-64-v3", ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")),
    ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
)


def cpu_levels() -> tuple[str, ...]:
    """The portable CPU levels a library can be built for on this architecture (oldest first)."""
    import platform

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ("x86-64", *(name for name, _ in _X86_LEVELS))
    return ({"arm64": "aarch64"}.get(machine, machine) or "unknown",)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


#: developer switch: ``native`` compiles CPU libraries for this CPU's own ``-mcpu`` (a few % faster
#: decode measured here, but such a library fits only this CPU model and no prebuilt bundle), or a
#: lower level (``x86-64-v2``) to share one library between machines
CPU_LEVEL_ENV = "LLMCHAT_CPU_LEVEL"
NATIVE = "native"


def cpu_level() -> str:
    """This CPU's portable level: the newest x86-64-vN whose instructions it has (``x86-64-v3`` on a
    Steam Deck's Zen 2), or the architecture's baseline elsewhere.  CPU libraries are compiled for
    it, never for the build machine's own ``-mcpu``, so a library (and a prebuilt one) runs on every
    CPU of that level; it is part of the cache key.  ``LLMCHAT_CPU_LEVEL`` overrides it."""
    forced = os.environ.get(CPU_LEVEL_ENV, "").strip()
    if forced == NATIVE:
        return _native_level()
    if forced:
        return check_cpu_level(forced)
    return _detected_level()


def _native_level() -> str:
    """``native-<digest of this CPU's model name and flags>`` (no LLVM needed to find the library)."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        model = next(
            (
                line.partition(":")[2].strip()
                for line in f
                if line.partition(":")[0].strip() in ("model name", "Model", "CPU part")
            ),
            "",
        )
    blob = f"{model}|{' '.join(sorted(_cpu_flags()))}"
    return f"{NATIVE}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


@functools.cache
def _detected_level() -> str:
    levels = cpu_levels()
    if levels[0] != "x86-64":
        return levels[0]
    flags, level = _cpu_flags(), "x86-64"
    for name, needs in _X86_LEVELS:
        if not set(needs) <= flags:
            break
        level = name
    return level


def check_cpu_level(level: str) -> str:
    """``level`` when this architecture knows it (``--arch`` of a CPU build), else a clear error."""
    if level.startswith(NATIVE + "-") and level == _native_level():
        return level
    if level not in cpu_levels():
        raise LlmchatError(
            f"{level!r} is not a CPU level of this architecture.",
            f"use one of {', '.join(cpu_levels())} (this CPU: {_detected_level()})",
        )
    return level


def _host(level: str | None = None) -> dict[str, Any]:
    """The CPU target of the CPU back end: a portable level (this CPU's, or ``level``)."""
    level = check_cpu_level(level) if level else cpu_level()
    if level.startswith(NATIVE + "-"):
        import tvm

        return {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}
    return {"kind": "llvm", "mcpu": level} if level.startswith("x86-64") else {"kind": "llvm"}


def _portable_host() -> dict[str, Any]:
    """Host code of GPU libraries: LLVM's generic CPU of this architecture (no AVX-512 & co.), so a
    cached library moved to another machine with the same GPU never dies of an illegal instruction
    (the key records this level as ``host_cpu``)."""
    return {"kind": "llvm"}


def target_dict(device: DeviceSpec, arch: str | None = None) -> dict[str, Any]:
    """The target (dict form, as TVM 0.27 wants) for ``device``; ``arch`` overrides detection
    (``sm_90``, ``gfx1100``) for cross-compiling."""

    backend = device.backend
    if backend == "cpu":
        return _host(arch)
    if backend == "cuda":
        arch = arch or gpu_arch(device)
        if arch is None:
            raise LlmchatError("No CUDA device found to compile for.", "pass the architecture, e.g. sm_90")
        return {
            "kind": "cuda",
            "arch": arch,
            "max_shared_memory_per_block": 49152,
            "max_threads_per_block": 1024,
            "thread_warp_size": 32,
            "host": _portable_host(),
        }
    if backend == "rocm":
        arch = arch or gpu_arch(device)
        if arch is None:
            raise LlmchatError(
                "No ROCm device found to compile for.", "pass the gfx architecture, e.g. gfx1100"
            )
        wave = 32 if arch.startswith(("gfx10", "gfx11", "gfx12")) else 64
        return {
            "kind": "rocm",
            "mcpu": arch,
            "mtriple": "amdgcn-amd-amdhsa-hcc",
            "max_shared_memory_per_block": 65536,
            "max_threads_per_block": 1024,
            "thread_warp_size": wave,
            "host": _portable_host(),
        }
    if backend == "vulkan":
        # TVM's WGSL code generator (PyPI's TVM has no SPIR-V one), run by llmchat's WebGPU
        # device API on wgpu-native; sized to the adapter's limits
        from app.inference.backends import webgpu

        return webgpu.target_dict(device.index, _portable_host(), profile=arch)
    if backend == "metal":
        return {
            "kind": "metal",
            "max_threads_per_block": 1024,
            "max_shared_memory_per_block": 32768,
            "thread_warp_size": 32,
            "host": {"kind": "llvm", "mtriple": "arm64-apple-macos"},
        }
    raise LlmchatError(f"Unknown backend {backend!r}.", "use cpu, cuda, rocm, vulkan or metal")


def make_target(device: DeviceSpec, arch: str | None = None) -> Any:
    """A ``tvm.target.Target`` for ``device``."""
    import tvm

    try:
        return tvm.target.Target(target_dict(device, arch))
    except LlmchatError:
        raise
    except Exception as err:
        raise LlmchatError(
            f"TVM cannot build code for {device.backend} ({err}).",
            "use --device cpu or a TVM build with that back end",
        ) from err


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
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("app.")
            and node.value.replace(".", "").replace("_", "").isalnum()
        ):
            found.add(node.value)
    return {m for m in found if m == "app" or m.startswith("app.")}


def library_sources() -> list[Path]:
    """Every source file whose code can end up in a compiled library: the import closure of the
    compiler and of the model, quantization and pipeline packages, plus kernel sources (``.cu`` …)
    in the directories of those modules.  Derived from the code, so a new module is covered."""
    here = Path(__file__).parent.parent  # app/inference
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
    extra = {
        f.resolve()
        for d in {p.parent for p in seen}
        if d.is_relative_to(here.resolve())
        for f in d.iterdir()
        if f.suffix in _KERNEL_SOURCE_SUFFIXES and f.is_file()
    }
    return sorted(seen | extra)


@functools.cache
def _source_digest() -> str:
    app_root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for f in library_sources():
        h.update(str(f.relative_to(app_root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


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
    """What distinguishes code for ``device``: the CPU level, the GPU architecture or the WGSL
    adapter profile (``arch`` names one that is not here).

    Needs only the TVM runtime, so a runtime-only install finds the cached library."""
    import tvm

    if device.backend == "cpu":
        return check_cpu_level(arch) if arch else cpu_level()
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


@dataclass(frozen=True)
class LibraryKey:
    """Everything that decides a library's code.  Its digest names the entry in the local compile
    cache, and a prebuilt bundle's manifest carries it field by field: a bundle fits this machine
    exactly when its key is the one this machine would compile (app/inference/compile/prebuilt.py)."""

    model: str  # sha256 of the model's code-relevant config (ModelConfig.code_key)
    quantization: str
    backend: str  # cpu, cuda, rocm, vulkan, metal
    device: str  # the CPU level, GPU architecture (sm_90, gfx1100) or WGSL adapter profile
    host_cpu: str  # the portable CPU level of the host code
    tvm: str
    engine: str  # ENGINE_VERSION
    source: str  # digest of llmchat's sources that end up in a library (library_sources)
    pipeline: str  # "llmchat" or "tvm-default" (TVM's stock pipeline)
    switches: tuple[tuple[str, str], ...] = ()  # kernel switches that are set

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["switches"] = dict(self.switches)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> LibraryKey:
        """The key a manifest records (ValueError when a field is missing or of the wrong type)."""
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names):
            raise ValueError(f"a library key has exactly the fields {', '.join(names)}")
        switches = data["switches"]
        if not isinstance(switches, dict) or not all(isinstance(v, str) for v in switches.values()):
            raise ValueError("switches must map names to strings")
        if not all(isinstance(data[n], str) for n in names if n != "switches"):
            raise ValueError("every field but switches must be a string")
        return cls(**{**data, "switches": tuple(sorted(switches.items()))})

    def digest(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    @property
    def target(self) -> str:
        """``cpu-x86-64-v3``, ``cuda-sm_90``, ``vulkan-wgsl-f16-wg32768-t256``: the label a catalog's
        prebuilt library names."""
        return f"{self.backend}-{self.device}"

    def differences(self, other: LibraryKey) -> list[str]:
        """What differs from ``other`` (this machine's key), in words: ``TVM 0.26.0 (here 0.27.0)``."""
        words = {
            "model": "model config",
            "device": "target",
            "host_cpu": "host CPU level",
            "tvm": "TVM",
            "engine": "engine version",
            "source": "llmchat library sources",
            "pipeline": "pipeline",
            "switches": "kernel switches",
        }
        mine, theirs = self.as_dict(), other.as_dict()
        return [
            f"{words.get(n, n)} {mine[n] or '-'} (here {theirs[n] or '-'})"
            for n in mine
            if mine[n] != theirs[n]
        ]


def _host_level(backend: str, fingerprint: str) -> str:
    """The CPU level host code is compiled for: the CPU library's own level, else the baseline."""
    return fingerprint if backend == "cpu" else cpu_levels()[0]


def library_key(
    cfg: ModelConfig, backend: str, fingerprint: str, plain_pipeline: bool | None = None
) -> LibraryKey:
    """The key of ``cfg`` compiled for ``backend`` / ``fingerprint`` (``plain_pipeline``: with TVM's
    stock pipeline; default: as LLMCHAT_TVM_PIPELINE says)."""
    import tvm

    model = hashlib.sha256(json.dumps(cfg.code_key(), sort_keys=True, default=str).encode()).hexdigest()
    plain = _plain_pipeline() if plain_pipeline is None else plain_pipeline
    return LibraryKey(
        model=model[:32],
        quantization=cfg.quantization,
        backend=backend,
        device=fingerprint,
        host_cpu=_host_level(backend, fingerprint),
        tvm=str(tvm.__version__),
        engine=ENGINE_VERSION,
        source=_source_digest()[:32],
        pipeline="tvm-default" if plain else "llmchat",
        switches=tuple(sorted(_kernel_switches().items())),
    )


def cache_key(cfg: ModelConfig, backend: str, fingerprint: str, plain_pipeline: bool | None = None) -> str:
    """Hex digest naming the library of ``cfg`` compiled for ``backend`` / ``fingerprint``."""
    return library_key(cfg, backend, fingerprint, plain_pipeline).digest()


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
KERNEL_SWITCHES = (
    "LLMCHAT_GPU_GEMV",
    "LLMCHAT_CUDA_GEMM",
    "LLMCHAT_CUDA_ATTENTION",
    "LLMCHAT_CUDA_PAGED_PREFILL",
    "LLMCHAT_WGSL_GEMM",
    "LLMCHAT_WGSL_ATTENTION",
    "LLMCHAT_WGSL_GEMV",
    "LLMCHAT_WGSL_SUBGROUPS",
    "LLMCHAT_WGSL_FUSION",
    "LLMCHAT_CPU_GEMM",
)


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


def _build_hooks(target: Any) -> contextlib.AbstractContextManager[Any]:
    """ROCm: find the toolchain; CUDA: turn kernels into prebuilt fatbins (``compile.cuda_support``)."""
    if target.kind.name == "rocm":
        return rocm_toolchain()
    if target.kind.name != "cuda":
        return contextlib.nullcontext()
    try:
        from app.inference.compile.cuda_support import cuda_build_hooks
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
    with (
        _build_hooks(target),
        _scratch_tempdir(),
        tvm.transform.PassContext(opt_level=3, config=_pass_config(target)),
    ):
        from app.inference.pipelines.wgsl_subgroups import tir_pipeline

        executable = tvm.compile(mod, target, relax_pipeline=pipeline, tir_pipeline=tir_pipeline(target))
        if progress:
            progress(ProgressEvent("compile", "writing the library", 2, 3))
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                prefix=f"{out_path.stem}.{os.getpid()}.", suffix=".so.tmp", dir=out_path.parent
            )
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


def compile_library(
    cfg: ModelConfig,
    target: Any,
    out_path: Path,
    progress: ProgressCallback | None = None,
    device_label: str | None = None,
    report_pipeline: bool = False,
) -> Any:
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
            "use --device cpu or --device auto (`llmchat doctor` says what this machine can run)",
        )
    if progress:
        where = device_label or ("cpu" if kind == "llvm" else "vulkan" if kind == "webgpu" else kind)
        progress(
            ProgressEvent("compile", f"compiling for {where} ({cfg.model_type}, {cfg.quantization}) …", 0, 3)
        )
    try:
        mod, named_params = export_model(cfg, target)
    except LlmchatError:
        raise
    except Exception as err:
        raise LlmchatError(
            f"Building the {cfg.model_type} model failed: {type(err).__name__}: {err}",
            "report this with the message above",
        ) from err
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
            raise LlmchatError(
                f"Compiling the model for {kind} failed: {first}",
                "run with --device cpu, or report this with the message above",
            ) from err
        # llmchat's kernel schedules failed: TVM's stock pipeline gives slower but working code
        if progress:
            progress(
                ProgressEvent(
                    "compile",
                    f"llmchat's schedules failed ({first[:200]}); "
                    "retrying with TVM's stock pipeline (slower code)",
                    1,
                    3,
                )
            )
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
            raise LlmchatError(
                f"LLMCHAT_COMPUTE_DTYPE={forced!r} is not float16 or float32.", "unset it or use one of those"
            )
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
        return CompiledModel(
            lib, meta["params"], meta["target"], meta["compute_dtype"], meta.get("origin", "compiled")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _known_fallback(
    cfg: ModelConfig, device: DeviceSpec, key: str, fallback_key: str
) -> CompiledModel | None:
    """The stock-pipeline library cached when llmchat's schedules failed for exactly these sources
    (``key``): the failure would repeat, so a start does not pay for it again."""
    base = libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{fallback_key}"
    meta_path = base.with_suffix(".json")
    try:
        if json.loads(meta_path.read_text(encoding="utf-8")).get("schedules_failed_for") != key:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    from app.debug_log import log

    log.info("llmchat's schedules failed before for key %s: using the stock library %s", key, base.name)
    return _cached_entry(base.with_suffix(".so"), meta_path)


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
    return dataclasses.replace(
        cfg, quantization=F32_TWINS.get(cfg.quantization, cfg.quantization), tensor_formats=formats
    )


@dataclass(frozen=True)
class LibrarySlot:
    """Where the library of a model on a device lives in the cache, under which key, and the
    model config as it is compiled there (compute dtype, storage)."""

    cfg: ModelConfig
    key: LibraryKey
    lib: Path
    meta: Path

    @property
    def digest(self) -> str:
        return self.lib.stem.rsplit("-", 1)[-1]


def library_slot(
    cfg: ModelConfig, device: DeviceSpec, arch: str | None = None, plain_pipeline: bool | None = None
) -> LibrarySlot:
    """The cache slot of ``cfg`` on ``device`` (``arch``: a GPU architecture, WGSL profile or CPU
    level that is not this machine's)."""
    fingerprint = device_fingerprint(device, arch)
    if device.backend == "vulkan":
        cfg = without_f16_storage(cfg, fingerprint)
    cfg = dataclasses.replace(
        cfg, compute_dtype=compute_dtype_for(cfg, device.backend), word_storage=device.backend == "vulkan"
    )
    key = library_key(cfg, device.backend, fingerprint, plain_pipeline)
    base = libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{key.digest()}"
    return LibrarySlot(cfg, key, base.with_suffix(".so"), base.with_suffix(".json"))


def cached_library(slot: LibrarySlot, progress: ProgressCallback | None = None) -> CompiledModel | None:
    """The slot's verified cache entry; a damaged or incomplete one is removed (and None)."""
    if not (slot.meta.exists() or slot.lib.exists()):
        return None
    found = _cached_entry(slot.lib, slot.meta)
    if found is not None:
        return found
    if progress:
        progress(
            ProgressEvent(
                "compile", f"the cached library {slot.lib.name} is damaged or incomplete: rebuilding it", 0, 3
            )
        )
    drop_library(slot)
    return None


def drop_library(slot: LibrarySlot) -> None:
    """Remove the slot's entry (metadata first: a half-removed entry is never "complete")."""
    _drop_entry(slot.lib, slot.meta)


def install_library(slot: LibrarySlot, built: Path, meta: dict[str, Any]) -> CompiledModel:
    """Move ``built`` (a verified library on the cache's file system) into the slot and write its
    metadata last, with the size and sha256 every later load checks."""
    try:
        os.replace(built, slot.lib)
        meta = {**meta, "key": slot.digest, "size": slot.lib.stat().st_size, "sha256": file_digest(slot.lib)}
        _write_json_atomic(slot.meta, meta)
    except OSError as err:
        raise cache_write_error(libs_dir(), err) from err
    return CompiledModel(
        slot.lib, meta["params"], meta["target"], meta["compute_dtype"], meta.get("origin", "compiled")
    )


#: asked on a cache miss before compiling: a verified prebuilt library installed in the slot, or None
Fetcher = Callable[[LibrarySlot], "CompiledModel | None"]


def get_library(
    cfg: ModelConfig,
    device: DeviceSpec,
    arch: str | None = None,
    progress: ProgressCallback | None = None,
    fetch: Fetcher | None = None,
) -> CompiledModel:
    """The cached library for ``cfg`` on ``device``, compiling it first if needed (also when the
    cached one fails its size/checksum check); ``fetch`` may install a prebuilt one instead."""
    slot = library_slot(cfg, device, arch)
    found = cached_library(slot, progress)
    if found is not None:
        return found
    if fetch is not None:
        fetched = fetch(slot)
        if fetched is not None:
            return fetched
    fallback_key = library_key(slot.cfg, device.backend, slot.key.device, plain_pipeline=True).digest()
    known = None if _plain_pipeline() else _known_fallback(slot.cfg, device, slot.digest, fallback_key)
    if known is not None:
        if progress:
            progress(
                ProgressEvent(
                    "compile",
                    f"llmchat's schedules failed for this model before: using the "
                    f"cached library of TVM's stock pipeline (slower; delete "
                    f"{known.lib_path.name} to try the schedules again)",
                    3,
                    3,
                )
            )
        return known
    try:  # a cache that cannot take the library fails now, not after minutes of compiling
        libs_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=libs_dir(), prefix=".write-check-"):
            pass
    except OSError as err:
        raise cache_write_error(libs_dir(), err) from err
    return compile_into(slot, device, arch, progress)


def compile_into(
    slot: LibrarySlot, device: DeviceSpec, arch: str | None = None, progress: ProgressCallback | None = None
) -> CompiledModel:
    """Compile the slot's library here and cache it."""
    cfg, lib, meta_path = slot.cfg, slot.lib, slot.meta
    key = slot.digest
    target = make_target(device, arch)
    t0 = time.monotonic()
    fallback_key = library_key(cfg, device.backend, slot.key.device, plain_pipeline=True).digest()
    params, stock = compile_library(
        cfg, target, lib, progress, device_label=str(device), report_pipeline=True
    )
    normal_key = key
    if stock and not _plain_pipeline():
        # TVM's stock pipeline stood in for llmchat's schedules: that slower library is cached under
        # the stock pipeline's key, never under this one; its metadata names this key, so a later
        # start with the same sources takes it at once, and changed sources try the schedules again
        fallback = libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{fallback_key}"
        os.replace(lib, fallback.with_suffix(".so"))
        lib, meta_path, key = fallback.with_suffix(".so"), fallback.with_suffix(".json"), fallback_key
    meta = {
        "params": params,
        "target": str(target),
        "compute_dtype": cfg.activation_dtype,
        "key": key,
        "compile_s": round(time.monotonic() - t0, 2),
        "model": cfg.code_key(),
        "pipeline": "tvm-default" if stock else "llmchat",
        "origin": "compiled",
        # the schedules failed for these sources: later starts take this library at once
        **({"schedules_failed_for": normal_key} if stock and not _plain_pipeline() else {}),
        "size": lib.stat().st_size,
        "sha256": file_digest(lib),
    }
    try:
        _write_json_atomic(meta_path, meta)
    except OSError as err:
        raise cache_write_error(libs_dir(), err) from err
    return CompiledModel(lib, params, meta["target"], cfg.activation_dtype)


def compile_seconds(backend: str) -> float | None:
    """How long compiling a library for ``backend`` took on this machine (the mean of the cached
    libraries' recorded times), or None when none was compiled here yet."""
    times = []
    with contextlib.suppress(OSError):
        for meta_path in libs_dir().glob(f"*-{backend}-*.json"):
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                if meta.get("origin", "compiled") == "compiled" and float(meta.get("compile_s", 0)) > 0:
                    times.append(float(meta["compile_s"]))
    return sum(times) / len(times) if times else None


def cache_write_error(where: Path, err: OSError) -> LlmchatError:
    """The message for a compile cache that cannot be written (full, read-only, not a directory)."""
    from app.errors import os_error

    return os_error(
        err,
        f"Cannot write the compiled model library to {where}",
        "free some disk space, or point LLMCHAT_CACHE_DIR at a writable directory",
    )


def parameter_specs(cfg: ModelConfig) -> list[dict[str, Any]]:
    """The model's parameters (name, shape, dtype) in export order, without compiling."""
    from app.inference.models import model_class

    model = model_class(cfg.model_type)(cfg, None)
    return param_list(list(model.named_parameters()))
