"""What machine code a library is built for: the portable CPU levels, the TVM target of each back
end, and the device fingerprint (CPU level, GPU architecture or WGSL adapter profile) the cache key
records.

Host code is compiled for a portable CPU level: the architecture's baseline on GPU targets, the
newest x86-64-vN level this CPU has on the CPU target (never the build machine's own ``-mcpu``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from typing import Any

from app.errors import LlmchatError
from app.inference.hardware.device_spec import DeviceSpec

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


def host_level(backend: str, fingerprint: str) -> str:
    """The CPU level host code is compiled for: the CPU library's own level, else the baseline."""
    return fingerprint if backend == "cpu" else cpu_levels()[0]
