"""How many bytes the model (weights + KV cache + workspace) may use on the chosen device.

Discrete GPU: VRAM × utilization (0.85 by default, MLC's ``gpu_memory_utilization``).
APU (unified memory): the BIOS carve-out plus GTT — system RAM the GPU driver may map — times
utilization, bounded by what the system can spare (carve-out + MemAvailable − headroom for the OS
and this app). CPU: RAM × utilization, bounded the same way. The arithmetic comes back as text.
"""

from __future__ import annotations

from app.inference.hardware.devices import GpuDevice
from app.inference.hardware.system import SystemInfo

GIB = 1 << 30
#: RAM left to the OS and to llmchat itself when the model lives in system memory
HEADROOM_BYTES = 1 * GIB
#: assumed VRAM of a discrete GPU whose memory size could not be read nor looked up
UNKNOWN_VRAM_BYTES = 4 * GIB
#: Metal lets one process use about this share of unified memory (recommendedMaxWorkingSetSize)
METAL_WORKING_SET_SHARE = 0.75


def gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def memory_budget(
    gpu: GpuDevice | None, backend: str, system: SystemInfo, utilization: float = 0.85
) -> tuple[int, str]:
    """(budget in bytes, the arithmetic as one line of text)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    u = f"{utilization:g}"
    if backend == "cpu" or (gpu is None and backend != "metal"):
        return _system_ram_budget(system, utilization, "CPU: model in system RAM")
    if backend == "metal":
        total = system.mem_total_bytes
        if not total:
            return int(8 * GIB * utilization), f"Metal: RAM size unknown, assuming 8 GiB × {u}"
        budget = int(total * METAL_WORKING_SET_SHARE * utilization)
        return budget, (
            f"Metal (unified memory): {gib(total)} RAM × {METAL_WORKING_SET_SHARE:g} (Metal working set)"
            f" × {u} utilization = {gib(budget)}"
        )
    assert gpu is not None
    if gpu.is_integrated:
        return _unified_budget(gpu, system, utilization)
    if gpu.vram_bytes:
        budget = int(gpu.vram_bytes * utilization)
        source = "" if gpu.vram_source == "sysfs" else " (typical for this model; not read from the driver)"
        return budget, f"discrete GPU: {gib(gpu.vram_bytes)} VRAM{source} × {u} utilization = {gib(budget)}"
    budget = int(UNKNOWN_VRAM_BYTES * utilization)
    return budget, (
        f"discrete GPU: VRAM size unknown, assuming {gib(UNKNOWN_VRAM_BYTES)} × {u} utilization"
        f" = {gib(budget)}"
    )


def _spare(system: SystemInfo) -> tuple[int | None, str]:
    """RAM the system can give away now, and how that was worked out."""
    if system.mem_available_bytes is not None:
        spare = max(0, system.mem_available_bytes - HEADROOM_BYTES)
        return spare, f"MemAvailable {gib(system.mem_available_bytes)} − {gib(HEADROOM_BYTES)} headroom"
    if system.mem_total_bytes:
        spare = max(0, int(system.mem_total_bytes * 0.75) - HEADROOM_BYTES)
        return spare, (
            f"MemAvailable unknown: 0.75 × MemTotal {gib(system.mem_total_bytes)}"
            f" − {gib(HEADROOM_BYTES)} headroom"
        )
    return None, "RAM size unknown"


def _system_ram_budget(system: SystemInfo, utilization: float, label: str) -> tuple[int, str]:
    total = system.mem_total_bytes
    spare, spare_text = _spare(system)
    if not total:
        guess = int(4 * GIB * utilization)
        return guess, f"{label}: RAM size unknown, assuming 4 GiB × {utilization:g} = {gib(guess)}"
    share = int(total * utilization)
    budget = share if spare is None else min(share, spare)
    return budget, (
        f"{label}: min(MemTotal {gib(total)} × {utilization:g} = {gib(share)}, "
        f"{spare_text} = {gib(spare)}) = {gib(budget)}"
    )


def _unified_budget(gpu: GpuDevice, system: SystemInfo, utilization: float) -> tuple[int, str]:
    carve = gpu.vram_bytes or 0
    carve_text = f"carve-out {gib(carve)}" + ("" if gpu.vram_source == "sysfs" else " (assumed default)")
    if gpu.gtt_bytes:
        gtt, gtt_text = gpu.gtt_bytes, f"GTT {gib(gpu.gtt_bytes)}"
    elif gpu.kfd_memory_bytes and gpu.kfd_memory_bytes > carve:
        gtt, gtt_text = (
            gpu.kfd_memory_bytes,
            f"GTT {gib(gpu.kfd_memory_bytes)} (size of KFD's GPU memory bank)",
        )
    elif system.mem_total_bytes:
        gtt = system.mem_total_bytes // 2
        gtt_text = f"GTT {gib(gtt)} (estimated: the kernel's default, half of MemTotal)"
    else:
        gtt, gtt_text = 0, "GTT unknown"
    pool = carve + gtt
    share = int(pool * utilization)
    spare, spare_text = _spare(system)
    if spare is None:
        budget = share
        return budget, (
            f"unified memory: ({carve_text} + {gtt_text}) × {utilization:g} utilization = {gib(budget)}"
            " (RAM size unknown: not bounded by free memory)"
        )
    can_spare = carve + spare
    budget = min(share, can_spare)
    return budget, (
        f"unified memory: min(({carve_text} + {gtt_text}) × {utilization:g} utilization = {gib(share)}, "
        f"{carve_text} + {spare_text} = {gib(can_spare)}) = {gib(budget)}"
    )
