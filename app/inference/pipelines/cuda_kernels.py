"""llmchat's CUDA kernels (``cuda_kernels.cu``) and how TIR functions launch them.

A PrimFunc replaced by :mod:`.cuda_gemv`, :mod:`.cuda_gemm`, :mod:`.cuda_attention` or
:mod:`.cuda_argmax` has a body that only sets the launch dimensions and calls a ``__device__``
function of ``cuda_kernels.cu`` through ``call_extern``; :func:`add_device_helpers` puts that
source in front of the CUDA module TVM generates (the build hook in ``cuda_support`` calls it), so
the kernels are compiled with the module, into its fatbin.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

NAMESPACE = "llmchat::"
SOURCE_PATH = Path(__file__).with_name("cuda_kernels.cu")


@cache
def kernel_source() -> str:
    """The CUDA source of llmchat's device functions."""
    return SOURCE_PATH.read_text()


def add_device_helpers(source: str) -> str:
    """``source`` with llmchat's kernel source in front when it calls one of them."""
    return kernel_source() + "\n" + source if NAMESPACE in source else source


def launch(call: Any, grid: dict[str, Any], block: dict[str, int]) -> Any:
    """A TIR statement that launches ``call`` (an extern call) on ``grid`` x ``block`` threads."""
    import tvm
    from tvm import tirx

    body: Any = tirx.Evaluate(call)
    for tag, extent in [*block.items(), *grid.items()]:
        ext = tirx.IntImm("int32", extent) if isinstance(extent, int) else extent
        var = tirx.Var(tag, ext.dtype if hasattr(ext, "dtype") else "int32")
        iv = tirx.IterVar(tvm.ir.Range(0, ext), var, tirx.IterVar.ThreadIndex, tag)
        body = tirx.AttrStmt(iv, "thread_extent", ext, body)
    return body


#: PrimFunc attribute: the matmul computes a layer's fused q/k/v projection and records its output
#: for the decode attention (``RECORD`` of the matmul kernels; :mod:`.cuda_rope_append`)
RECORD_QKV_ATTR = "llmchat.record_qkv"


def records_qkv(func: Any) -> bool:
    """Whether ``func`` is marked with :data:`RECORD_QKV_ATTR`."""
    return bool(func.attrs is not None and func.attrs.get(RECORD_QKV_ATTR, False))


def record_flag(record: bool) -> str:
    """The extra template argument of a matmul kernel that records its output (none otherwise)."""
    return ", true" if record else ""


def epilogue_mode(out: Any, residual: Any | None) -> int:
    """The kernels' MODE: 0 float32 output, 1 float16 output, 2 float16 output + residual."""
    if residual is not None:
        return 2
    return 0 if str(out.dtype) == "float32" else 1


def matmul_call(
    name: str, x: Any, weight: Any, scale: Any, bias: Any | None, residual: Any | None, out: Any, *extra: Any
) -> Any:
    """``call_extern`` of a matmul kernel: (x, weight, scale, bias, residual, out, *extra); a
    missing bias or residual is passed as x (the kernel's template flags never read it)."""
    from tvm import tirx

    def ptr(buf: Any | None) -> Any:
        return (buf if buf is not None else x).data

    return tirx.call_extern(
        "int32", name, ptr(x), ptr(weight), ptr(scale), ptr(bias), ptr(residual), ptr(out), *extra
    )


class KernelRule:
    """Base of the dlight-style rules that swap a PrimFunc's body for a launch of one of
    llmchat's CUDA kernels: subclasses implement :meth:`replace` (the new PrimFunc or None)."""

    def is_target_available(self, target: Any) -> bool:
        return target.kind.name == "cuda"

    def replace(self, func: Any) -> Any | None:
        raise NotImplementedError

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        new = self.replace(func)
        return None if new is None else s_tir.Schedule(new)


def prim_func_pass(name: str, rewrite: Any, only_unscheduled: bool = False) -> Any:
    """A module pass applying ``rewrite(func) -> PrimFunc | None`` to every PrimFunc (None, or
    the same function, leaves it as it is)."""
    import tvm
    from tvm import tirx

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: Any, _ctx: Any) -> Any:
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if only_unscheduled and func.attrs and func.attrs.get("tirx.is_scheduled"):
                continue
            new = rewrite(func)
            if new is not None and not new.same_as(func):
                updates[gv] = new
        if not updates:
            return mod
        mod = mod.clone()
        for gv, func in updates.items():
            mod.update_func(gv, func)
        return mod

    return _pass
