"""What llmchat's own device runtimes see on this machine, added to a hardware report for
``llmchat doctor``: the Vulkan adapters wgpu lists (building the WebGPU add-on if needed) and the
GPUs llmchat's ROCm runtime (its HIP add-on) finds, or each missing piece with its fix.

Each question runs in a thread with a timeout: a hanging driver cannot hang ``doctor``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.inference.hardware import HardwareReport

#: seconds a driver gets to answer
TIMEOUT_S = 120


def add_runtime_status(report: HardwareReport) -> None:
    """The Vulkan adapters and the ROCm devices, in ``report.runtimes``."""
    add_vulkan_adapters(report)
    add_rocm_devices(report)


def _ask_in_time(ask: Callable[[], None], name: str) -> None:
    """Run ``ask`` in a daemon thread for at most :data:`TIMEOUT_S` (a driver that hangs is left
    behind; ``ask`` records its answer where the caller looks for it)."""
    worker = threading.Thread(target=ask, name=name, daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)


def add_vulkan_adapters(report: HardwareReport) -> None:
    """List the adapters wgpu sees (building llmchat's Vulkan add-on if needed), guarded by a
    timeout."""
    vk = report.runtimes.setdefault("vulkan", {})
    if vk.get("adapters"):
        return
    outcome: list = []

    def ask() -> None:
        from app.errors import LlmchatError
        from app.inference.backends import webgpu

        try:
            why = webgpu.problem(0)
            outcome.append(
                ([a.as_dict() for a in webgpu.adapters()] if why is None or "adapter" in why else [], why)
            )
        except LlmchatError as err:
            outcome.append(([], err.problem))
        except Exception as err:  # never let doctor fail on a driver
            outcome.append(([], f"listing Vulkan adapters failed: {err}"))

    _ask_in_time(ask, "vulkan-adapters")
    if not outcome:
        vk["adapters_problem"] = f"the Vulkan driver did not answer within {TIMEOUT_S} s"
        return
    vk["adapters"], why = outcome[0]
    if why:
        from app.inference.backends.webgpu import fix_for

        vk["adapters_problem"] = f"vulkan cannot run here: {why} (fix: {fix_for(why)})"


def add_rocm_devices(report: HardwareReport) -> None:
    """What llmchat's ROCm runtime sees: the HIP library, the GPUs with their gfx target and wave
    size, or each missing piece with its fix; guarded by a timeout like the Vulkan adapters."""
    rocm = report.runtimes.setdefault("rocm", {})
    outcome: list = []

    def ask() -> None:
        from app.errors import LlmchatError
        from app.inference.backends import hip

        try:
            why = hip.problem(0)
            st = hip.status() if why is None or "HIP" in why or "device" in why else {}
            outcome.append((st, why))
        except LlmchatError as err:
            outcome.append(({}, err.problem))
        except Exception as err:  # never let doctor fail on a driver
            outcome.append(({}, f"asking HIP failed: {err}"))

    _ask_in_time(ask, "rocm-devices")
    if not outcome:
        rocm["runtime_problem"] = f"the HIP runtime did not answer within {TIMEOUT_S} s"
        return
    st, why = outcome[0]
    rocm["runtime"] = {"library": st.get("library", ""), "devices": st.get("devices", [])}
    if why:
        from app.inference.backends.hip import fix_for

        rocm["runtime_problem"] = f"rocm cannot run here: {why} (fix: {fix_for(why)})"
