"""The backend decision and the memory budget on inputs built directly (no files): cases no
fixture can show, such as a Mac, or a TVM that has a runtime but finds no device."""

from __future__ import annotations

from app.inference.hardware.decision import Inputs, choose_gpu, decide
from app.inference.hardware.devices import GpuDevice
from app.inference.hardware.memory import memory_budget
from app.inference.hardware.runtimes import NvidiaStatus, RocmStatus, TvmRuntimes, VulkanIcd, VulkanStatus
from app.inference.hardware.system import SystemInfo

GIB = 1 << 30


def linux(total=32 * GIB, available=24 * GIB) -> SystemInfo:
    return SystemInfo("Linux", "x86_64", mem_total_bytes=total, mem_available_bytes=available)


def vulkan_for(*vendors: str) -> VulkanStatus:
    icds = [VulkanIcd(f"/usr/share/vulkan/icd.d/{v}.json", f"lib{v}.so", v) for v in vendors]
    return VulkanStatus(loader=["/usr/lib/libvulkan.so.1"], icds=icds)


def test_mac_is_metal_with_a_unified_budget():
    mac = SystemInfo("Darwin", "arm64", mem_total_bytes=32 * GIB)
    gpu = GpuDevice("apple", "Apple GPU", "", kind="integrated")
    inp = Inputs(
        [gpu], mac, VulkanStatus(), RocmStatus(), NvidiaStatus(), TvmRuntimes({"cpu", "metal"}, "given")
    )
    d = decide(inp)
    assert (d.recommended_backend, d.backend, d.device) == ("metal", "metal", "metal:0")
    budget, text = memory_budget(None, "metal", mac, 0.85)
    assert budget == int(32 * GIB * 0.75 * 0.85) and "Metal" in text
    pypi = decide(
        Inputs([gpu], mac, VulkanStatus(), RocmStatus(), NvidiaStatus(), TvmRuntimes({"cpu"}, "static"))
    )
    assert pypi.backend == "cpu" and any("Metal" in f for f in pypi.fixes)


def test_tvm_runtime_without_a_device_falls_back():
    gpu = GpuDevice("nvidia", "NVIDIA GeForce RTX 4090", "10de:2684", driver="nvidia")
    tvm = TvmRuntimes({"cpu", "cuda", "vulkan"}, "live", devices_exist={"cuda": False, "vulkan": True})
    d = decide(Inputs([gpu], linux(), vulkan_for("nvidia"), RocmStatus(), NvidiaStatus(), tvm))
    assert d.recommended_backend == "cuda" and d.backend == "vulkan" and d.device == "vulkan:0"
    assert any("finds no device" in r for r in d.backend_reasons)


def test_choose_gpu_prefers_discrete_then_vendor_then_size():
    igpu = GpuDevice("amd", "Radeon 780M", "1002:15bf", kind="integrated", vram_bytes=4 * GIB)
    small = GpuDevice("amd", "RX 6600", "1002:73ff", vram_bytes=8 * GIB)
    big = GpuDevice("amd", "RX 7900 XTX", "1002:744c", vram_bytes=24 * GIB)
    nv = GpuDevice("nvidia", "RTX 3060", "10de:2503", vram_bytes=12 * GIB)
    odd = GpuDevice("other", "Matrox", "102b:0522")
    assert choose_gpu([igpu, small, big]) is big
    assert choose_gpu([igpu, big, nv]) is nv
    assert choose_gpu([igpu, odd]) is igpu
    assert choose_gpu([odd]) is None


def test_second_amd_gpu_gets_its_own_device_index():
    first = GpuDevice(
        "amd", "RX 6600", "1002:73ff", gfx_target="gfx1032", pci_slot="0000:03:00.0", kfd_node=1
    )
    second = GpuDevice(
        "amd",
        "RX 7900 XTX",
        "1002:744c",
        gfx_target="gfx1100",
        vram_bytes=24 * GIB,
        pci_slot="0000:0a:00.0",
        kfd_node=2,
    )
    rocm = RocmStatus(kfd_exists=True, kfd_openable=True, hip_libs=["/opt/rocm/lib/libamdhip64.so"])
    d = decide(
        Inputs([first, second], linux(), vulkan_for("amd"), rocm, NvidiaStatus(), TvmRuntimes(None, "x"))
    )
    assert d.gpu is second and d.backend == "rocm" and d.device == "rocm:1"


def test_discrete_budget_with_unknown_vram_is_a_stated_assumption():
    gpu = GpuDevice("other", "Some GPU", "1234:5678")
    budget, text = memory_budget(gpu, "vulkan", linux(), 0.5)
    assert budget == 2 * GIB and "unknown" in text
