"""dlight-style rule: the decode step's RMSNorm on CUDA runs ``llmchat::rms_norm_row``
(``cuda_kernels.cu``): one block of K/8 threads, each with a 16-byte load of the row and of the
weight, one barrier. It replaces a PrimFunc only where that is TVM's own ``rms_norm`` of a float16
``[1, 1, K]`` row (structurally equal to what TVM's passes make of ``relax.op.nn.rms_norm`` with
the function's epsilon), so the arithmetic is the same: ``half(rsqrt(sum(x^2) / K + eps) * x * w)``
in float32 (the sum added in another order)."""

from __future__ import annotations

from functools import cache
from typing import Any

from app.inference.pipelines.cuda_kernels import KernelRule, launch
from app.inference.pipelines.tir_facts import bare_prim_func, float_constants, static_shape

#: largest row: 8 values per thread, one block of at most 1,024 threads
MAX_K = 8192


@cache
def reference_rms_norm(k: int, eps: float) -> Any:
    """The PrimFunc TVM's passes make of ``rms_norm(x, w)`` for float16 ``x [1, 1, k]``."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 1, k), "float16"))
    w = relax.Var("w", relax.TensorType((k,), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=eps)))
        bb.emit_func_output(out)
    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    mod = tvm.transform.Sequential(passes)(bb.get())
    return next(f for gv, f in mod.functions.items() if gv.name_hint != "main")


def match_rms_norm(func: Any) -> tuple[int, float] | None:
    """(K, eps) when ``func`` is TVM's rms_norm of a float16 ``[1, 1, K]`` row, else None."""
    import tvm_ffi

    if len(func.params) != 3:
        return None
    x, w, out = func.params
    shapes = [static_shape(b) if hasattr(b, "shape") else None for b in (x, w, out)]
    if any(s is None for s in shapes) or any(str(b.dtype) != "float16" for b in (x, w, out)):
        return None
    xs, ws, os_ = shapes
    if len(xs) != 3 or xs[:2] != [1, 1] or xs != os_ or ws != [xs[2]]:
        return None
    k = xs[2]
    if k % 8 or k > MAX_K:
        return None
    for eps in sorted(float_constants(func)):
        if tvm_ffi.structural_equal(bare_prim_func(func), bare_prim_func(reference_rms_norm(k, eps))):
            return k, eps
    return None


class CudaRmsNorm(KernelRule):
    """Replace TVM's decode rms_norm PrimFunc's body by a launch of ``llmchat::rms_norm_row``."""

    def replace(self, func: Any) -> Any | None:
        from tvm import tirx

        found = match_rms_norm(func)
        if found is None:
            return None
        k, eps = found
        x, w, out = func.params
        call = tirx.call_extern(
            "int32", f"llmchat::rms_norm_row<{k}>", x.data, w.data, out.data, tirx.FloatImm("float32", eps)
        )
        threads = (k // 8 + 31) // 32 * 32
        return func.with_body(launch(call, {"blockIdx.x": 1}, {"threadIdx.x": threads}))
