"""Compiler pipelines per target family: which Relax/TIR passes and kernel schedules a model gets.

``pipeline_for(target)`` is the one place the engine's compiler asks. ``cpu.py`` assembles the
pipeline for llvm targets (``cpu_schedule.py``: the generic matmul schedule; ``cpu_gemv.py``,
``cpu_gemm.py``, ``cpu_attention.py``: llmchat's CPU kernels); ``gpu.py`` the one for
CUDA/ROCm/Vulkan/Metal (``gpu_choices.py``: which kernels a target gets; ``gpu_gemv.py``: the
``DecodeGEMV`` rule; ``gpu_gemm.py``, ``gpu_argmax.py``, ``cuda_*.py``, ``wgsl_*.py``: the other
kernels and rules).
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
