"""The prompt (prefill) GEMM for CPUs: quantized weights decoded once per tile, register-blocked.

A prefill layer computes ``out[m, n] = sum_k x[m, k] * W[n, k]`` for every prompt row ``m`` of a
chunk, ``W`` stored in a block format (MLC's q4f16_1 / q4f32_1 words, GGUF's Q4_0 / Q4_1 / Q8_0 …).
The generic schedule of :mod:`.cpu_schedule` decodes 8-row tiles of ``W`` once per call but then runs one
dot product per (row, column) pair, with a horizontal sum per output. This kernel is the classic
register-blocked GEMM instead (as in BLIS or OpenBLAS):

* the prompt rows are first copied, transposed, into blocks of ``MV`` rows (``xT[block, k, i]``,
  zero past the last row), so that for each ``k`` a block's rows are one or two vector loads;
* the output columns are split into tiles of ``NT`` over the threads; each task decodes its ``NT``
  weight rows once, with the format's own ``dequant`` expression, into float32 ``wr[j, k]``;
* for each block, ``NR x MV`` float32 accumulators stay in vector registers while the reduction
  runs over an L1-sized slice of ``k`` (:func:`k_slice`): per ``k``, ``NR`` broadcast weights and
  ``MV / lanes`` prompt loads feed ``NR * MV / lanes`` independent FMAs (8 x 32 with AVX-512: 16
  FMAs for 10 loads); partial sums go to a small per-task buffer between slices;
* the epilogue (cast, bias, residual add) is applied as a block is stored, only for real rows.

Measured on the 2-core box (AVX-512), one thread, CPU time, same process: SmolLM2's gate_up
(576 -> 3072, 256 rows) 13.3 ms with the generic schedule, 7.1 ms with this kernel (126 GFLOP/s,
OpenBLAS's float32 sgemm 120-130 on the same shapes); the other layers 1.5-1.9x. That needs the
whole library to be ``noalias`` (:func:`.cpu.MarkNoAlias`): otherwise LLVM stores the accumulators
after every FMA. Results equal the generic path's up to float32 summation order.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.tir_facts import root_blocks, static_shape

#: the value of ``llmchat.cpu_kernel`` on PrimFuncs this module built
KERNEL_KIND = "prefill_gemm"

#: the block sequences of the multi-row layers ``dequant_matmul_te`` builds, by epilogue
_BLOCKS = {
    ("dequantize", "dequant_matmul"): "none",
    ("dequantize", "dequant_matmul", "dequant_matmul_out"): "cast",
    ("dequantize", "dequant_matmul", "T_add"): "residual",
    ("dequantize", "dequant_matmul", "dequant_matmul_out", "T_add"): "residual",
}


def tile_shape(target: Any | None) -> tuple[int, int, int]:
    """(``NR`` weight rows per register block, ``NT`` weight rows per task, ``MV`` prompt rows per
    block) for ``target``: 8 x 32 prompt rows with AVX-512 (16 of the 32 zmm registers hold
    accumulators), 4 x 16 otherwise (8 of the 16 ymm registers)."""
    attrs = [] if target is None else list(getattr(target, "mattr", None) or [])
    mcpu = "" if target is None else str(getattr(target, "mcpu", "") or "")
    has_512 = any("avx512f" in str(a) for a in attrs) or _cpu_has_avx512(mcpu)
    return (8, 32, 32) if has_512 else (4, 16, 16)


def _cpu_has_avx512(mcpu: str) -> bool:
    if not mcpu:
        return False
    try:
        import tvm

        feats = tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
        return "avx512f" in {str(f) for f in feats}
    except Exception:  # an older TVM or an unknown CPU: the portable tile
        return False


def k_slice(k: int, most: int = 256) -> int:
    """The reduction slice run at once: the largest divisor of ``k`` up to ``most`` (a slice of
    the prompt block, ``most`` x 32 floats, stays in L1 while every weight row of the tile meets it)."""
    return next(c for c in range(min(k, most), 0, -1) if k % c == 0)


def gemm_kernel(
    fmt_name: str,
    in_features: int,
    out_features: int,
    param_dtypes: list[str],
    param_shapes: list[list[int]],
    x_dtype: str,
    out_dtype: str,
    epilogue: str,
    extra_dtype: str | None = None,
    nr: int = 8,
    nt: int = 32,
    mv: int = 32,
) -> Any:
    """The prefill GEMM as a PrimFunc ``(x [1, M, K], *weight params[, bias | residual], out [1, M, N])``,
    ``M`` dynamic; ``nr`` x ``mv`` register blocks, ``nt`` weight rows per task (see the module).

    ``epilogue``: ``none`` (the float32 sum cast to ``out_dtype``), ``bias`` (add a bias, then
    cast) or ``residual`` (cast, then add a residual of ``out_dtype``)."""
    from tvm.script import tirx as T

    from app.inference.pipelines.cpu_attention import KERNEL_KIND_ATTR
    from app.inference.quantization import get_format

    fmt = get_format(fmt_name)
    names = list(fmt.param_specs(out_features, in_features))
    K, N, NT, NR, MV = in_features, out_features, nt, nr, mv
    H = MV // 2
    KC = k_slice(K)
    attrs = {"tirx.is_scheduled": True, "tirx.noalias": True, KERNEL_KIND_ATTR: KERNEL_KIND}

    def dequant(ps: list[Any], row: Any, col: Any) -> Any:
        return fmt.dequant(dict(zip(names, ps, strict=True)), row, col)

    # fmt: off
    @T.macro
    def block(xT, wr, lo, hi, accbuf, t, mb, kc, j0):
        # NR output columns (weight rows t * NT + j0 + r) x MV prompt rows (mb * MV + i), over the
        # reduction slice [kc * KC, (kc + 1) * KC), whose operands stay in L1. ``lo`` / ``hi``: the
        # accumulators of the block's first and second half of prompt rows (registers)
        for r in T.unroll(NR):
            for i in T.vectorized(H):
                lo[r, i] = T.if_then_else(kc == 0, T.float32(0), accbuf[j0 + r, i])
                hi[r, i] = T.if_then_else(kc == 0, T.float32(0), accbuf[j0 + r, H + i])
        for kk in T.serial(KC):
            for r in T.unroll(NR):
                for i in T.vectorized(H):
                    lo[r, i] = lo[r, i] + wr[j0 + r, kc * KC + kk] * xT[mb, kc * KC + kk, i]
                    hi[r, i] = hi[r, i] + wr[j0 + r, kc * KC + kk] * xT[mb, kc * KC + kk, H + i]
        for r in T.unroll(NR):
            for i in T.vectorized(H):
                accbuf[j0 + r, i] = lo[r, i]
                accbuf[j0 + r, H + i] = hi[r, i]

    @T.macro
    def store(accbuf, extra, out, t, mb, M):
        for i in T.serial(MV):
            if mb * MV + i < M:
                for j in T.vectorized(NT):
                    n: T.let[T.int32] = t * NT + j
                    if epilogue == "bias":
                        out[0, mb * MV + i, n] = T.Cast(
                            out_dtype, accbuf[j, i] + T.Cast("float32", extra[n]))
                    elif epilogue == "residual":
                        out[0, mb * MV + i, n] = extra[0, mb * MV + i, n] + T.Cast(out_dtype, accbuf[j, i])
                    else:
                        out[0, mb * MV + i, n] = T.Cast(out_dtype, accbuf[j, i])

    @T.macro
    def gemm(x, ps, extra, out):
        M = x.shape[1]
        blocks: T.let[T.int64] = (M + MV - 1) // MV
        with T.sblock("gemm"):
            xT = T.sblock_alloc_buffer((blocks, K, MV), "float32")
            for mb in T.parallel(blocks):
                for k in T.serial(K):
                    for i in T.vectorized(MV):
                        xT[mb, k, i] = T.if_then_else(
                            mb * MV + i < M, T.Cast("float32", x[0, T.min(mb * MV + i, M - 1), k]),
                            T.float32(0))
            for t in T.parallel(N // NT):
                with T.sblock("tile"):
                    wr = T.sblock_alloc_buffer((NT, K), "float32")
                    lo = T.sblock_alloc_buffer((NR, H), "float32", scope="local")
                    hi = T.sblock_alloc_buffer((NR, H), "float32", scope="local")
                    accbuf = T.sblock_alloc_buffer((NT, MV), "float32")
                    for j in T.serial(NT):
                        for kw in T.serial(K // 8):
                            for kk in T.vectorized(8):
                                wr[j, kw * 8 + kk] = dequant(ps, t * NT + j, kw * 8 + kk)
                    for mb in T.serial(blocks):
                        for kc in T.serial(K // KC):
                            for jb in T.serial(NT // NR):
                                block(xT, wr, lo, hi, accbuf, t, mb, kc, jb * NR)
                        store(accbuf, extra, out, t, mb, M)
    # fmt: on

    M = T.int64()
    X = T.Buffer((1, M, K), x_dtype)
    P = [T.Buffer(tuple(s), d) for s, d in zip(param_shapes, param_dtypes, strict=True)]
    Out = T.Buffer((1, M, N), out_dtype)
    E = T.Buffer((N,), extra_dtype or "float32") if epilogue == "bias" else T.Buffer((1, M, N), out_dtype)

    # fmt: off
    if len(P) == 2:
        p0, p1 = P
        if epilogue == "none":
            @T.prim_func(s_tir=True)
            def f(x: X, w0: p0, w1: p1, out: Out):
                T.func_attr(attrs)
                gemm(x, [w0, w1], out, out)
        else:
            @T.prim_func(s_tir=True)
            def f(x: X, w0: p0, w1: p1, extra: E, out: Out):
                T.func_attr(attrs)
                gemm(x, [w0, w1], extra, out)
    else:
        p0, p1, p2 = P
        if epilogue == "none":
            @T.prim_func(s_tir=True)
            def f(x: X, w0: p0, w1: p1, w2: p2, out: Out):
                T.func_attr(attrs)
                gemm(x, [w0, w1, w2], out, out)
        else:
            @T.prim_func(s_tir=True)
            def f(x: X, w0: p0, w1: p1, w2: p2, extra: E, out: Out):
                T.func_attr(attrs)
                gemm(x, [w0, w1, w2], extra, out)
    # fmt: on
    return f


def replace_prefill_gemm(func: Any, target: Any | None = None) -> Any | None:
    """:func:`gemm_kernel` in place of ``func`` when it is a multi-row ``dequant_matmul_te`` layer
    (a ``dequantize`` stage feeding the reduction) of a format with one or two per-group parameters,
    activations ``[1, M, K]`` float16/float32 with ``M`` dynamic; None otherwise."""
    from app.inference.quantization import get_format
    from app.inference.quantization.base import FORMAT_ANNOTATION

    blocks = root_blocks(func)
    form = _BLOCKS.get(tuple(b.name_hint for b in blocks))
    if form is None:
        return None
    fmt_name = str(blocks[0].annotations.get(FORMAT_ANNOTATION, ""))
    try:
        fmt = get_format(fmt_name)
    except Exception:
        return None
    params = list(func.params)
    bufs = params
    w_reads = [r.source for r in blocks[0].reads]
    if len(w_reads) not in (2, 3) or len(bufs) not in (len(w_reads) + 2, len(w_reads) + 3):
        return None
    if not all(b.same_as(r) for b, r in zip(bufs[1 : 1 + len(w_reads)], w_reads, strict=True)):
        return None
    x, out = bufs[0], bufs[-1]
    if len(x.shape) != 3 or len(out.shape) != 3 or static_shape(x) is not None:
        return None  # a static row count is a GEMV or a fixed batch: not a prompt
    k, n = _static(x.shape[2]), _static(out.shape[2])
    if k is None or n is None or k % 8 or _static(x.shape[0]) != 1 or not x.shape[1].same_as(out.shape[1]):
        return None
    specs = fmt.param_specs(n, k)
    names = list(specs)
    if len(names) != len(w_reads):
        return None
    shapes, dtypes = [], []
    for name, buf in zip(names, w_reads, strict=True):
        shape, dtype = specs[name]
        if static_shape(buf) != list(shape) or str(buf.dtype) != dtype:
            return None
        shapes.append(list(shape))
        dtypes.append(dtype)
    x_dtype, out_dtype = str(x.dtype), str(out.dtype)
    if x_dtype not in ("float16", "float32") or out_dtype not in ("float16", "float32"):
        return None
    extra = bufs[1 + len(w_reads) : -1]
    extra_dtype = None
    if form == "residual":
        if (
            len(extra) != 1
            or str(extra[0].dtype) != out_dtype
            or len(extra[0].shape) != 3
            or not extra[0].shape[1].same_as(x.shape[1])
            or _static(extra[0].shape[2]) != n
        ):
            return None
        epilogue = "residual"
    elif extra:  # a bias, added before the cast
        if form != "cast" or len(extra) != 1 or static_shape(extra[0]) != [n]:
            return None
        epilogue, extra_dtype = "bias", str(extra[0].dtype)
    else:
        epilogue = "none"
    nr, nt, mv = tile_shape(target)
    while nt > nr and n % nt:
        nt //= 2
    if n % nt or nt % nr:
        return None
    kernel = gemm_kernel(
        fmt_name, k, n, dtypes, shapes, x_dtype, out_dtype, epilogue, extra_dtype, nr, nt, mv
    )
    if func.attrs is not None and "global_symbol" in func.attrs:
        kernel = kernel.with_attr("global_symbol", func.attrs["global_symbol"])
    return kernel


def _static(expr: Any) -> int | None:
    from app.inference.pipelines.tir_facts import static_int

    return static_int(expr)
