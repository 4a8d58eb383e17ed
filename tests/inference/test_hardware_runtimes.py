"""What the installed TVM can run, and the probe of this real machine.

The TVM checks run against this machine's real apache-tvm (PyPI: CPU and a CUDA sidecar, no ROCm,
no Vulkan runtime) and against stand-in TVM packages built in tmp dirs (empty files whose only
content is what the probe reads: the library names they link to, or a runtime's registration name).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.inference.hardware import probe
from app.inference.hardware.runtimes import (
    tvm_runtimes_for,
    tvm_runtimes_live,
    tvm_runtimes_static,
)
from app.inference.hardware.sysfs import SysReader
from tests import unprivileged

REPO = Path(__file__).resolve().parents[2]


def fake_tvm(tmp_path: Path, files: dict[str, bytes]) -> Path:
    pkg = tmp_path / "tvm"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "lib" / "libtvm_runtime.so").write_bytes(b"\x7fELF generic runtime")
    for name, content in files.items():
        (pkg / "lib" / name).write_bytes(content)
    return pkg


def test_static_sidecar_counts_only_when_its_libraries_resolve(tmp_path):
    pkg = fake_tvm(tmp_path, {"libtvm_runtime_rocm.so": b"\x7fELF\0libamdhip64.so.99\0libtvm_runtime.so\0"})
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    missing = tvm_runtimes_static(SysReader(root), package_dir=pkg)
    assert missing.method == "static" and missing.available == {"cpu"}
    assert any("libamdhip64.so.99 not found" in d for d in missing.details)
    (root / "usr/lib/libamdhip64.so.99").write_bytes(b"")
    found = tvm_runtimes_static(SysReader(root), package_dir=pkg)
    assert found.available == {"cpu", "rocm"}


def test_static_monolithic_runtime_by_registration_name(tmp_path):
    pkg = fake_tvm(tmp_path, {})
    (pkg / "lib" / "libtvm_runtime.so").write_bytes(b"\0runtime.module.loadfile_vulkan\0device_api.rocm\0")
    result = tvm_runtimes_static(SysReader(tmp_path), package_dir=pkg)
    assert result.available == {"cpu", "vulkan"}  # "device_api.rocm" alone proves nothing


def test_static_check_of_the_installed_tvm_is_fast_and_counts_llmchats_runtimes():
    from app.inference.hardware.runtimes import _hip_static, _webgpu_static

    started = time.perf_counter()
    result = tvm_runtimes_static(SysReader("/"))
    elapsed = time.perf_counter() - started
    print(f"static TVM runtime check: {elapsed * 1000:.1f} ms, {sorted(result.available or [])}")
    assert result.method == "static"
    assert "cpu" in result.available
    # rocm: PyPI's wheel has no ROCm runtime; llmchat's HIP add-on is one wherever it can be built
    assert ("rocm" in result.available) == _hip_static()[0]
    # vulkan: through llmchat's add-on, wherever wgpu, the Vulkan loader and a compiler are present
    assert ("vulkan" in result.available) == _webgpu_static()[0]
    assert elapsed < 1.0


def test_live_check_agrees_with_the_static_one():
    live = tvm_runtimes_live()  # imports tvm (about a second); must not raise whatever the machine
    static = tvm_runtimes_static(SysReader("/"))
    assert live.method == "live"
    assert live.available == static.available, (live.details, static.details)
    for backend, exists in live.devices_exist.items():
        assert isinstance(exists, bool), backend


def test_where_the_runtime_set_comes_from(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMCHAT_TVM_RUNTIMES", raising=False)
    assert tvm_runtimes_for(SysReader(tmp_path), {"vulkan"}).available == {"cpu", "vulkan"}
    unchecked = tvm_runtimes_for(SysReader(tmp_path), None)
    assert unchecked.method == "unchecked" and unchecked.available is None
    monkeypatch.setenv("LLMCHAT_TVM_RUNTIMES", "rocm, vulkan")
    assert tvm_runtimes_for(SysReader(tmp_path), None).available == {"cpu", "rocm", "vulkan"}


def test_probe_of_this_machine():
    """Under a second, no root needed, and the TVM-aware backend is one this TVM can run."""
    env_root = os.environ.pop("LLMCHAT_SYSROOT", None)
    try:
        started = time.perf_counter()
        report = probe()
        elapsed = time.perf_counter() - started
    finally:
        if env_root is not None:
            os.environ["LLMCHAT_SYSROOT"] = env_root
    print(f"probe of this machine: {elapsed * 1000:.1f} ms; {report.backend} ({report.recommended_backend})")
    assert elapsed < 5.0  # sanity bound only; measured ~50 ms here
    assert report.backend in ("rocm", "vulkan", "cuda", "metal", "cpu")
    assert report.memory_budget_bytes > 0
    tvm = report.runtimes["tvm"]
    assert tvm["method"] in ("live", "static")
    assert report.backend in tvm["available"]
    json.loads(report.to_json())


FRESH_PROBE = (
    "import os, sys, time; t = time.perf_counter()\n"
    "from app.inference.hardware import probe\n"
    "r = probe()\n"
    "print(time.perf_counter() - t, r.backend, 'tvm' in sys.modules, os.geteuid())\n"
)


def _run_fresh_probe(python: str = sys.executable, **kwargs) -> subprocess.CompletedProcess:
    unset = ("LLMCHAT_SYSROOT", "LLMCHAT_TVM_RUNTIMES")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(kwargs.pop("env", {}))
    return subprocess.run(
        [python, "-c", FRESH_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, **kwargs
    )


def test_probe_in_a_fresh_process_is_fast_and_never_imports_tvm():
    out = _run_fresh_probe()
    assert out.returncode == 0, out.stderr
    seconds, backend, tvm_imported, _uid = out.stdout.split()
    print(f"fresh process: import + probe {float(seconds) * 1000:.0f} ms, backend {backend}")
    assert tvm_imported == "False"  # the probe never pays for `import tvm`
    assert float(seconds) < 5.0  # sanity bound only; measured ~0.15 s here


def test_probe_needs_no_root():
    """The probe of this machine runs as an unprivileged user (``nobody`` when the tests run as
    root, as in CI), from a copy of the package that user can read."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("LLMCHAT_") and k not in ("LLMCHAT_SYSROOT", "LLMCHAT_TVM_RUNTIMES")
    }
    with unprivileged.shared_dir() as shared:
        env["LLMCHAT_CACHE_DIR"] = env["LLMCHAT_DATA_DIR"] = env["LLMCHAT_CONFIG_DIR"] = str(shared / "dirs")
        out = unprivileged.run_python(FRESH_PROBE, shared, env=env)
    if out is None:
        pytest.skip("no Python interpreter here can be run by an unprivileged user")
    assert out.returncode == 0, out.stderr
    print(f"unprivileged probe: {out.stdout.strip()}")
    _seconds, backend, tvm_imported, uid = out.stdout.split()
    assert backend in ("rocm", "vulkan", "cuda", "metal", "cpu") and tvm_imported == "False"
    assert int(uid) == (unprivileged.NOBODY if unprivileged.is_root() else os.geteuid())


class _StandInDevice:
    """Stand-in for a tvm.runtime.Device whose driver answers, fails, or hangs."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    @property
    def exist(self) -> bool:
        if self.behaviour == "hang":
            time.sleep(3)
        if self.behaviour == "raise":
            raise RuntimeError("hsa_init failed")
        return self.behaviour == "yes"


def _stand_in_tvm(behaviour: str):
    import types

    return types.SimpleNamespace(
        runtime=types.SimpleNamespace(device=lambda kind, index: _StandInDevice(behaviour))
    )


def test_device_exist_check_cannot_raise_or_hang():
    from app.inference.hardware.runtimes import _device_exists

    assert _device_exists(_stand_in_tvm("yes"), "rocm", 1.0) == (True, "")
    exists, problem = _device_exists(_stand_in_tvm("raise"), "rocm", 1.0)
    assert not exists and "hsa_init failed" in problem
    started = time.perf_counter()
    exists, problem = _device_exists(_stand_in_tvm("hang"), "vulkan", 0.2)
    assert not exists and "did not answer" in problem
    assert time.perf_counter() - started < 1.5
