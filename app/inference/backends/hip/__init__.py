"""ROCm through llmchat's own HIP runtime for TVM (``--device rocm[:N]``).

PyPI's ``apache-tvm`` compiles ROCm code objects (``tvm.compile`` for a ``rocm`` target with
``ld.lld`` and AMD's device bitcode) but has no ROCm runtime to load and launch them.
llmchat's add-on (:mod:`.addon`, ``native/llmchat_hip.cc``) is that runtime: it opens HIP at run
time (``libamdhip64.so.7``/``.6``/``.5``), so it builds without ROCm and says what is missing on
a machine without it.  ``--device rocm:N`` is HIP's device N.

The same code runs on NVIDIA GPUs as "the CUDA twin" (``LLMCHAT_GPU_RUNTIME=twin``): that is how
it is tested where no AMD GPU is at hand (see ``benchmarks/twin_check.py``).

This module answers: which GPUs HIP sees (:func:`devices`), why ROCm cannot run here
(:func:`problem`) with a fix (:func:`fix_for`), and TVM's device for ``rocm:N`` (:func:`device`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from app.errors import LlmchatError

#: TVM's device name for the runtime this backend provides
TVM_DEVICE = "rocm"
HIP_LIBRARIES = ("libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5")


@dataclass(frozen=True)
class HipDevice:
    """One GPU as HIP reports it."""

    index: int
    name: str
    arch: str  # "gfx1100"
    warp_size: int
    compute_units: int
    memory_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "arch": self.arch,
            "warp_size": self.warp_size,
            "compute_units": self.compute_units,
            "memory_bytes": self.memory_bytes,
        }


def status() -> dict[str, Any]:
    """The runtime's own report (loads the add-on; raises LlmchatError when it cannot be built)."""
    from app.inference.backends.hip import addon

    return addon.status()


def devices() -> list[HipDevice]:
    """The GPUs HIP sees, in ``rocm:N`` order (empty when HIP is missing or finds none)."""
    st = status()
    return [
        HipDevice(
            int(d["index"]),
            str(d["name"]),
            str(d["arch"]),
            int(d["warp_size"]),
            int(d["compute_units"]),
            int(d["memory_bytes"]),
        )
        for d in st.get("devices", [])
    ]


def problem(index: int = 0) -> str | None:
    """Why ``rocm:index`` cannot run here (None when it can), in words a user can act on."""
    from app.inference.backends.hip import addon

    if addon.mode() == addon.TWIN:
        return "LLMCHAT_GPU_RUNTIME=twin is set: llmchat's GPU runtime drives CUDA (--device cuda), not ROCm"
    try:
        st = status()
    except LlmchatError as err:
        return err.problem
    if not st.get("driver_found"):
        return str(st.get("error") or "the HIP runtime was not found")
    found = st.get("devices", [])
    if not found:
        why = st.get("devices_error") or "no device"
        return f"HIP found no GPU it can use ({why})"
    if index >= len(found):
        return f"there is no ROCm device {index} (HIP found {len(found)})"
    if not str(found[index].get("arch", "")).startswith("gfx"):
        return f"HIP did not report the gfx target of device {index} ({found[index].get('name')})"
    return None


def fix_for(problem_text: str) -> str:
    """A fix for one of :func:`problem`'s answers."""
    if "LLMCHAT_GPU_RUNTIME" in problem_text:
        return "unset LLMCHAT_GPU_RUNTIME to use ROCm"
    if "compiler" in problem_text:
        return "install g++ or `pip install ziglang`, or use --device cpu"
    if "HIP runtime was not found" in problem_text:
        if "cannot open shared object file" in problem_text:
            return (
                "the HIP runtime is installed but a library it needs is missing (see the message); "
                "repair the ROCm install (`sudo apt install rocm-hip-runtime`), or use --device vulkan "
                "or --device cpu"
            )
        return (
            "install ROCm's HIP runtime (libamdhip64: AMD's `rocm-hip-runtime` package, or "
            "`sudo apt install libamdhip64-5` on Debian/Ubuntu; Arch: `rocm-hip-runtime`), or use "
            "--device vulkan or --device cpu"
        )
    if "found no GPU" in problem_text:
        return _no_gpu_fix()
    if "no ROCm device" in problem_text:
        return "pick another --device rocm:N (`llmchat doctor` lists them), or use --device cpu"
    return "run `llmchat doctor`, or use --device vulkan or --device cpu"


def _no_gpu_fix() -> str:
    """What usually hides a Radeon from HIP: /dev/kfd access (the render/video groups), an
    unsupported gfx target (HSA_OVERRIDE_GFX_VERSION, at the user's own risk)."""
    parts = []
    if not os.path.exists("/dev/kfd"):
        parts.append("the amdgpu kernel driver exposes no /dev/kfd (is this an AMD GPU with amdgpu loaded?)")
    elif not os.access("/dev/kfd", os.R_OK | os.W_OK):
        parts.append(
            "add yourself to the render and video groups (`sudo usermod -aG render,video $USER`, "
            "then log in again) so that /dev/kfd can be opened"
        )
    parts.append(
        "if your GPU's gfx target is not in ROCm's list, HSA_OVERRIDE_GFX_VERSION (e.g. 10.3.0 "
        "or 11.0.0) makes ROCm treat it as a supported one: unsupported by AMD, it can crash or "
        "compute wrong results; llmchat never sets it for you (see `llmchat doctor`)"
    )
    parts.append("or use --device vulkan or --device cpu")
    return "; ".join(parts)


def device_info(index: int) -> HipDevice:
    """``rocm:index``'s device (raises LlmchatError with a fix when it is not there)."""
    why = problem(index)
    if why:
        raise LlmchatError(f"Cannot use --device rocm:{index}: {why}.", fix_for(why))
    return devices()[index]


def device(index: int) -> Any:
    """TVM's device for ``rocm:index`` (the add-on loaded)."""
    from app.inference.backends.hip import addon

    addon.load()
    import tvm

    return tvm.device(TVM_DEVICE, index)
