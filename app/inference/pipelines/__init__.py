"""Compiler pipelines per target family: which Relax/TIR passes and kernel schedules a model gets.

``pipeline_for(target)`` is the one place the engine's compiler asks; ``cpu.py`` holds the
schedules for llvm targets, ``gpu.py`` those for CUDA/ROCm/Vulkan/Metal.
"""

from __future__ import annotations

from typing import Any


def pipeline_for(target: Any) -> Any:
    """The relax pipeline for ``target`` (a ``tvm.target.Target``), as ``tvm.compile`` takes it."""
    if target.kind.name == "llvm":
        from app.inference.pipelines.cpu import cpu_pipeline

        return cpu_pipeline(target)
    from app.inference.pipelines.gpu import gpu_pipeline

    return gpu_pipeline(target)


def pass_config_for(target: Any) -> dict[str, Any]:
    """PassContext options ``target`` needs while compiling.

    WGSL (``webgpu``): TVM's common-subexpression elimination leaves a variable used before its
    definition in a few attention kernels (seen for qwen2 shapes: "variable cse_v12 has been
    used before definition"), so it stays off there."""
    if target.kind.name == "webgpu":
        return {"tirx.disable_cse_tir": True}
    return {}
