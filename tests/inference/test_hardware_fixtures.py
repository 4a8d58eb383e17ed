"""The hardware probe on real sysfs snapshots (tests/fixtures/sysroots, from LACT's test data).

TVM runtimes are injected (``tvm_runtimes=``): the fixtures are other machines, so what this
machine's TVM can run says nothing about them. Each fixture is checked for both answers:
``recommended_backend`` (what the hardware calls for) and ``backend`` (what runs with a given TVM).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.inference.hardware import probe

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysroots"
GB = 1_000_000_000
GIB = 1 << 30


def fixture(name: str) -> Path:
    path = FIXTURES / name
    assert path.is_dir(), f"missing fixture {path}"
    return path


def test_every_fixture_finds_exactly_its_gpu():
    expected = {
        "amd-rx6900xt": ("amd", "1002:73bf", "gfx1030", "discrete"),
        "amd-rx6600": ("amd", "1002:73ff", "gfx1032", "discrete"),
        "amd-rx7900xtx": ("amd", "1002:744c", "gfx1100", "discrete"),
        "amd-vangogh": ("amd", "1002:163f", "gfx1033", "integrated"),
        "nvidia-rtx4080": ("nvidia", "10de:2704", None, "discrete"),
        "intel-a380-xe": ("intel", "8086:56a5", None, "discrete"),
    }
    dirs = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
    assert dirs == sorted(expected)
    for name, (vendor, pci_id, gfx, kind) in expected.items():
        report = probe(fixture(name), tvm_runtimes=set())
        assert [(d.vendor, d.pci_id, d.gfx_target, d.kind) for d in report.devices] == [
            (vendor, pci_id, gfx, kind)
        ]
        assert report.devices[0].bandwidth_bytes_per_s, name


def test_rx6900xt_reads_vram_and_gtt_from_sysfs():
    report = probe(fixture("amd-rx6900xt"), tvm_runtimes={"vulkan"})
    gpu = report.devices[0]
    # the NUL-padded mem_info files of the snapshot: 17163091968 and 16786171904 bytes
    assert gpu.vram_bytes == 17163091968 and gpu.vram_source == "sysfs"
    assert gpu.gtt_bytes == 16786171904
    assert gpu.name == "AMD Radeon RX 6900 XT"  # PCI revision 0xc0 of 73BF
    assert gpu.gfx_source == "table"  # no KFD files in this snapshot


def test_rx6900xt_without_rocm_recommends_vulkan_with_a_fix():
    report = probe(fixture("amd-rx6900xt"), tvm_runtimes={"vulkan"})
    assert report.recommended_backend == "vulkan"
    assert report.backend == "vulkan" and report.device == "vulkan:0"
    assert any("/dev/kfd" in f for f in report.fixes)
    assert any("HIP runtime" in f for f in report.fixes)
    assert any("not usable" in r for r in report.recommended_reasons)
    # a discrete GPU: VRAM × utilization
    assert report.memory_budget_bytes == int(17163091968 * 0.85)
    assert "× 0.85" in report.memory_budget_explanation


def test_rx6600_is_vulkan_and_offers_the_override_without_applying_it():
    report = probe(fixture("amd-rx6600"), tvm_runtimes={"vulkan", "rocm"})
    assert report.devices[0].gfx_target == "gfx1032"
    assert report.recommended_backend == "vulkan" and report.backend == "vulkan"
    assert len(report.options) == 1
    assert "HSA_OVERRIDE_GFX_VERSION=10.3.0" in report.options[0] and "risk" in report.options[0]
    assert not any("HSA_OVERRIDE" in f for f in report.fixes)


def test_rx7900xtx_without_kfd_is_vulkan_and_has_table_vram():
    report = probe(fixture("amd-rx7900xtx"), tvm_runtimes={"vulkan"})
    gpu = report.devices[0]
    assert gpu.gfx_target == "gfx1100" and gpu.vram_source == "table" and gpu.vram_bytes == 24 * GIB
    assert gpu.bandwidth_bytes_per_s == 960 * GB
    assert report.recommended_backend == "vulkan"
    assert not report.options  # gfx1100 is ROCm's own target: no override needed


def test_steam_deck_is_vulkan_with_a_unified_memory_budget():
    report = probe(fixture("amd-vangogh"), tvm_runtimes={"vulkan"})
    assert report.steam_deck and report.steam_deck_model == "LCD"
    gpu = report.devices[0]
    assert gpu.kind == "integrated" and gpu.gfx_source == "kfd" and gpu.compute_units == 8
    assert gpu.kfd_memory_bytes == 8 * GIB
    assert report.recommended_backend == "vulkan" and report.backend == "vulkan"
    assert report.device == "vulkan:0" and report.gpu is gpu
    assert 8 * GB <= report.memory_budget_bytes <= 16 * GB
    # more than the BIOS carve-out: the unified-memory path
    assert report.memory_budget_bytes > gpu.vram_bytes
    assert "GTT" in report.memory_budget_explanation and "MemAvailable" in report.memory_budget_explanation
    assert any("venv" in n for n in report.notes) and any("Desktop Mode" in n for n in report.notes)
    assert any("SteamOS" in r for r in report.recommended_reasons)


def test_steam_deck_budget_follows_utilization_and_free_memory():
    full = probe(fixture("amd-vangogh"), tvm_runtimes={"vulkan"}).memory_budget_bytes
    half = probe(fixture("amd-vangogh"), utilization=0.5, tvm_runtimes={"vulkan"}).memory_budget_bytes
    assert half < full
    assert half == int(9 * GIB * 0.5)  # (1 GiB carve-out + 8 GiB GTT) × 0.5


def test_steam_deck_without_the_vulkan_runtime_falls_back_to_cpu_with_the_fix():
    report = probe(fixture("amd-vangogh"), tvm_runtimes=set())
    assert report.recommended_backend == "vulkan"
    assert report.backend == "cpu" and report.device == "cpu:0" and report.gpu is None
    assert any("WebGPU add-on" in f and "ziglang" in f for f in report.fixes)
    # on the CPU the budget is system RAM, bounded by what is free
    assert report.memory_budget_bytes == 12011864 * 1024 - GIB


def test_nvidia_is_cuda():
    report = probe(fixture("nvidia-rtx4080"), tvm_runtimes={"cuda"})
    assert report.devices[0].name == "NVIDIA GeForce RTX 4080"
    assert report.recommended_backend == "cuda" and report.backend == "cuda" and report.device == "cuda:0"
    assert report.memory_budget_bytes == int(16 * GIB * 0.85)
    assert report.devices[0].bandwidth_bytes_per_s == int(716.8 * GB)


def test_nvidia_without_a_cuda_runtime_in_tvm_falls_back():
    report = probe(fixture("nvidia-rtx4080"), tvm_runtimes=set())
    assert report.recommended_backend == "cuda"
    assert report.backend == "cpu"
    assert any("CUDA" in f for f in report.fixes)


@pytest.mark.parametrize("runtimes, backend", [({"vulkan"}, "vulkan"), (set(), "cpu")])
def test_intel_arc_is_vulkan_or_cpu(runtimes, backend):
    report = probe(fixture("intel-a380-xe"), tvm_runtimes=runtimes)
    assert report.recommended_backend == "vulkan"
    assert report.backend == backend


def test_fixture_reports_serialise_to_the_documented_json():
    for name in ("amd-vangogh", "amd-rx6900xt", "nvidia-rtx4080"):
        data = json.loads(probe(fixture(name), tvm_runtimes={"vulkan"}).to_json())
        for key in (
            "devices",
            "recommended_backend",
            "backend",
            "device",
            "memory_budget_bytes",
            "steam_deck",
            "reasons",
            "fixes",
        ):
            assert key in data, (name, key)
        for dev in data["devices"]:
            assert set(dev) >= {"vendor", "name", "pci_id", "gfx_target", "kind", "vram_bytes", "gtt_bytes"}
            assert dev["kind"] in ("discrete", "integrated")


def test_sysroot_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMCHAT_SYSROOT", str(fixture("nvidia-rtx4080")))
    report = probe(tvm_runtimes={"cuda"})
    assert report.backend == "cuda"
    assert [d.pci_id for d in report.devices] == ["10de:2704"]
