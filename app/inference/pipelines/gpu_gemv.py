"""DecodeGEMV: llmchat's dlight rule for batch-1 (dequantizing) GEMVs on GPUs.

16-byte weight loads per thread (one q4 group of 32 values), the activation vector staged once per
block as fp32 in padded (bank-conflict free) shared memory and read with 16-byte loads, the group
scale converted once, warp-shuffle reduction. Also the exact rewrite of the 4-bit decode
``float(u & 15)`` into float bit tricks (:func:`fast_small_uint_to_float`: one OR and one FADD
instead of an integer-to-float conversion, which runs at a fraction of the FMA rate), which the
pipeline also applies to every kernel. Which targets get the rule: :mod:`.gpu_choices`; rows it
cannot tile go to dlight's GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.tir_facts import static_int

#: Bytes every thread loads from the weight matrix per step (one 128-bit load).
LOAD_BYTES = 16


def _func_name(func: Any) -> str:
    """A PrimFunc's global symbol, for the debug log."""
    try:
        return str(func.attrs["global_symbol"])
    except Exception:  # no attrs / no symbol
        return "a kernel"


@dataclass(frozen=True)
class GemvConfig:
    """Thread layout of one GEMV kernel: rows per block and threads per row."""

    rows_per_block: int
    threads_per_row: int
    unroll_steps: int = 4


def choose_gemv_config(
    out_features: int,
    words_per_row: int,
    words_per_thread: int,
    max_threads_per_row: int = 32,
    min_blocks: int = 512,
    max_block_threads: int = 256,
) -> GemvConfig | None:
    """Threads per row: the largest power of two (≤ ``max_threads_per_row``) whose 16-byte chunks
    tile a row exactly. Rows per block: as many as fit ``max_block_threads`` while the grid keeps
    ``min_blocks`` blocks (several per multiprocessor, so loads from many rows are in flight).
    Returns None when no layout tiles the row without a remainder.
    """
    threads = max_threads_per_row
    while threads > 1 and words_per_row % (threads * words_per_thread) != 0:
        threads //= 2
    if words_per_row % (threads * words_per_thread) != 0:
        return None
    rows = max(1, max_block_threads // threads)
    while rows > 1 and (out_features % rows != 0 or out_features // rows < min_blocks):
        rows //= 2
    return GemvConfig(rows_per_block=rows, threads_per_row=threads)


def _ty(expr: Any) -> str:
    return str(expr.ty)


def fast_small_uint_to_float(func: Any) -> Any:
    """``float32(u & m)`` for a small mask ``m`` via the float bit pattern instead of I2F.

    ``reinterpret<f32>(0x4B000000 | v) == 2**23 + v`` exactly for ``v < 2**23``, so the value is
    one OR and one FADD (full-rate instructions) instead of an integer-to-float conversion, which
    runs at a fraction of the FMA rate and dominates a 4-bit dequantizing GEMV.
    """
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.prim import BitwiseAnd, Cast, FloatImm, IntImm, Sub

    def _biased(expr: Any) -> Any | None:
        """reinterpret(0x4B000000 | v) (== 2**23 + v) when expr is float32(u & small)."""
        if not isinstance(expr, Cast):
            return None
        inner = expr.value
        if (
            _ty(expr) == "float32"
            and isinstance(inner, BitwiseAnd)
            and _ty(inner) == "uint32"
            and isinstance(inner.b, IntImm)
            and 0 <= int(inner.b.value) < (1 << 23)
        ):
            return tirx.reinterpret("float32", tirx.bitwise_or(inner, tirx.const(0x4B000000, "uint32")))
        return None

    def _sub(expr: Any) -> Any:  # float32(u & m) - c  ->  biased - (2**23 + c): one FADD
        biased = _biased(expr.a)
        if biased is not None and isinstance(expr.b, FloatImm):
            return biased - tirx.const(float(1 << 23) + float(expr.b.value), "float32")
        return expr

    def _cast(expr: Any) -> Any:
        biased = _biased(expr)
        return expr if biased is None else biased - tirx.const(float(1 << 23), "float32")

    return tvm_ffi.structural_map(func, [(Sub, _sub), (Cast, _cast)], order="pre")


def _read_index(sch: Any, block: Any, buffer: Any) -> int:
    for i, region in enumerate(sch.get(block).reads):
        if region.source.same_as(buffer):
            return i
    raise ValueError("buffer is not read by the block")


def _drop_roundtrip_casts(func: Any) -> Any:
    """``f32(f16(x))`` -> ``x`` where x is float32: left behind by staging an fp16 vector as fp32."""
    import tvm_ffi
    from tvm.ir.prim import Cast

    def _rewrite(expr: Any) -> Any:
        inner = expr.value
        if (
            _ty(expr) == "float32"
            and isinstance(inner, Cast)
            and _ty(inner) == "float16"
            and _ty(inner.value) == "float32"
        ):
            return inner.value
        return expr

    return tvm_ffi.structural_map(func, [(Cast, _rewrite)])


class DecodeGEMV:
    """dlight rule: batch-1 GEMV (optionally with dequantization inside the reduction).

    Matches a PrimFunc whose main block reduces over the contiguous last axis of a 2-D weight
    (`out[n] = sum_k x[k] * f(W[n, k // p], ...)`), with static sizes and an optional elementwise
    epilogue (cast, residual add). Anything else returns None so the next rule gets it.
    """

    def __init__(
        self,
        load_bytes: int = LOAD_BYTES,
        max_threads_per_row: int = 32,
        min_blocks: int = 512,
        max_block_threads: int = 256,
        unroll_steps: int = 4,
        shared_vector_bytes: int = 40960,
        pad_shared: bool = True,
        stage_vector_lanes: int = 8,
        pad_words: int = 32,
        min_reduction: int = 0,
        min_rows: int = 0,
    ) -> None:
        self.min_reduction = min_reduction  # shorter rows are left to the next rule
        self.min_rows = min_rows  # GEMVs of fewer output rows are left to the next rule
        self.load_bytes = load_bytes
        self.max_threads_per_row = max_threads_per_row
        self.min_blocks = min_blocks
        self.max_block_threads = max_block_threads
        self.unroll_steps = unroll_steps
        self.shared_vector_bytes = shared_vector_bytes
        self.pad_shared = pad_shared
        # lanes of the vector's unpadded staging stores (WGSL allows at most 4) and the word
        # multiple each padded chunk starts at (before its 4 words of padding)
        self.stage_vector_lanes = stage_vector_lanes
        self.pad_words = pad_words

    # dlight's ApplyDefaultSchedule calls rules through this interface
    def is_target_available(self, target: Any) -> bool:
        return "gpu" in target.keys

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._apply(func, target, s_tir)
        except Exception as err:
            from app.debug_log import log

            log.debug(
                "GPU rule %s did not fit %s (TVM's schedule kept): %s: %s",
                type(self).__name__,
                _func_name(func),
                type(err).__name__,
                err,
            )
            return None

    def _apply(self, func: Any, target: Any, s_tir: Any) -> Any:
        from tvm.s_tir.dlight.analysis import is_gemv, normalize, normalize_prim_func
        from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

        sch = s_tir.Schedule(fast_small_uint_to_float(func))
        infos = normalize_prim_func(sch)
        infos = try_inline_contiguous_spatial(sch, infos)
        if infos is None or len(infos) not in (1, 2):
            return None
        epilogue = infos[1] if len(infos) == 2 else None
        if epilogue is not None and not epilogue.is_injective():
            return None
        info = infos[0]
        if len(info.iters) not in (2, 3):
            return None
        vectors = is_gemv(sch, info)
        if not vectors or len(vectors) != 1:
            return None
        block = info.block_rv
        if normalize(sch, info) is not True:  # only the inner-reduction form
            return None
        loops = sch.get_loops(block)
        if len(loops) != 4:
            return None
        extents = [static_int(sch.get(lp).extent) for lp in loops]
        if any(e is None for e in extents):
            return None
        batch, spatial, red_outer, red_inner = extents
        red = red_outer * red_inner
        if batch != 1 or red < self.min_reduction or spatial < self.min_rows:
            return None
        weight_index, weight = self._weight_buffer(sch, block, vectors[0])
        if weight is None:
            return None
        words_per_row = static_int(weight.shape[-1])
        if not words_per_row or red % words_per_row != 0:
            return None
        values_per_word = red // words_per_row
        word_bytes = weight.dtype.bits // 8 if hasattr(weight.dtype, "bits") else 4
        words_per_thread = max(1, self.load_bytes // word_bytes)
        block_threads = min(self.max_block_threads, int(target.attrs.get("max_num_threads", 1024)))
        cfg = None
        while cfg is None and words_per_thread >= 1:
            cfg = choose_gemv_config(
                spatial,
                words_per_row,
                words_per_thread,
                self.max_threads_per_row,
                self.min_blocks,
                block_threads,
            )
            if cfg is None:
                words_per_thread //= 2
        if cfg is None or cfg.threads_per_row < 8 or cfg.threads_per_row * cfg.rows_per_block < 128:
            # short rows, or so few rows per block that staging the vector would cost more than
            # the weights it serves: dlight's GEMV handles these better
            return None
        steps = words_per_row // (cfg.threads_per_row * words_per_thread)
        unroll = min(self.unroll_steps, steps)
        cfg = GemvConfig(cfg.rows_per_block, cfg.threads_per_row, unroll)
        # the activation vector is staged in shared memory as float32 (converted once per block)
        accumulates_f32 = str(sch.get(block).writes[0].source.dtype) == "float32"
        stage_f32 = accumulates_f32 and str(vectors[0].dtype) == "float16"
        element_bytes = 4 if stage_f32 else vectors[0].dtype.bits // 8
        vector_bytes = red * element_bytes
        # what staging takes in workgroup memory: padded chunks (see _schedule) are longer
        chunk = values_per_word * words_per_thread
        staged_bytes = vector_bytes
        if self.pad_shared and red % chunk == 0:
            stride = -(-max(chunk - 4, 0) // self.pad_words) * self.pad_words + 4
            staged_bytes = red // chunk * max(stride, chunk) * element_bytes
        max_shared = int(target.attrs.get("max_shared_memory_per_block", 49152))
        use_shared = vector_bytes <= self.shared_vector_bytes and staged_bytes <= max_shared
        if stage_f32 and not use_shared:
            return None  # per-element fp16->fp32 conversions would bound it: dlight's GEMV is faster
        scale_buf = self._scale_buffer(sch, block, vectors[0], weight_index, red)
        self._schedule(
            sch,
            block,
            epilogue,
            cfg,
            values_per_word * words_per_thread,
            words_per_thread,
            weight_index,
            use_shared,
            stage_f32 and use_shared,
            self.pad_shared,
            scale_buf,
            self.stage_vector_lanes,
            self.pad_words,
        )
        if stage_f32 and use_shared:
            return s_tir.Schedule(_drop_roundtrip_casts(sch.mod["main"]))
        return sch

    @staticmethod
    def _scale_buffer(sch: Any, block: Any, vector: Any, weight_index: int, red: int) -> Any | None:
        """The float16 [N, K/32] buffer the reduction reads (the group scales), if any."""
        for i, region in enumerate(sch.get(block).reads):
            buf = region.source
            if i == weight_index or buf.same_as(vector) or len(buf.shape) != 2:
                continue
            if str(buf.dtype) == "float16" and static_int(buf.shape[-1]) == red // 32:
                return buf
        return None

    @staticmethod
    def _weight_buffer(sch: Any, block: Any, vector: Any) -> tuple[int, Any]:
        """The largest 2-D buffer the reduction reads (not the activation vector)."""
        best, best_size, best_index = None, -1, -1
        for i, region in enumerate(sch.get(block).reads):
            buf = region.source
            if buf.same_as(vector) or len(buf.shape) != 2:
                continue
            size = 1
            for dim in buf.shape:
                value = static_int(dim)
                if value is None:
                    return -1, None
                size *= value
            if size > best_size:
                best, best_size, best_index = buf, size, i
        return best_index, best

    @staticmethod
    def _schedule(
        sch: Any,
        block: Any,
        epilogue: Any,
        cfg: GemvConfig,
        values_per_thread: int,
        words_per_thread: int,
        weight_index: int,
        use_shared: bool,
        stage_f32: bool,
        pad_shared: bool = True,
        scale_buf: Any = None,
        stage_vector_lanes: int = 8,
        pad_words: int = 32,
    ) -> None:
        rows, threads = cfg.rows_per_block, cfg.threads_per_row
        batch, spatial, red, red_inner = sch.get_loops(block)
        spatial = sch.fuse(batch, spatial)
        red = sch.fuse(red, red_inner)
        bx, ty = sch.split(spatial, factors=[None, rows], preserve_unit_iters=True)
        step, tx, inner = sch.split(red, factors=[None, threads, values_per_thread], preserve_unit_iters=True)
        sch.reorder(bx, ty, tx, step, inner)
        # every thread keeps its partial sum in a register: rfactor over the thread axis
        partial = sch.rfactor(tx, 0)
        # partial: loops bx, ty, tx, step, inner
        bx, ty, tx, step, inner = sch.get_loops(partial)
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        # 16-byte loads of the packed weights into registers, one chunk per step
        wload = sch.cache_read(partial, read_buffer_index=weight_index, storage_scope="local")
        sch.compute_at(wload, step, preserve_unit_loops=True)
        wloops = sch.get_loops(wload)[4:]
        fused = sch.fuse(*wloops) if len(wloops) > 1 else wloops[0]
        _, vec = sch.split(fused, factors=[None, words_per_thread], preserve_unit_iters=True)
        sch.vectorize(vec)
        if use_shared:
            vload = sch.cache_read(partial, read_buffer_index=0, storage_scope="shared")
            if stage_f32:
                sch.unsafe_set_dtype(vload, 0, "float32")
            sch.compute_at(vload, tx, preserve_unit_loops=True)
            vloop = sch.get_loops(vload)[-1]
            total = static_int(sch.get(vloop).extent) or 0
            padded = pad_shared and total % values_per_thread == 0
            vec_len = 4 if padded else stage_vector_lanes
            while vec_len > 1 and total % (rows * threads * vec_len) != 0:
                vec_len //= 2
            _, vy, vx, vv = sch.split(vloop, factors=[None, rows, threads, vec_len], preserve_unit_iters=True)
            sch.bind(vy, "threadIdx.y")
            sch.bind(vx, "threadIdx.x")
            sch.vectorize(vv)
            if padded:
                # each thread reads its own contiguous chunk: pad every chunk by 4 words so that
                # the 16-byte reads of 8 threads (one shared-memory phase) hit different banks
                ndim = len(sch.get(vload).writes[0].source.shape)
                chunk = values_per_thread
                sch.transform_layout(
                    vload, ("write", 0), lambda *idx: (*idx[:-1], idx[-1] // chunk, idx[-1] % chunk)
                )
                sch.storage_align(vload, 0, axis=ndim - 1, factor=pad_words, offset=4)
            if stage_f32:
                # per step: the thread's chunk of the vector into registers (16-byte shared loads)
                shared_buf = sch.get(vload).writes[0].source
                xi = _read_index(sch, partial, shared_buf)
                xload = sch.cache_read(partial, read_buffer_index=xi, storage_scope="local")
                sch.compute_at(xload, step, preserve_unit_loops=True)
                xloops = sch.get_loops(xload)[4:]
                xf = sch.fuse(*xloops) if len(xloops) > 1 else xloops[0]
                xo, xv = sch.split(xf, factors=[None, 4], preserve_unit_iters=True)
                sch.vectorize(xv)
                sch.unroll(xo)
        if stage_f32 and scale_buf is not None and values_per_thread == 32:
            # the group's scale once per step, converted to float32 once
            sload = sch.cache_read(
                partial, read_buffer_index=_read_index(sch, partial, scale_buf), storage_scope="local"
            )
            sch.compute_at(sload, step, preserve_unit_loops=True)
            sch.unsafe_set_dtype(sload, 0, "float32")
        sch.unroll(inner)  # constant indices into the register copy of the weights
        sch.decompose_reduction(partial, step)
        if cfg.unroll_steps > 1:  # several 16-byte loads in flight per thread
            _, step_inner = sch.split(step, factors=[None, cfg.unroll_steps], preserve_unit_iters=True)
            sch.unroll(step_inner)
        sch.set_scope(partial, 0, "local")
        # cross-thread sum of the partials (warp shuffle), one output per row
        sch.reverse_compute_at(block, bx, preserve_unit_loops=True)
        red_loop, *sp_loops = sch.get_loops(block)[1:]  # the rfactor axis comes first
        sp = sch.fuse(*sp_loops) if len(sp_loops) > 1 else sp_loops[0]
        sch.reorder(sp, red_loop)  # cross-thread reduction wants its loop innermost
        sch.bind(red_loop, "threadIdx.x")
        sch.bind(sp, "threadIdx.y")
        if epilogue is not None:
            sch.reverse_compute_at(epilogue.block_rv, bx, preserve_unit_loops=True)
            eloops = sch.get_loops(epilogue.block_rv)[1:]
            esp = sch.fuse(*eloops) if len(eloops) > 1 else eloops[0]
            sch.bind(esp, "threadIdx.y")
            sch.set_scope(block, 0, "local")
