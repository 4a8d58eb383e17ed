"""Hardware probe: which GPUs are here, which backend llmchat should use, why, and how much memory.

    report = probe()                      # the running machine (or $LLMCHAT_SYSROOT)
    report = shared_probe()               # the same, made once per process and shared
    report = probe("tests/fixtures/sysroots/amd-vangogh", tvm_runtimes={"vulkan"})
    report.backend, report.device, report.memory_budget_bytes, report.to_json(), report.format_text()

Pure functions over files under a root directory (``/`` or a fixture tree): no GPU driver is
loaded and nothing needs root. TVM is only asked when it is already imported in this process;
otherwise its installed runtime libraries are inspected without importing it (fast).

``device_spec`` turns the probe's choice or ``--device`` into the device a model runs on, checked
against what the installed TVM runtime can drive (it asks TVM, so it is imported only when needed).
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from app.errors import LlmchatError
from app.inference.hardware.decision import BACKENDS, Decision, Inputs, decide
from app.inference.hardware.devices import GpuDevice, enumerate_gpus
from app.inference.hardware.memory import memory_budget
from app.inference.hardware.report import STEAMOS_NOTES, HardwareReport
from app.inference.hardware.runtimes import (
    NvidiaStatus,
    RocmStatus,
    VulkanStatus,
    probe_nvidia,
    probe_rocm,
    probe_vulkan,
    tvm_runtimes_for,
)
from app.inference.hardware.sysfs import SysReader
from app.inference.hardware.system import read_system, steam_deck_model

__all__ = [
    "BACKENDS",
    "GpuDevice",
    "HardwareReport",
    "forget_shared_probe",
    "probe",
    "resolve_sysroot",
    "shared_probe",
]

#: probes made in this process (tests count them: a start probes once)
PROBE_COUNT = 0
#: environment switches a probe of the running machine reads
_PROBE_ENV = (
    "LLMCHAT_SYSROOT",
    "LLMCHAT_TVM_RUNTIMES",
    "HSA_OVERRIDE_GFX_VERSION",
    "LLMCHAT_GPU_RUNTIME",
    "LLMCHAT_HIP_LIBRARY",
)
_shared: dict[str, object] = {}
_shared_lock = threading.Lock()


def resolve_sysroot(sysroot: str | os.PathLike[str] | None = None) -> Path:
    """``sysroot``, else $LLMCHAT_SYSROOT, else "/"; raises LlmchatError when it is not a directory."""
    root = Path(sysroot if sysroot is not None else os.environ.get("LLMCHAT_SYSROOT") or "/")
    if not root.is_dir():
        raise LlmchatError(
            f"The sysroot {str(root)!r} is not a directory.",
            "pass --sysroot (or set LLMCHAT_SYSROOT to) a directory laid out like / (with sys/, proc/, etc/)",
        )
    return root


def probe(
    sysroot: str | os.PathLike[str] | None = None,
    *,
    utilization: float = 0.85,
    tvm_runtimes: set[str] | None = None,
) -> HardwareReport:
    """Probe the machine (or a sysroot) and decide the backend.

    ``utilization``: share of GPU memory the model may use (MLC's gpu_memory_utilization).
    ``tvm_runtimes``: the device runtimes the installed TVM has (e.g. {"vulkan"}); None = find out
    (from $LLMCHAT_TVM_RUNTIMES, the imported TVM, or its installed libraries; not for a sysroot).
    """
    if not 0 < utilization <= 1:
        raise LlmchatError(
            f"GPU memory utilization must be between 0 and 1, got {utilization}.", "use a value such as 0.85"
        )
    global PROBE_COUNT
    PROBE_COUNT += 1
    started = time.perf_counter()
    root = resolve_sysroot(sysroot)
    reader = SysReader(root)
    system = read_system(reader)
    linux = system.os_name == "Linux"
    gpus = enumerate_gpus(reader) if linux else []
    if system.os_name == "Darwin":
        gpus = [
            GpuDevice(
                vendor="apple",
                name=f"Apple GPU ({platform.machine()})",
                pci_id="",
                kind="integrated",
                vram_bytes=None,
            )
        ]
    if linux and reader.is_real_root and not reader.exists("/sys/class/drm"):
        reader.problem("/sys/class/drm", "missing (no GPU driver loaded, or a container without /dev/dri)")
    vulkan = probe_vulkan(reader) if linux else VulkanStatus()
    rocm = probe_rocm(reader) if linux else RocmStatus()
    nvidia = probe_nvidia(reader) if linux else NvidiaStatus()
    tvm = tvm_runtimes_for(reader, tvm_runtimes)
    deck = steam_deck_model(system, [g.pci_id for g in gpus])
    override = os.environ.get("HSA_OVERRIDE_GFX_VERSION")
    decision = decide(Inputs(gpus, system, vulkan, rocm, nvidia, tvm, deck, override))
    run_gpu = None if decision.backend in ("cpu", "metal") else decision.gpu
    budget, explanation = memory_budget(run_gpu, decision.backend, system, utilization)
    notes = list(STEAMOS_NOTES) if (deck is not None or system.is_steamos) else []
    return HardwareReport(
        devices=gpus,
        recommended_backend=decision.recommended_backend,
        backend=decision.backend,
        device=decision.device,
        memory_budget_bytes=budget,
        memory_budget_explanation=explanation,
        steam_deck=deck is not None,
        steam_deck_model=deck,
        reasons=decision.recommended_reasons + decision.backend_reasons,
        recommended_reasons=decision.recommended_reasons,
        backend_reasons=decision.backend_reasons,
        fixes=decision.fixes,
        options=decision.options,
        notes=notes,
        problems=list(reader.problems),
        utilization=utilization,
        system=_system_dict(system),
        runtimes=_runtimes_dict(decision, vulkan, rocm, nvidia, tvm),
        sysroot=str(root),
        gpu_index=next((i for i, g in enumerate(gpus) if g is run_gpu), None),
        probe_seconds=time.perf_counter() - started,
    )


def _probe_state() -> tuple[tuple[str | None, ...], tuple[str, ...] | None]:
    """What a probe of the running machine depends on that can change while the process runs: its
    environment switches, and the device runtimes an imported TVM has registered (llmchat loads
    CUDA's, the Vulkan and ROCm add-ons on demand); None before TVM is imported (the probe then
    reads TVM's installed runtime libraries). Cheap: no device is touched."""
    env = tuple(os.environ.get(name) for name in _PROBE_ENV)
    sysroot = os.environ.get("LLMCHAT_SYSROOT")
    asks_tvm = os.environ.get("LLMCHAT_TVM_RUNTIMES") is None and (not sysroot or Path(sysroot) == Path("/"))
    if not asks_tvm or "tvm" not in sys.modules:  # (runtimes given, or a sysroot: TVM is not asked)
        return env, None
    try:
        import tvm_ffi

        registered = tuple(
            b
            for b in ("cuda", "rocm", "vulkan", "webgpu", "metal")
            if tvm_ffi.get_global_func(f"device_api.{b}", allow_missing=True) is not None
        )
    except Exception:  # asking must never fail a start
        registered = ("?",)
    return env, registered


def _still_current(made: object, now: tuple[tuple[str | None, ...], tuple[str, ...] | None]) -> bool:
    """Whether a shared report made in state ``made`` answers for ``now``: the same switches, and
    the same registered runtimes, unless it was made before TVM was imported (from TVM's installed
    runtime libraries: importing TVM later changes nothing it read)."""
    if not isinstance(made, tuple):
        return False
    env, registered = made
    return env == now[0] and (registered is None or registered == now[1])


def shared_probe() -> HardwareReport:
    """The probe of the running machine, made once per process and shared by everything that asks
    at start (the catalog's fit badges, ``--device auto``, the Vulkan memory budget, ``bench``'s
    roofline). It is made again only when something it depends on changed since (an environment
    switch, a runtime registered with TVM: :func:`_probe_state`). :func:`probe` always probes
    afresh (``doctor``, the hardware screen's refresh); :func:`forget_shared_probe` drops the
    shared one."""
    with _shared_lock:  # two threads asking at start (the catalog, the engine) share one probe
        if "report" not in _shared or not _still_current(_shared.get("state"), _probe_state()):
            _load_cuda_runtime()
            _shared["report"] = probe()
            _shared["state"] = _probe_state()  # after the probe: it may load an add-on
        report = _shared["report"]
    assert isinstance(report, HardwareReport)
    return report


def _load_cuda_runtime() -> None:
    """With NVIDIA's driver present and TVM imported, load the CUDA runtime before a shared probe:
    TVM registers its CUDA runtime only once libcudart is loaded, and a probe that asks an imported
    TVM before that sees no CUDA (seen on the H200: ``--device auto`` fell to the CPU)."""
    if "tvm" not in sys.modules or not os.path.exists("/proc/driver/nvidia/version"):
        return  # without TVM imported the probe reads its installed libraries: nothing to load
    try:
        from app.inference.compile.cuda_support import prepare_cuda_runtime

        prepare_cuda_runtime()
    except Exception:  # no CUDA runtime: the probe says so
        pass


def forget_shared_probe() -> None:
    """The next :func:`shared_probe` probes afresh."""
    with _shared_lock:
        _shared.clear()


def _system_dict(system) -> dict:
    return {
        "os": system.os_name,
        "os_release": system.os_pretty_name,
        "machine": system.machine,
        "mem_total_bytes": system.mem_total_bytes,
        "mem_available_bytes": system.mem_available_bytes,
        "sys_vendor": system.sys_vendor,
        "product_name": system.product_name,
    }


def _runtimes_dict(decision: Decision, vulkan, rocm, nvidia, tvm) -> dict:
    return {
        "vulkan": {
            "loader": vulkan.loader,
            "icds": [asdict(i) for i in vulkan.icds],
            "adapters": list(tvm.webgpu_adapters),
        },
        "rocm": {
            "usable": rocm.usable,
            "kfd_exists": rocm.kfd_exists,
            "kfd_openable": rocm.kfd_openable,
            "kfd_error": rocm.kfd_error,
            "user": rocm.user,
            "in_render_group": rocm.in_render_group,
            "hip_libs": rocm.hip_libs,
            "rocblas_libs": rocm.rocblas_libs,
            "rocblas_gfx": sorted(rocm.rocblas_gfx),
            "version": rocm.version,
        },
        "nvidia": {
            "driver_version": nvidia.driver_version,
            "libcuda": nvidia.libcuda,
            "cudart": nvidia.cudart,
        },
        "tvm": {
            "method": tvm.method,
            "available": None if tvm.available is None else sorted(tvm.available),
            "devices_exist": tvm.devices_exist,
            "details": tvm.details,
        },
    }
