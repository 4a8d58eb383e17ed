"""Subgroup operations in TVM's WGSL, made safe for an adapter with one fixed subgroup size.

TVM lowers a cross-thread reduction on a target with ``thread_warp_size`` W > 1 and
``supports_subgroups`` to warp shuffles, as on CUDA: ``subgroupShuffleDown`` steps, then a
broadcast of the group's sum from its first lane, ``subgroupShuffle(v, lane)``. The lane it passes
is the group leader's thread index *in the workgroup* (``threadIdx.y * 32`` for 32 threads per
row): CUDA's ``__shfl_sync`` takes it modulo its width, but WGSL's ``subgroupShuffle`` with a lane
at or beyond the subgroup size returns an indeterminate value. :func:`wrap_shuffle_lanes` takes the
lane modulo W (the adapter's subgroup size, which the profile fixes), which is what CUDA does.

The pass runs before TVM's device passes of the named TIR pipeline :data:`PIPELINE`
(registered on import; ``tvm.compile(..., tir_pipeline=tir_pipeline(target))``).
"""

from __future__ import annotations

from typing import Any

#: the TIR pipeline name for WGSL with subgroups (TVM's default pipeline + the lane fix)
PIPELINE = "llmchat_wgsl_subgroups"


def uses_subgroups(target: Any) -> bool:
    """Whether ``target`` is WGSL with subgroup operations (a fixed subgroup size above 1)."""
    return (
        target.kind.name == "webgpu"
        and bool(target.attrs.get("supports_subgroups", False))
        and int(target.attrs.get("thread_warp_size", 1)) > 1
    )


def wrap_shuffle_lanes() -> Any:
    """Device pass: ``tvm_warp_shuffle(mask, v, lane, width, W)`` -> lane ``floormod(lane, W)``."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.ir import Call

    shuffle = tvm.ir.Op.get("tirx.tvm_warp_shuffle")

    def _rewrite(call: Any) -> Any:
        if not isinstance(call.op, tvm.ir.Op) or not call.op.same_as(shuffle):
            return call
        mask, value, lane, width, warp = call.args
        if hasattr(lane, "value") and hasattr(warp, "value") and 0 <= int(lane.value) < int(warp.value):
            return call  # already a lane of the subgroup
        wrapped = tirx.floormod(lane, tirx.Cast(lane.ty, warp) if str(warp.ty) != str(lane.ty) else warp)
        return Call(call.op, [mask, value, wrapped, width, warp], ret_ty=call.ty)

    def _func(func: Any, _mod: Any, _ctx: Any) -> Any:
        return tvm_ffi.structural_map(func, [(Call, _rewrite)])

    return tirx.transform.prim_func_pass(_func, opt_level=0, name="llmchat_wrap_shuffle_lanes")


def _pipeline_factory(**_kwargs: Any) -> Any:
    import tvm

    pipeline, host, device = tvm.tirx.get_tir_pipeline("s_tir")

    def device_passes() -> Any:
        return tvm.ir.transform.Sequential([wrap_shuffle_lanes(), device()])

    return pipeline, host, device_passes


def register() -> None:
    """Register :data:`PIPELINE` with TVM (idempotent)."""
    from tvm.tirx import compilation_pipeline

    compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline_factory)


def tir_pipeline(target: Any) -> str:
    """The TIR pipeline ``tvm.compile`` should use for ``target``."""
    if uses_subgroups(target):
        register()
        return PIPELINE
    return "default"
