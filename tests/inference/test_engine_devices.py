"""``--device`` parsing and clear errors for devices the installed TVM cannot drive."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.errors import LlmchatError
from app.inference.hardware import device_spec as devices
from app.inference.hardware.device_spec import DeviceSpec, parse_device, resolve_device


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", ("auto", None)),
        ("cpu", ("cpu", None)),
        ("cuda:1", ("cuda", 1)),
        ("ROCm", ("rocm", None)),
        ("vulkan:0", ("vulkan", 0)),
        ("metal", ("metal", None)),
        ("llvm", ("cpu", None)),
    ],
)
def test_parse_device(text, expected):
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "opencl", "cpu:1:2"])
def test_bad_device_strings(text):
    with pytest.raises(LlmchatError, match="Unknown device"):
        parse_device(text)


def test_cpu_always_resolves():
    assert resolve_device("cpu") == DeviceSpec("cpu", 0)
    assert str(resolve_device("cpu")) == "cpu:0"


def test_rocm_without_hip_is_a_clear_error():
    """PyPI's apache-tvm has no ROCm runtime; llmchat's own (its HIP add-on) needs HIP, which is
    missing here: say so and how to get it, never crash (a child process: a crash in native
    code would show as a signal).  More in tests/inference/backends/test_hip_addon.py."""
    code = (
        "from app.inference.hardware.device_spec import resolve_device\n"
        "from app.errors import LlmchatError\n"
        "try:\n    resolve_device('rocm')\nexcept LlmchatError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "LLMCHAT_HIP_LIBRARY": "/nonexistent/libamdhip64.so.6"}
    env.pop("LLMCHAT_GPU_RUNTIME", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR Cannot use --device rocm:0: the HIP runtime was not found")
    assert "rocm-hip-runtime" in out.stdout and "--device cpu" in out.stdout


def test_cuda_without_gpu_or_runtime_is_a_clear_error():
    import tvm

    if devices.runtime_problem("cuda") is None and tvm.cuda(0).exist:
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(LlmchatError, match="cuda"):
        resolve_device("cuda")


def test_auto_falls_back_to_cpu_when_probe_picks_an_unusable_backend(monkeypatch):
    """Stand-in for the hardware probe (another module): it picks ROCm, which cannot run here (no
    HIP library, or HIP without a GPU: llmchat's ROCm runtime says so)."""
    import types

    from app.inference.backends import hip

    if hip.problem(0) is None:
        pytest.skip("ROCm runs here")
    fake = types.ModuleType("app.inference.hardware")
    fake.shared_probe = lambda: types.SimpleNamespace(backend="rocm", device="rocm:0")
    monkeypatch.setitem(sys.modules, "app.inference.hardware", fake)
    assert resolve_device("auto") == DeviceSpec("cpu", 0)


def test_auto_uses_the_probe_choice_when_it_is_cpu(monkeypatch):
    import types

    fake = types.ModuleType("app.inference.hardware")
    fake.shared_probe = lambda: types.SimpleNamespace(backend="cpu", device="cpu:0")
    monkeypatch.setitem(sys.modules, "app.inference.hardware", fake)
    assert resolve_device("auto") == DeviceSpec("cpu", 0)


def test_metal_off_macos_suggests_what_runs_here_not_a_rocm_wheel():
    if sys.platform == "darwin":
        pytest.skip("on macOS Metal is the right suggestion")
    with pytest.raises(LlmchatError) as err:
        devices.check_device(resolve_device("metal"))
    assert "macOS" in err.value.fix and "--device cpu" in err.value.fix
    assert "rocm" not in err.value.fix.lower()
