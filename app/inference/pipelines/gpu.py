"""The compiler pipeline for GPUs (cuda, rocm, vulkan, metal)."""

from __future__ import annotations

from typing import Any


def gpu_pipeline(target: Any) -> Any:
    """TVM's default GPU pipeline (LegalizeOps, fusion, dlight schedules) for now."""
    from tvm import relax

    return relax.get_default_pipeline(target)
