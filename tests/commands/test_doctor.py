"""`llmchat doctor` end to end: the real CLI in a subprocess, pointed at the sysroot fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "sysroots"


def llmchat(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    unset = ("LLMCHAT_SYSROOT", "LLMCHAT_TVM_RUNTIMES", "HSA_OVERRIDE_GFX_VERSION")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_doctor_json_on_the_steam_deck_fixture():
    out = llmchat("doctor", "--json", "--sysroot", str(FIXTURES / "amd-vangogh"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["steam_deck"] is True
    assert data["recommended_backend"] == "vulkan"
    assert data["backend"] == "vulkan" and data["device"] == "vulkan:0"  # TVM not checked for a sysroot
    assert 8e9 <= data["memory_budget_bytes"] <= 16e9
    [dev] = data["devices"]
    assert dev["vendor"] == "amd" and dev["pci_id"] == "1002:163f" and dev["gfx_target"] == "gfx1033"
    assert dev["kind"] == "integrated"
    assert {"vram_bytes", "gtt_bytes", "name"} <= set(dev)
    assert isinstance(data["reasons"], list) and data["reasons"]
    assert isinstance(data["fixes"], list)
    assert data["runtimes"]["tvm"]["method"] == "unchecked"


def test_doctor_json_with_the_tvm_runtimes_of_pypi(tmp_path):
    """$LLMCHAT_TVM_RUNTIMES stands in for the TVM of the probed machine (here: PyPI's, cpu only)."""
    out = llmchat(
        "doctor", "--json", "--sysroot", str(FIXTURES / "amd-vangogh"), env={"LLMCHAT_TVM_RUNTIMES": ""}
    )
    data = json.loads(out.stdout)
    assert data["recommended_backend"] == "vulkan" and data["backend"] == "cpu"
    # Vulkan comes from llmchat's WebGPU add-on: the fix names what it needs
    assert any("WebGPU add-on" in fix and "wgpu" in fix for fix in data["fixes"])


def test_doctor_text_on_every_fixture():
    expected = {
        "amd-rx6900xt": "Recommended backend: vulkan",
        "amd-rx6600": "HSA_OVERRIDE_GFX_VERSION=10.3.0",
        "amd-rx7900xtx": "gfx1100",
        "amd-vangogh": "Steam Deck (LCD): yes",
        "nvidia-rtx4080": "Recommended backend: cuda",
        "intel-a380-xe": "Intel Arc A380",
    }
    for name, needle in expected.items():
        out = llmchat("doctor", "--sysroot", str(FIXTURES / name))
        assert out.returncode == 0, (name, out.stderr)
        assert needle in out.stdout, (name, out.stdout)
        assert "Memory budget:" in out.stdout


def test_doctor_reads_the_sysroot_from_the_environment():
    out = llmchat("doctor", "--json", env={"LLMCHAT_SYSROOT": str(FIXTURES / "nvidia-rtx4080")})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["backend"] == "cuda"


def test_doctor_on_this_machine():
    out = llmchat("doctor", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["backend"] in data["runtimes"]["tvm"]["available"]
    text = llmchat("doctor")
    assert text.returncode == 0, text.stderr
    assert f"Backend llmchat will use: {data['backend']}" in text.stdout
    assert "TVM runtimes here: cpu" in text.stdout


def test_doctor_bad_sysroot_is_a_clear_error(tmp_path):
    out = llmchat("doctor", "--sysroot", str(tmp_path / "nope"))
    assert out.returncode == 1
    assert "not a directory" in out.stderr and "fix:" in out.stderr
    assert "Traceback" not in out.stderr


def test_doctor_utilization_is_validated_and_used():
    deck = str(FIXTURES / "amd-vangogh")
    bad = llmchat("doctor", "--sysroot", deck, "--utilization", "1.5")
    assert bad.returncode == 1 and "utilization" in bad.stderr and "Traceback" not in bad.stderr
    half = json.loads(llmchat("doctor", "--json", "--sysroot", deck, "--utilization", "0.5").stdout)
    full = json.loads(llmchat("doctor", "--json", "--sysroot", deck).stdout)
    assert half["memory_budget_bytes"] < full["memory_budget_bytes"]
    assert half["utilization"] == 0.5


def _copy_fixture(name: str, tmp_path: Path) -> Path:
    import shutil

    root = tmp_path / name
    shutil.copytree(FIXTURES / name, root, symlinks=True)
    return root


def test_doctor_ignores_negative_and_absurd_vram_sizes(tmp_path):
    root = _copy_fixture("amd-rx6900xt", tmp_path)
    vram = root / "sys/class/drm/card0/device/mem_info_vram_total"
    for value in ("-14588628172", str(850 * 10**27)):  # a budget of -13.6 GiB, or 7.9e20 GiB
        vram.write_text(value + "\n")
        out = llmchat("doctor", "--json", "--sysroot", str(root))
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert 8e9 <= data["memory_budget_bytes"] <= 24e9  # the table's VRAM of an RX 6900 XT
        assert data["devices"][0]["vram_source"] == "table"
        assert any(
            "mem_info_vram_total" in p and "impossible memory size" in p and value in p
            for p in data["problems"]
        ), data["problems"]


def test_doctor_with_a_non_ascii_kfd_node_directory(tmp_path):
    root = _copy_fixture("amd-vangogh", tmp_path)
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    for odd in ("²", "٣", "ノード"):
        (nodes / odd).mkdir()
        (nodes / odd / "properties").write_text((nodes / "1" / "properties").read_text())
    out = llmchat("doctor", "--json", "--sysroot", str(root))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    data = json.loads(out.stdout)
    assert data["recommended_backend"] == "vulkan" and len(data["devices"]) == 1
    text = llmchat("doctor", "--sysroot", str(root))
    assert text.returncode == 0 and "Traceback" not in text.stderr
