"""Static facts about a PrimFunc that the kernel rules of every target ask for: constant
dimensions, static buffer shapes, the blocks under the root block."""

from __future__ import annotations

from typing import Any


def static_int(expr: Any) -> int | None:
    """``expr`` as an int when it is a constant (a Python int or an ``IntImm``), else None."""
    from tvm import tirx

    if isinstance(expr, int):
        return expr
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def static_shape(buf: Any) -> list[int] | None:
    """``buf``'s shape as ints, None when a dimension is symbolic."""
    dims = [static_int(d) for d in buf.shape]
    return None if any(d is None for d in dims) else dims


def root_blocks(func: Any) -> list[Any]:
    """The blocks under the root block of ``func``, in order (empty when it is not a plain
    sequence of blocks)."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        return [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # no root block, or an unusual structure: not ours
        return []


def bare_prim_func(func: Any) -> Any:
    """``func``'s parameters and body without its attributes (for structural comparison with a
    reference built by TVM's own passes)."""
    from tvm import tirx

    return tirx.PrimFunc(func.params, func.body)


def float_constants(func: Any) -> set[float]:
    """The values of the float constants in ``func``'s body."""
    import tvm_ffi
    from tvm.ir.prim import FloatImm

    found: set[float] = set()
    tvm_ffi.structural_walk(func.body, [(FloatImm, lambda node: found.add(float(node.value)))])
    return found


def tir_call(value: Any) -> tuple[Any, list[Any]] | None:
    """(callee, arguments) when the Relax expression ``value`` is a ``call_tir``, else None."""
    import tvm
    from tvm import relax

    if (
        isinstance(value, relax.Call)
        and value.op.same_as(tvm.ir.Op.get("relax.call_tir"))
        and len(value.args) == 2
    ):
        return value.args[0], list(value.args[1].fields)
    return None


def argmax_buffers(func: Any) -> tuple[Any, Any, int] | None:
    """(logits, output, vocab) when ``func`` is the exported argmax (``device_ops.argmax_te``,
    marked with its annotation) over ``[1, 1, V]`` float32 into int32: what the CUDA and the
    WGSL argmax rules replace."""
    from app.inference.compile.device_ops import OP_ANNOTATION

    blocks = root_blocks(func)
    if len(blocks) != 1 or str(blocks[0].annotations.get(OP_ANNOTATION, "")) != "argmax":
        return None
    if len(func.params) != 2:
        return None
    logits, out = func.params
    shape = static_shape(logits)
    if (
        str(logits.dtype) != "float32"
        or shape is None
        or len(shape) != 3
        or shape[:2] != [1, 1]
        or str(out.dtype) != "int32"
    ):
        return None
    return logits, out, shape[2]


def rewrite_dataflow_blocks(mod: Any, rewrite_block: Any) -> Any:
    """``mod`` with every Relax dataflow block passed through ``rewrite_block(block, builder,
    fused)`` (a new block, or None to keep it); ``fused`` maps the replaced pair of kernel names to
    the GlobalVar of the fused kernel (None where it could not be made). Kernels nothing calls any
    more leave the module. The driver of llmchat's Relax-level fusions (CUDA's SiLU gate, WGSL's
    GEMV prologues)."""
    import tvm
    from tvm import relax

    builder = relax.BlockBuilder(mod)
    fused: dict[tuple[str, str], Any] = {}
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        blocks = [
            (rewrite_block(b, builder, fused) if isinstance(b, relax.DataflowBlock) else None, b)
            for b in func.body.blocks
        ]
        if all(new is None for new, _ in blocks):
            continue
        body = relax.SeqExpr([new if new is not None else old for new, old in blocks], func.body.body)
        builder.update_func(
            gv, relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
        )
    if not any(v is not None for v in fused.values()):
        return mod
    out = builder.get()
    called = {
        gv.name_hint
        for f in out.functions.values()
        if isinstance(f, relax.Function)
        for gv in relax.analysis.all_global_vars(f)
    }
    unused = {name for pair in fused for name in pair} - called
    kept = {gv: f for gv, f in out.functions.items() if gv.name_hint not in unused}
    return tvm.IRModule(kept, attrs=out.attrs, global_infos=out.global_infos)


class WebGPUKernelRule:
    """A dlight-style rule for WebGPU targets that swaps a PrimFunc it recognises for llmchat's
    own scheduled kernel (:meth:`kernel`: the new PrimFunc, or None to leave it alone); the new one
    keeps the old one's symbol and target."""

    def is_target_available(self, target: Any) -> bool:
        return target.kind.name == "webgpu"

    def kernel(self, func: Any, max_shared: int = 1 << 30) -> Any | None:
        """The new PrimFunc for ``func`` or None; ``max_shared``: the target's workgroup memory."""
        raise NotImplementedError

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        limit = target.attrs.get("max_shared_memory_per_block")
        new = self.kernel(func, int(limit) if limit is not None else 1 << 30)
        if new is None:
            return None
        if func.attrs is not None:
            for key in ("global_symbol", "target"):
                if key in func.attrs:
                    new = new.with_attr(key, func.attrs[key])
        return s_tir.Schedule(new)
