"""The decode GEMV for CPUs in block formats, with each group's scale and offset outside the loop.

The generic CPU schedule (:mod:`.cpu_schedule`) vectorizes ``sum_k x[k] * dequant(w)[n, k]`` as it is
written: per packed word and row a broadcast, a shift, a mask, a conversion, the offset, the scale
and an FMA. For the formats with one scale ``d`` and one offset ``c`` per 32 values (value =
``q * d + c``: MLC's q4f16_1 with ``c = -7 d``, GGUF's Q4_0 with ``c = -8 d``, Q4_1 with ``c = m``
and Q8_0 with ``c = 0`` and int8 values), factored per group

    out[n] = sum_g d[n, g] * (sum_j q[n, g, j] * x[g, j]) + c[n, g] * (sum_j x[g, j])

the inner loop keeps five instructions per word and row, each group costs two FMAs per row (the
activation's group sums are computed once per call), four rows share every activation load, and
the rows four tasks ahead are prefetched (the weights stream from DRAM: a 2-core box reads them at
~15 GB/s without it). Measured on the 2-core box, SmolLM2-135M decode end to end (same-machine
A/B): factoring 114-123 -> 138-146 tok/s and prefetch another +20 % with MLC's format, prefetch
+7 % on the imported GGUF, whose tied Q8_0 output layer went from 2.2 to 0.9 ms per token.
Results equal up to float32 rounding. The rule takes single-row (decode) GEMVs in these formats
and leaves everything else to the generic schedule.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.tir_facts import root_blocks, static_shape

#: output rows computed together (they share the activation loads)
ROWS = 4
#: fp32 lanes: the eight values of one packed word
LANES = 8
#: rows this many tasks ahead are prefetched into the cache while a task runs (software prefetch:
#: down_proj of SmolLM2-135M, weights streaming from DRAM, 42-45 -> 30 us; no effect on gate_up)
PREFETCH_TASKS = 4
#: the value of ``llmchat.cpu_kernel`` on PrimFuncs this module built
KERNEL_KIND = "block_gemv"
#: format name -> (its per-group parameters after the packed words, the offset as a multiple of d
#: or None when the format stores it: Q4_1's ``q_min``)
FORMATS: dict[str, tuple[tuple[str, ...], float | None]] = {
    "q4f16_1": (("q_scale",), -7.0),
    "ggml_q4_0": (("q_scale",), -8.0),
    "ggml_q4_1": (("q_scale", "q_min"), None),
    "ggml_q8_0": (("q_scale",), 0.0),  # int8 values [out, in] instead of packed words
}
#: formats whose values are int8 bytes, not 4-bit words
BYTE_FORMATS = ("ggml_q8_0",)


def block_gemv_kernel(
    in_features: int,
    out_features: int,
    fmt: str,
    x_dtype: str,
    out_dtype: str,
    epilogue: str,
    scale_dtype: str = "float16",
) -> Any:
    """The GEMV as a PrimFunc ``(x, q_weight, q_scale[, q_min][, bias | residual], out)``.

    ``epilogue``: ``none`` (cast to ``out_dtype``), ``bias`` (add a float16 bias, then cast) or
    ``residual`` (cast, then add a residual of ``out_dtype``)."""
    from tvm.script import tirx as T

    from app.inference.pipelines.cpu_attention import KERNEL_KIND_ATTR

    K, N, G, W = in_features, out_features, in_features // 32, in_features // 8
    per_group, offset = FORMATS[fmt]
    word_stride = 32 if fmt in BYTE_FORMATS else 4  # elements of ``w`` per group
    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, KERNEL_KIND_ATTR: KERNEL_KIND}

    # fmt: off
    @T.macro
    def gemv(x, w, s, mn, extra, out):
        with T.sblock("root"):
            xf = T.sblock_alloc_buffer((K,), "float32")
            xsum = T.sblock_alloc_buffer((G, LANES), "float32")  # a group's sum, per lane
            for k in T.vectorized(K):
                xf[k] = T.Cast("float32", x[0, 0, k])
            for g in T.serial(G):
                for lane in T.vectorized(LANES):
                    xsum[g, lane] = ((xf[g * 32 + lane] + xf[g * 32 + 8 + lane])
                                     + (xf[g * 32 + 16 + lane] + xf[g * 32 + 24 + lane]))
            for task in T.parallel(N // ROWS):
                with T.sblock("rows"):
                    acc = T.sblock_alloc_buffer((ROWS, LANES), "float32")
                    group = T.sblock_alloc_buffer((ROWS, LANES), "float32")
                    for r in T.unroll(ROWS):
                        for lane in T.vectorized(LANES):
                            acc[r, lane] = T.float32(0)
                    for g in T.serial(G):
                        if PREFETCH_TASKS > 0:
                            for r in T.unroll(ROWS):  # the same group's word of a row further on
                                ahead: T.let[T.int32] = T.min(task * ROWS + r + PREFETCH_TASKS * ROWS, N - 1)
                                T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                                              T.address_of(w[ahead, g * word_stride]),
                                                              T.int32(0), T.int32(3), T.int32(1)))
                        for r in T.unroll(ROWS):
                            for lane in T.vectorized(LANES):
                                group[r, lane] = T.float32(0)
                        for word in T.unroll(4):
                            for r in T.unroll(ROWS):
                                for lane in T.vectorized(LANES):
                                    k: T.let[T.int32] = g * 32 + word * 8 + lane
                                    row: T.let[T.int32] = task * ROWS + r
                                    shift: T.let[T.uint32] = T.Cast("uint32", lane * 4)
                                    if fmt in BYTE_FORMATS:
                                        group[r, lane] = group[r, lane] + xf[k] * T.Cast("float32", w[row, k])
                                    else:
                                        nibble: T.let[T.uint32] = T.shift_right(w[row, g * 4 + word], shift)
                                        group[r, lane] = group[r, lane] + xf[k] * T.Cast(
                                            "float32", nibble & T.uint32(15))
                        for r in T.unroll(ROWS):
                            d: T.let[T.float32] = T.Cast("float32", s[task * ROWS + r, g])
                            for lane in T.vectorized(LANES):
                                if offset is None:
                                    acc[r, lane] = acc[r, lane] + d * group[r, lane] + T.Cast(
                                        "float32", mn[task * ROWS + r, g]) * xsum[g, lane]
                                elif offset == 0.0:
                                    acc[r, lane] = acc[r, lane] + d * group[r, lane]
                                else:
                                    acc[r, lane] = acc[r, lane] + d * (group[r, lane]
                                                                       + T.float32(offset) * xsum[g, lane])
                    for r in T.unroll(ROWS):
                        n: T.let[T.int32] = task * ROWS + r
                        v: T.let[T.float32] = (((acc[r, 0] + acc[r, 4]) + (acc[r, 2] + acc[r, 6]))
                                               + ((acc[r, 1] + acc[r, 5]) + (acc[r, 3] + acc[r, 7])))
                        if epilogue == "bias":
                            out[0, 0, n] = T.Cast(out_dtype, v + T.Cast("float32", extra[n]))
                        elif epilogue == "residual":
                            out[0, 0, n] = extra[0, 0, n] + T.Cast(out_dtype, v)
                        else:
                            out[0, 0, n] = T.Cast(out_dtype, v)

    X = T.Buffer((1, 1, K), x_dtype)
    Wq = T.Buffer((N, K), "int8") if fmt in BYTE_FORMATS else T.Buffer((N, W), "uint32")
    S = T.Buffer((N, G), scale_dtype)
    M = T.Buffer((N, G), scale_dtype)  # its own object: two parameters may not share one
    Out = T.Buffer((1, 1, N), out_dtype)
    B = T.Buffer((N,), "float16")
    R = T.Buffer((1, 1, N), out_dtype)

    if len(per_group) == 1:
        if epilogue == "bias":
            @T.prim_func(s_tir=True)
            def f(x: X, w: Wq, s: S, bias: B, out: Out):
                T.func_attr(attrs)
                gemv(x, w, s, s, bias, out)
        elif epilogue == "residual":
            @T.prim_func(s_tir=True)
            def f(x: X, w: Wq, s: S, residual: R, out: Out):
                T.func_attr(attrs)
                gemv(x, w, s, s, residual, out)
        else:
            @T.prim_func(s_tir=True)
            def f(x: X, w: Wq, s: S, out: Out):
                T.func_attr(attrs)
                gemv(x, w, s, s, out, out)
    elif epilogue == "bias":
        @T.prim_func(s_tir=True)
        def f(x: X, w: Wq, s: S, mn: M, bias: B, out: Out):
            T.func_attr(attrs)
            gemv(x, w, s, mn, bias, out)
    elif epilogue == "residual":
        @T.prim_func(s_tir=True)
        def f(x: X, w: Wq, s: S, mn: M, residual: R, out: Out):
            T.func_attr(attrs)
            gemv(x, w, s, mn, residual, out)
    else:
        @T.prim_func(s_tir=True)
        def f(x: X, w: Wq, s: S, mn: M, out: Out):
            T.func_attr(attrs)
            gemv(x, w, s, mn, out, out)
    return f
    # fmt: on


#: the block sequences of the single-row layers ``dequant_matmul_te`` builds, by epilogue: with
#: float32 activations (llmchat's CPU default) a residual is added to the accumulator directly, with
#: float16 ones after the cast; ``dequant_matmul_out`` casts and adds the bias
_BLOCKS = {
    ("dequant_matmul",): "none",
    ("dequant_matmul", "dequant_matmul_out"): "cast",
    ("dequant_matmul", "T_add"): "residual",
    ("dequant_matmul", "dequant_matmul_out", "T_add"): "residual",
}


def replace_block_gemv(func: Any) -> Any | None:
    """:func:`block_gemv_kernel` in place of ``func`` when it is a single-row GEMV of
    ``dequant_matmul_te`` in one of :data:`FORMATS` (activations float16 or float32, parameters in
    the order x, weights[, bias | residual], out); None otherwise."""
    from app.inference.quantization.base import FORMAT_ANNOTATION

    blocks = root_blocks(func)
    form = _BLOCKS.get(tuple(b.name_hint for b in blocks))
    fmt = str(blocks[0].annotations.get(FORMAT_ANNOTATION, "")) if form else ""
    if fmt not in FORMATS:
        return None
    groups_params = len(FORMATS[fmt][0])
    params = list(func.params)
    reads = [r.source for r in blocks[0].reads]
    n_weights = 2 + groups_params  # x, q_weight, per-group params
    if len(reads) != n_weights or len(params) not in (n_weights + 1, n_weights + 2):
        return None
    if not all(p.same_as(r) for p, r in zip(params[:n_weights], reads, strict=True)):
        return None
    x, weight, out = params[0], params[1], params[-1]
    per_group = params[2:n_weights]
    xs, ws, os_ = static_shape(x), static_shape(weight), static_shape(out)
    if None in (xs, ws, os_) or xs[:-1] != [1, 1] or os_[:-1] != [1, 1]:
        return None
    k, n = xs[-1], ws[0]
    x_dtype, out_dtype, scale_dtype = str(x.dtype), str(out.dtype), str(per_group[0].dtype)
    packed = ([n, k], "int8") if fmt in BYTE_FORMATS else ([n, k // 8], "uint32")
    if (
        ws != packed[0]
        or os_[-1] != n
        or k % 32
        or n % ROWS
        or str(weight.dtype) != packed[1]
        or any(static_shape(p) != [n, k // 32] or str(p.dtype) != scale_dtype for p in per_group)
        or scale_dtype not in ("float16", "float32")
        or x_dtype not in ("float16", "float32")
        or out_dtype not in ("float16", "float32")
    ):
        return None
    extra = params[n_weights:-1]
    if form == "residual":
        if len(extra) != 1 or str(extra[0].dtype) != out_dtype or static_shape(extra[0]) != [1, 1, n]:
            return None
        epilogue = "residual"
    elif extra:  # a bias, added before the cast
        if form != "cast" or str(extra[0].dtype) != "float16" or static_shape(extra[0]) != [n]:
            return None
        epilogue = "bias"
    else:
        epilogue = "none"
    kernel = block_gemv_kernel(k, n, fmt, x_dtype, out_dtype, epilogue, scale_dtype)
    if func.attrs is not None and "global_symbol" in func.attrs:
        kernel = kernel.with_attr("global_symbol", func.attrs["global_symbol"])
    return kernel
