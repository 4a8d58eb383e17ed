"""`llmchat doctor`: show the GPUs found, the backend chosen and why, and the memory budget"""

from __future__ import annotations

import argparse
import sys

HELP = "show the GPUs found, the backend chosen and why, and the memory budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--sysroot",
        metavar="DIR",
        default=None,
        help="read every system file relative to DIR instead of / (default: $LLMCHAT_SYSROOT or /)",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.85,
        metavar="FRACTION",
        help="share of GPU memory the model may use (default 0.85)",
    )


def run(args: argparse.Namespace) -> int:
    from app.inference.hardware import probe

    report = probe(args.sysroot, utilization=args.utilization)
    if not args.sysroot:
        _add_vulkan_adapters(report)
        _add_rocm_devices(report)
    sys.stdout.write(report.to_json() + "\n" if args.json else report.format_text())
    return 0


def _add_vulkan_adapters(report) -> None:
    """List the adapters wgpu sees (building llmchat's Vulkan add-on if needed), guarded by a
    timeout: a hanging driver cannot hang `doctor`."""
    import threading

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

    worker = threading.Thread(target=ask, name="vulkan-adapters", daemon=True)
    worker.start()
    worker.join(120)
    if not outcome:
        vk["adapters_problem"] = "the Vulkan driver did not answer within 120 s"
        return
    vk["adapters"], why = outcome[0]
    if why:
        from app.inference.backends.webgpu import fix_for

        vk["adapters_problem"] = f"vulkan cannot run here: {why} (fix: {fix_for(why)})"


def _add_rocm_devices(report) -> None:
    """What llmchat's ROCm runtime sees: the HIP library, the GPUs with their gfx target and wave
    size, or each missing piece with its fix; guarded by a timeout like the Vulkan adapters."""
    import threading

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

    worker = threading.Thread(target=ask, name="rocm-devices", daemon=True)
    worker.start()
    worker.join(120)
    if not outcome:
        rocm["runtime_problem"] = "the HIP runtime did not answer within 120 s"
        return
    st, why = outcome[0]
    rocm["runtime"] = {"library": st.get("library", ""), "devices": st.get("devices", [])}
    if why:
        from app.inference.backends.hip import fix_for

        rocm["runtime_problem"] = f"rocm cannot run here: {why} (fix: {fix_for(why)})"
