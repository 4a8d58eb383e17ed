"""The hardware probe on synthetic sysroots built in tmp dirs: ROCm usable or not, Vulkan drivers,
missing / empty / garbage files, APUs without a fixture, and machines without a GPU.

Each tree starts from a real snapshot (tests/fixtures/sysroots) or from nothing, then gets the
files a real system would have (``/dev/kfd``, ``/etc/group``, ROCm libraries, ICD manifests …).
Library files are empty stand-ins: the probe only checks that they exist, never loads them.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
from pathlib import Path

import pytest

from app.inference.hardware import probe
from tests import unprivileged

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysroots"
GIB = 1 << 30
USER = getpass.getuser()


def make_root(tmp_path: Path, base: str | None = None) -> Path:
    root = tmp_path / "root"
    if base:
        shutil.copytree(FIXTURES / base, root, symlinks=True)
    else:
        root.mkdir()
    return root


def write(root: Path, rel: str, content: str | bytes = "", mode: int | None = None) -> Path:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    if mode is not None:
        path.chmod(mode)
    return path


def add_rocm(root: Path, *, gfx: tuple[str, ...] = ("gfx1030", "gfx1100"), group_member: bool = True) -> None:
    """A usable ROCm install: /dev/kfd openable, user in render, HIP + rocBLAS under /opt/rocm."""
    write(root, "/dev/kfd", "", mode=0o666)
    write(root, "/etc/group", f"video:x:44:{USER}\nrender:x:109:{USER if group_member else ''}\n")
    write(root, "/opt/rocm/.info/version", "6.2.4-120\n")
    write(root, "/opt/rocm/lib/libamdhip64.so.6")
    write(root, "/opt/rocm/lib/libhsa-runtime64.so.1")
    write(root, "/opt/rocm/lib/librocblas.so.4")
    for target in gfx:
        write(root, f"/opt/rocm/lib/rocblas/library/TensileLibrary_lazy_{target}.dat")
        write(root, f"/opt/rocm/lib/rocblas/library/Kernels.so-000-{target}.hsaco")


def add_vulkan(
    root: Path, *, loader: bool = True, driver: bool = True, icd: str = "radeon_icd.x86_64.json"
) -> None:
    """The Vulkan loader, Mesa's RADV manifest and the driver library it names."""
    if loader:
        write(root, "/usr/lib/x86_64-linux-gnu/libvulkan.so.1")
    if driver:
        write(root, "/usr/lib/x86_64-linux-gnu/libvulkan_radeon.so")
    manifest = {
        "file_format_version": "1.0.1",
        "ICD": {"library_path": "libvulkan_radeon.so", "api_version": "1.4.303"},
    }
    write(root, f"/usr/share/vulkan/icd.d/{icd}", json.dumps(manifest))


def amd_card(
    root: Path, pci_id: str, *, card: str = "card0", revision: str | None = None, **files: str
) -> None:
    dev = f"/sys/class/drm/{card}/device"
    write(
        root,
        f"{dev}/uevent",
        f"DRIVER=amdgpu\nPCI_CLASS=30000\nPCI_ID={pci_id}\nPCI_SLOT_NAME=0000:0{card[-1]}:00.0\n",
    )
    write(root, f"{dev}/vendor", "0x1002\n")
    if revision:
        write(root, f"{dev}/revision", f"0x{revision}\n")
    for name, value in files.items():
        write(root, f"{dev}/{name}", value)


def meminfo(root: Path, total_kb: int, available_kb: int) -> None:
    write(
        root,
        "/proc/meminfo",
        f"MemTotal:       {total_kb} kB\nMemFree: 1000 kB\nMemAvailable:   {available_kb} kB\n",
    )


# ------------------------------------------------------------------ ROCm usable or not


def test_rx6900xt_with_rocm_usable_is_rocm(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    add_rocm(root)
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.recommended_backend == "rocm"
    assert report.backend == "rocm" and report.device == "rocm:0"
    assert report.runtimes["rocm"]["usable"] is True
    assert report.runtimes["rocm"]["rocblas_gfx"] == ["gfx1030", "gfx1100"]
    assert report.runtimes["rocm"]["version"] == "6.2.4-120"
    assert not report.fixes and not report.options


def test_rocm_usable_but_tvm_without_rocm_runtime_falls_back(tmp_path):
    """PyPI's apache-tvm has no ROCm runtime of its own; llmchat's HIP add-on is it, and where that
    is missing (no compiler to build it) the fix says what it needs."""
    root = make_root(tmp_path, "amd-rx6900xt")
    add_rocm(root)
    pypi = probe(root, tvm_runtimes=set())
    assert pypi.recommended_backend == "rocm" and pypi.backend == "cpu"
    rocm_fixes = [f for f in pypi.fixes if "HIP runtime add-on" in f]
    assert len(rocm_fixes) == 1 and "libamdhip64" in rocm_fixes[0] and "/dev/kfd" in rocm_fixes[0]
    with_vulkan = probe(root, tvm_runtimes={"vulkan"})
    assert with_vulkan.recommended_backend == "rocm" and with_vulkan.backend == "vulkan"
    assert any(r.startswith("rocm cannot run here") for r in with_vulkan.backend_reasons)


def test_rx6900xt_without_kfd_is_vulkan_with_a_fix(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    add_rocm(root)
    (root / "dev" / "kfd").unlink()
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.recommended_backend == "vulkan" and report.backend == "vulkan"
    assert any("--device /dev/kfd" in f for f in report.fixes)


def test_kfd_not_openable_and_not_in_render_group_suggests_usermod(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    add_rocm(root, group_member=False)
    (root / "dev" / "kfd").unlink()
    (root / "dev" / "kfd").mkdir()  # cannot be opened read-write, even by root
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.runtimes["rocm"]["kfd_openable"] is False
    assert report.runtimes["rocm"]["in_render_group"] is False
    assert report.recommended_backend == "vulkan"
    assert any("usermod -aG render,video" in f for f in report.fixes)
    assert any("not in the render group" in r for r in report.reasons)


def test_kfd_permission_denied_suggests_usermod():
    """/dev/kfd without read-write permission for the user. Root opens a mode-000 file anyway, so
    the probe runs in a child process as an unprivileged user (``nobody`` when the tests run as
    root, as in CI) on a sysroot that user can read."""
    code = (
        "import json\nfrom app.inference.hardware import probe\n"
        "r = probe('root', tvm_runtimes={'rocm'})\n"
        "print(json.dumps({'kfd_error': r.runtimes['rocm']['kfd_error'], 'fixes': r.fixes}))\n"
    )
    with unprivileged.shared_dir() as shared:
        root = make_root(shared, "amd-rx6900xt")
        add_rocm(root)
        for path in root.rglob("*"):  # copied from the fixtures with their modes: readable by all
            path.chmod(0o755 if path.is_dir() else 0o644)
        (root / "dev" / "kfd").chmod(0)
        out = unprivileged.run_python(code, shared, env={"USER": USER, "LOGNAME": USER})
    if out is None:
        pytest.skip("no Python interpreter here can be run by an unprivileged user")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["kfd_error"] == "permission denied"
    assert any("usermod" in f for f in report["fixes"])


def test_rocm_without_hip_runtime_is_not_usable(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    add_rocm(root)
    (root / "opt/rocm/lib/libamdhip64.so.6").unlink()
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.recommended_backend == "vulkan"
    assert any("HIP runtime" in f for f in report.fixes)


def test_rocblas_without_kernels_for_the_gpu_means_vulkan(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    add_rocm(root, gfx=("gfx1100", "gfx942"))
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.recommended_backend == "vulkan"
    assert any("installed rocBLAS" in r and "gfx1100" in r for r in report.recommended_reasons)


def test_rx7900xtx_with_debian_rocm_layout_is_rocm(tmp_path):
    root = make_root(tmp_path, "amd-rx7900xtx")
    write(root, "/dev/kfd", mode=0o666)
    write(root, "/etc/group", f"render:x:993:{USER}\n")
    lib = "/usr/lib/x86_64-linux-gnu"
    write(root, f"{lib}/libamdhip64.so.6.1.2")
    write(root, f"{lib}/rocblas/4.1.0/library/TensileLibrary_lazy_gfx1100.dat")
    write(root, f"{lib}/rocblas/4.1.0/library/TensileLibrary_lazy_gfx1030.dat")
    report = probe(root, tvm_runtimes={"rocm"})
    assert report.recommended_backend == "rocm" and report.backend == "rocm"
    assert report.runtimes["rocm"]["rocblas_gfx"] == ["gfx1030", "gfx1100"]


def test_rx6600_with_rocm_installed_still_vulkan_and_override_offered(tmp_path, monkeypatch):
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    root = make_root(tmp_path, "amd-rx6600")
    add_rocm(root)
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.recommended_backend == "vulkan" and report.backend == "vulkan"
    assert any("HSA_OVERRIDE_GFX_VERSION=10.3.0" in o for o in report.options)
    assert "HSA_OVERRIDE_GFX_VERSION" not in os.environ  # offered, never applied


def test_rx7800xt_with_an_older_rocblas_offers_11_0_0(tmp_path, monkeypatch):
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    root = make_root(tmp_path)
    amd_card(root, "1002:747E", revision="c8", mem_info_vram_total=str(16 * GIB))
    add_rocm(root, gfx=("gfx1030", "gfx1100"))  # a ROCm 5.x-era rocBLAS: no gfx1101 kernels
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.devices[0].name == "AMD Radeon RX 7800 XT"
    assert report.devices[0].bandwidth_bytes_per_s == 624 * 10**9
    assert report.recommended_backend == "vulkan"
    assert any("HSA_OVERRIDE_GFX_VERSION=11.0.0" in o and "gfx1101" in o for o in report.options)


def test_unknown_amd_id_gets_gfx_and_size_from_kfd_and_sysfs(tmp_path):
    """An AMD GPU the table lacks: KFD gives the gfx target, mem_info_vram_vendor says discrete."""
    root = make_root(tmp_path)
    amd_card(
        root,
        "1002:7FFF",
        mem_info_vram_total="8589934592\n",
        mem_info_gtt_total="8589934592\n",
        mem_info_vram_vendor="hynix\n",
    )
    nodes = "/sys/class/kfd/kfd/topology/nodes"
    write(root, f"{nodes}/0/properties", "cpu_cores_count 16\nsimd_count 0\n")
    write(
        root,
        f"{nodes}/1/properties",
        "simd_count 64\nsimd_per_cu 2\ngfx_target_version 100300\nvendor_id 4098\ndevice_id 32767\n",
    )
    write(root, f"{nodes}/1/mem_banks/0/properties", "heap_type 1\nsize_in_bytes 8589934592\n")
    add_rocm(root)
    report = probe(root, tvm_runtimes={"rocm"})
    gpu = report.devices[0]
    assert gpu.name == "AMD GPU 1002:7fff" and gpu.bandwidth_bytes_per_s is None
    assert (gpu.gfx_target, gpu.gfx_source, gpu.kind, gpu.compute_units) == ("gfx1030", "kfd", "discrete", 32)
    assert gpu.kfd_node == 1 and gpu.kfd_memory_bytes == 8 * GIB
    assert report.backend == "rocm"


# ------------------------------------------------------------------ APUs and Vulkan drivers


def test_phoenix_apu_gets_libdrm_name_and_unified_budget(tmp_path):
    root = make_root(tmp_path)
    amd_card(
        root,
        "1002:15BF",
        revision="c1",
        mem_info_vram_total="4294967296\n",
        mem_info_gtt_total="31433977856\n",
    )
    write(
        root,
        "/usr/share/libdrm/amdgpu.ids",
        "# List of AMDGPU IDs\n\n1.0.0\n15BF,\tC1,\tAMD Radeon 780M Graphics\n"
        "15BF,\tC5,\tAMD Radeon 740M Graphics\n",
    )
    meminfo(root, 61394488, 52428800)
    add_vulkan(root)
    report = probe(root, tvm_runtimes={"vulkan"})
    gpu = report.devices[0]
    assert gpu.name == "AMD Radeon 780M Graphics"
    assert gpu.kind == "integrated" and gpu.gfx_target == "gfx1103"
    assert report.recommended_backend == "vulkan" and report.backend == "vulkan"
    pool = 4294967296 + 31433977856
    assert report.memory_budget_bytes == int(pool * 0.85)  # less than the 49 GiB the system can spare
    assert report.memory_budget_bytes > gpu.vram_bytes


def test_apu_budget_is_bounded_by_free_memory(tmp_path):
    root = make_root(tmp_path)
    amd_card(
        root,
        "1002:150E",
        revision="c1",
        mem_info_vram_total="536870912\n",
        mem_info_gtt_total="16441004032\n",
    )
    meminfo(root, 31 * 1024 * 1024, 3 * 1024 * 1024)  # only 3 GiB free right now
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.devices[0].kind == "integrated"
    # carve-out 0.5 GiB + (3 GiB available − 1 GiB headroom)
    assert report.memory_budget_bytes == 536870912 + 2 * GIB
    assert "MemAvailable" in report.memory_budget_explanation


def test_steam_deck_with_vulkan_installed_runs_vulkan(tmp_path):
    root = make_root(tmp_path, "amd-vangogh")
    add_vulkan(root)
    write(root, "/usr/share/vulkan/icd.d/broken.json", "{not json")
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.backend == "vulkan" and report.device == "vulkan:0"
    icds = report.runtimes["vulkan"]["icds"]
    assert [(i["vendor"], i["library_path"]) for i in icds] == [("amd", "libvulkan_radeon.so")]
    assert any("broken.json" in p for p in report.problems)
    assert 8e9 <= report.memory_budget_bytes <= 16e9


def test_steam_deck_without_vulkan_loader_gets_the_pacman_fix(tmp_path):
    root = make_root(tmp_path, "amd-vangogh")
    add_vulkan(root, loader=False)
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.recommended_backend == "vulkan" and report.backend == "cpu"
    assert any("pacman -S vulkan-icd-loader vulkan-radeon" in f for f in report.fixes)


def test_vulkan_manifest_without_its_driver_library_does_not_count(tmp_path):
    root = make_root(tmp_path, "amd-vangogh")
    add_vulkan(root, driver=False)
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.runtimes["vulkan"]["icds"] == []
    assert any("libvulkan_radeon.so is not installed" in p for p in report.problems)
    assert report.backend == "cpu" and any("vulkan-radeon" in f for f in report.fixes)


def test_user_exported_override_is_respected_and_explained(tmp_path, monkeypatch):
    root = make_root(tmp_path, "amd-rx6600")
    add_rocm(root)
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "10.3.0")
    report = probe(root, tvm_runtimes={"rocm", "vulkan"})
    assert report.recommended_backend == "rocm" and report.backend == "rocm"
    assert any("you set HSA_OVERRIDE_GFX_VERSION=10.3.0" in r for r in report.reasons)
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "banana")
    assert probe(root, tvm_runtimes={"rocm", "vulkan"}).recommended_backend == "vulkan"


def test_steam_deck_oled_by_pci_id(tmp_path):
    root = make_root(tmp_path)
    amd_card(root, "1002:1435", revision="ae")
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.steam_deck and report.steam_deck_model == "OLED"
    assert report.devices[0].gfx_target == "gfx1033" and report.recommended_backend == "vulkan"


def test_steam_deck_by_dmi_only(tmp_path):
    root = make_root(tmp_path)
    write(root, "/sys/class/dmi/id/sys_vendor", "Valve\n")
    write(root, "/sys/class/dmi/id/product_name", "Galileo\n")
    report = probe(root, tvm_runtimes=set())
    assert report.steam_deck and report.steam_deck_model == "OLED"


def test_nvidia_on_nouveau_recommends_the_driver(tmp_path):
    root = make_root(tmp_path)
    write(
        root,
        "/sys/class/drm/card0/device/uevent",
        "DRIVER=nouveau\nPCI_ID=10DE:2684\nPCI_SLOT_NAME=0000:01:00.0\n",
    )
    report = probe(root, tvm_runtimes={"cuda", "vulkan"})
    assert report.recommended_backend == "cuda" and report.backend != "cuda"
    assert any("NVIDIA's proprietary driver" in f for f in report.fixes)


def test_nvidia_and_amd_igpu_laptop_picks_the_nvidia_gpu(tmp_path):
    root = make_root(tmp_path)
    amd_card(root, "1002:1681", card="card0", revision="c8")
    write(
        root,
        "/sys/class/drm/card1/device/uevent",
        "DRIVER=nvidia\nPCI_ID=10DE:2860\nPCI_SLOT_NAME=0000:01:00.0\n",
    )
    report = probe(root, tvm_runtimes={"cuda"})
    assert [d.vendor for d in report.devices] == ["amd", "nvidia"]
    assert report.backend == "cuda" and report.device == "cuda:0"


def _nvidia_pci_function(root: Path, slot: str = "0000:18:00.0", device: str = "2335") -> None:
    """An NVIDIA GPU as /sys/bus/pci/devices shows it, with no DRM node (nvidia-drm not loaded)."""
    base = f"/sys/bus/pci/devices/{slot}"
    write(root, f"{base}/class", "0x030200\n")
    write(root, f"{base}/vendor", "0x10de\n")
    write(root, f"{base}/device", f"0x{device}\n")
    write(root, f"{base}/uevent", f"DRIVER=nvidia\nPCI_ID=10DE:{device.upper()}\nPCI_SLOT_NAME={slot}\n")


def test_nvidia_compute_gpu_without_a_drm_node_is_found(tmp_path):
    """Seen on the H200 server: no /sys/class/drm at all, the GPU only under /sys/bus/pci/devices."""
    root = make_root(tmp_path)
    _nvidia_pci_function(root)
    write(root, "/sys/bus/pci/devices/0000:00:1f.3/class", "0x040300\n")  # audio: not a GPU
    write(root, "/sys/bus/pci/devices/0000:00:1f.3/vendor", "0x8086\n")
    write(root, "/sys/bus/pci/devices/0000:00:1f.3/device", "0x7a50\n")
    report = probe(root, tvm_runtimes={"cuda", "cpu"})
    assert [(d.vendor, d.pci_id) for d in report.devices] == [("nvidia", "10de:2335")]
    assert "H200" in report.devices[0].name and report.devices[0].bandwidth_bytes_per_s
    assert report.recommended_backend == "cuda" and report.backend == "cuda" and report.device == "cuda:0"


def test_gpu_with_a_drm_node_and_a_pci_entry_is_listed_once(tmp_path):
    root = make_root(tmp_path)
    write(
        root,
        "/sys/class/drm/card0/device/uevent",
        "DRIVER=nvidia\nPCI_ID=10DE:2335\nPCI_SLOT_NAME=0000:18:00.0\n",
    )
    _nvidia_pci_function(root)
    report = probe(root, tvm_runtimes={"cuda"})
    assert len(report.devices) == 1 and report.devices[0].card == "card0"


# ------------------------------------------------------------------ missing, empty and garbage files


def test_garbage_and_empty_memory_files_fall_back_and_are_reported(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    dev = root / "sys/class/drm/card0/device"
    (dev / "mem_info_vram_total").write_text("lots of memory\n")
    (dev / "mem_info_gtt_total").write_text("   \n\n")
    report = probe(root, tvm_runtimes={"vulkan"})
    gpu = report.devices[0]
    assert gpu.vram_source == "table" and gpu.vram_bytes == 16 * GIB
    assert gpu.gtt_bytes is None
    assert any("mem_info_vram_total: not a number" in p for p in report.problems)
    assert any("mem_info_gtt_total: empty" in p for p in report.problems)
    assert report.backend == "vulkan"


def test_whitespace_and_nul_padding_is_tolerated(tmp_path):
    root = make_root(tmp_path)
    amd_card(root, "1002:73BF", revision="c1", mem_info_vram_total="  17163091968 \n\n" + "\0" * 100)
    report = probe(root, tvm_runtimes=set())
    assert report.devices[0].vram_bytes == 17163091968
    assert report.devices[0].name == "AMD Radeon RX 6800 XT"
    assert not report.problems


def test_unreadable_ids_skip_the_device_and_say_so(tmp_path):
    root = make_root(tmp_path)
    write(root, "/sys/class/drm/card0/device/uevent", "DRIVER=amdgpu\nPCI_ID=zzzz\n")
    write(root, "/sys/class/drm/card0/device/vendor", "\0\0\0")
    meminfo(root, 8 * 1024 * 1024, 6 * 1024 * 1024)
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.devices == [] and report.backend == "cpu"
    assert any("PCI_ID" in p for p in report.problems)
    assert any("skipped" in p for p in report.problems)


def test_garbage_kfd_properties_fall_back_to_the_table(tmp_path):
    root = make_root(tmp_path, "amd-vangogh")
    props = root / "sys/class/kfd/kfd/topology/nodes/1/properties"
    props.write_text("simd_count 16\ngfx_target_version abc\nvendor_id 4098\ndevice_id 5695\n")
    report = probe(root, tvm_runtimes={"vulkan"})
    gpu = report.devices[0]
    assert gpu.gfx_target == "gfx1033" and gpu.gfx_source == "table"
    assert any("gfx_target_version is not a number" in p for p in report.problems)


def test_directories_where_files_belong_and_garbage_meminfo(tmp_path):
    root = make_root(tmp_path, "amd-vangogh")
    (root / "proc/meminfo").write_text("MemTotal: many kB\n")
    write(root, "/etc/group", "")  # empty
    dmi = root / "sys/class/dmi/id/product_name"
    dmi.unlink()
    dmi.mkdir()
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.steam_deck  # still recognised by its PCI id
    assert any("MemTotal is not a number" in p for p in report.problems)
    assert any("product_name: is a directory" in p for p in report.problems)
    assert report.memory_budget_bytes > 0


# ------------------------------------------------------------------ no GPU at all


def test_no_gpu_at_all_is_cpu(tmp_path):
    root = make_root(tmp_path)
    meminfo(root, 16 * 1024 * 1024, 12 * 1024 * 1024)
    report = probe(root)
    assert report.devices == []
    assert report.recommended_backend == "cpu" and report.backend == "cpu" and report.device == "cpu:0"
    # min(16 GiB × 0.85 = 13.6 GiB, 12 GiB available − 1 GiB headroom)
    assert report.memory_budget_bytes == 11 * GIB
    assert not report.steam_deck and not report.fixes


def test_virtual_display_adapter_is_not_a_gpu(tmp_path):
    root = make_root(tmp_path)
    write(root, "/sys/class/drm/card0/device/uevent", "DRIVER=virtio-pci\nPCI_ID=1AF4:1050\n")
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.devices == [] and report.backend == "cpu"


def test_intel_integrated_gpu_runs_on_cpu(tmp_path):
    root = make_root(tmp_path)
    write(
        root,
        "/sys/class/drm/card0/device/uevent",
        "DRIVER=i915\nPCI_ID=8086:46A6\nPCI_SLOT_NAME=0000:00:02.0\n",
    )
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.devices[0].kind == "integrated"
    assert report.recommended_backend == "cpu" and report.backend == "cpu"


def test_a_fifo_where_a_file_belongs_cannot_hang_the_probe(tmp_path):
    root = make_root(tmp_path, "amd-rx6900xt")
    vram = root / "sys/class/drm/card0/device/mem_info_vram_total"
    vram.unlink()
    os.mkfifo(vram)  # opening it for reading would block without O_NONBLOCK
    report = probe(root, tvm_runtimes={"vulkan"})
    assert report.devices[0].vram_source == "table"
    assert any("mem_info_vram_total: not a regular file" in p for p in report.problems)


def test_platform_framebuffer_is_skipped_quietly(tmp_path):
    root = make_root(tmp_path)
    write(root, "/sys/class/drm/card0/device/uevent", "DRIVER=simple-framebuffer\nOF_NAME=framebuffer\n")
    report = probe(root, tvm_runtimes=set())
    assert report.devices == [] and report.problems == []
