"""The compiler pipeline for GPUs (cuda, rocm, vulkan, metal).

TVM's GPU pipeline (legalize, fuse, dlight schedules: MLC's tuned GEMV configurations for CUDA,
ROCm, Vulkan and Metal), plus:

- an exact rewrite of the 4-bit decode ``float(u & 15)`` into float bit tricks (one OR and one
  FADD instead of an integer-to-float conversion, which runs at a fraction of the FMA rate);
- CUDA graphs on CUDA (the static parts of each function are captured and replayed);
- dlight's Matmul rule kept on its SIMT path: TVM 0.27's tensor-core path segfaults on fp16
  matmuls whose static dims all exceed 64;
- ``DecodeGEMV``, a batch-1 dequantizing GEMV rule: 16-byte weight loads per thread (one q4 group
  of 32 values), the activation vector staged once per block as fp32 in padded (bank-conflict
  free) shared memory and read with 16-byte loads, the group scale converted once, warp-shuffle
  reduction. Used on CUDA and WGSL (see ``use_llmchat_gemv``; on WGSL in a layout of
  :mod:`.wgsl_gemv`'s family); rows it cannot tile go to dlight's GEMV.
- on WGSL (webgpu/Vulkan), ``WgslGemm`` (:mod:`.gpu_gemm`) for the prompt's matmuls: 256 threads,
  8x4 or 8x8 fp32 accumulators each, weight and activation tiles in workgroup memory, the weight
  decoded one packed word per thread (dlight's Matmul default there: 64 threads, 4x4 each, one
  word load per 4-bit value); ``LLMCHAT_WGSL_GEMM=tvm`` gives dlight's back;
- on CUDA, llmchat's hand-written kernels (``cuda_kernels.cu``) in place of TVM's for the decode
  GEMVs (with the gate_up GEMV also applying SiLU·mul: ``cuda_silu_gate``), the prompt GEMMs, the
  decode and prompt attention (on sm_90 the decode attention also applies a decoded token's RoPE
  and appends it to the KV cache: ``cuda_rope_append``), the decode RMSNorm and the greedy argmax,
  each chosen by GPU generation;
- on WebGPU/Vulkan, TVM's decode attention (one workgroup per KV head, every key in turn) split
  along the keys over many workgroups with a merge kernel (``wgsl_attention``);
- on WebGPU/Vulkan, the RMSNorm and SiLU-gate kernels folded into the GEMV after them, which
  these rules schedule (``wgsl_fusion``; ``LLMCHAT_WGSL_FUSION=off`` keeps them apart).

Nothing here assumes tensor cores, and every reduction works with 32-wide waves (RDNA, NVIDIA).
On WGSL, cross-thread reductions use subgroup shuffles only for an adapter profile with one fixed
subgroup size (``-sgN``, :mod:`.wgsl_subgroups`); otherwise workgroup memory.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.cuda_argmax import CudaArgmax
from app.inference.pipelines.cuda_attention import (
    prefill_attention_pass,
    prefill_paged_attention_pass,
    split_decode_attention_pass,
)
from app.inference.pipelines.cuda_gemm import CudaQ4Gemm
from app.inference.pipelines.cuda_gemv import CudaQ4Gemv
from app.inference.pipelines.cuda_kernels import prim_func_pass
from app.inference.pipelines.cuda_rms_norm import CudaRmsNorm
from app.inference.pipelines.cuda_rope_append import mark_rope_append_pass, skip_single_token_pass
from app.inference.pipelines.cuda_silu_gate import fuse_silu_gate_pass
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


#: let dlight's Matmul rule use tensor cores (TVM 0.27 can segfault on some fp16 matmuls)
TENSOR_CORE_MATMUL = os.environ.get("LLMCHAT_TENSOR_CORE_MATMUL", "") == "1"


@contextlib.contextmanager
def _simt_matmul_only() -> Iterator[None]:
    """TVM 0.27's dlight tensor-core matmul crashes (segfault in s_tir Tensorize) on fp16 matmuls
    whose static dims all exceed 64; make the Matmul rule take its SIMT path while we compile."""
    import tvm.s_tir.dlight.gpu.matmul as matmul

    if TENSOR_CORE_MATMUL:
        yield
        return
    original = matmul.check_sm_version
    matmul.check_sm_version = lambda _arch: 0
    try:
        yield
    finally:
        matmul.check_sm_version = original


def use_llmchat_gemv(target: Any) -> bool:
    """Whether :class:`DecodeGEMV` goes before dlight's GEMV rule.

    Default: on CUDA, where it was measured (H200, Llama-2-7B shapes, engine end to end: 317.7
    tok/s against 307.8 with dlight's GEMV and 272.5 with TVM's plain pipeline). Elsewhere
    dlight's GEMV keeps MLC's per-vendor configurations until the rule is measured there.
    ``LLMCHAT_GPU_GEMV=llmchat`` or ``=tvm`` overrides.
    """
    choice = os.environ.get("LLMCHAT_GPU_GEMV", "").strip().lower()
    if choice in ("llmchat", "tvm"):
        return choice == "llmchat"
    # also behind the CUDA kernel, for the shapes it declines; WGSL (H200, NVIDIA's Vulkan driver,
    # 7B shape: 6.1 -> 5.3 ms of GPU time per decode step against dlight's GEMV; BENCHMARKS.md)
    return target.kind.name in ("cuda", "webgpu")


#: the GEMV's ``ld.global.nc.L1::no_allocate`` loads and the prompt GEMM's WMMA need Volta (sm_70)
MIN_ARCH_GEMV_GEMM = 70
#: the prompt attention's ``mma.sync.m16n8k16`` with fp16 inputs needs Ampere (sm_80)
MIN_ARCH_PROMPT_ATTENTION = 80
#: thread-block clusters (the decode attention's merge) need Hopper (sm_90)
MIN_ARCH_CLUSTERS = 90
#: GPUs where 16-block (non-portable) clusters were run: the H200 (sm_90); others get 8
WIDE_CLUSTER_ARCHS = (90,)


def cuda_arch(target: Any) -> int | None:
    """The compute capability a CUDA ``target`` is built for (``sm_90`` / ``sm_90a`` -> 90), None
    for other targets or when the target names none."""
    if target.kind.name != "cuda":
        return None
    match = re.fullmatch(r"sm_(\d+)[a-z]?", str(target.attrs.get("arch", "")))
    return int(match.group(1)) if match else None


def _arch_at_least(target: Any, arch: int) -> bool:
    got = cuda_arch(target)
    return got is not None and got >= arch


def use_cuda_kernel_gemv(target: Any) -> bool:
    """Whether q4f16_1 decode GEMVs use llmchat's CUDA kernel (:mod:`.cuda_gemv`): on CUDA from
    sm_70 on, unless ``LLMCHAT_GPU_GEMV`` names another rule (``llmchat`` for
    :class:`DecodeGEMV`, ``tvm``)."""
    choice = os.environ.get("LLMCHAT_GPU_GEMV", "").strip().lower()
    return _arch_at_least(target, MIN_ARCH_GEMV_GEMM) and choice in ("", "cuda-kernel")


def use_cuda_gemm(target: Any) -> bool:
    """Whether prompt-sized q4f16_1 matmuls use llmchat's tensor-core kernel (:mod:`.cuda_gemm`):
    on CUDA from sm_70 on, unless ``LLMCHAT_CUDA_GEMM=tvm``."""
    choice = os.environ.get("LLMCHAT_CUDA_GEMM", "").strip().lower()
    return _arch_at_least(target, MIN_ARCH_GEMV_GEMM) and choice != "tvm"


def use_cuda_attention(target: Any) -> bool:
    """Whether decode and prompt attention use llmchat's CUDA kernels (:mod:`.cuda_attention`):
    on CUDA unless ``LLMCHAT_CUDA_ATTENTION=tvm``; the prompt kernel from sm_80 on."""
    choice = os.environ.get("LLMCHAT_CUDA_ATTENTION", "").strip().lower()
    return target.kind.name == "cuda" and choice != "tvm"


def max_cluster_size(target: Any) -> int:
    """The largest thread-block cluster llmchat's kernels may launch on ``target``: 0 (none)
    before sm_90, 16 where that was run, else 8 (the portable size)."""
    if not _arch_at_least(target, MIN_ARCH_CLUSTERS):
        return 0
    return 16 if cuda_arch(target) in WIDE_CLUSTER_ARCHS else 8


def use_wgsl_attention(target: Any) -> bool:
    """Whether decode attention splits the keys over workgroups on WebGPU/Vulkan
    (:mod:`.wgsl_attention`): unless ``LLMCHAT_WGSL_ATTENTION=tvm``."""
    choice = os.environ.get("LLMCHAT_WGSL_ATTENTION", "").strip().lower()
    return target.kind.name == "webgpu" and choice != "tvm"


def attention_passes(target: Any) -> list[Any]:
    """The passes that put llmchat's attention kernels in place of TVM's on ``target``."""
    if use_wgsl_attention(target):
        from app.inference.pipelines.wgsl_attention import split_decode_attention_pass as wgsl_split

        return [
            wgsl_split(
                max_threads=int(target.attrs["max_num_threads"]),
                shared_bytes=int(target.attrs["max_shared_memory_per_block"]),
            )
        ]
    if not use_cuda_attention(target):
        return []
    passes = [split_decode_attention_pass(max_cluster=max_cluster_size(target))]
    if _arch_at_least(target, MIN_ARCH_PROMPT_ATTENTION):
        passes.append(prefill_attention_pass())
        paged = cuda_paged_prefill()
        if paged != "tvm":
            passes.append(prefill_paged_attention_pass(pipelined=paged == "async"))
    return passes


def cuda_paged_prefill() -> str:
    """How a prompt chunk's attention to the cached keys runs where llmchat's prompt attention
    does (``LLMCHAT_CUDA_PAGED_PREFILL``): ``async`` (default), llmchat's tensor-core kernel
    (:func:`.cuda_attention.prefill_paged_attention`) with its key tiles copied by cp.async behind
    the work on the previous tile; ``sync``, the same kernel with plain loads; ``tvm``, TVM's
    ``batch_prefill_paged_kv`` (for comparisons). H200, Llama-2-7B shape, pp4096 / pp8192 tok/s:
    13,952 / 12,627 (async), 13,640 / 11,925 (sync), 5,866 / 2,665 (tvm)."""
    choice = os.environ.get("LLMCHAT_CUDA_PAGED_PREFILL", "").strip().lower()
    return choice if choice in ("sync", "tvm") else "async"


def fuse_rope_append(target: Any) -> bool:
    """Whether a decoded token's RoPE and KV append move into the decode attention
    (:mod:`.cuda_rope_append`): with llmchat's attention (its cluster kernel, sm_90) and matmul
    kernels, which record the q/k/v projection it reads."""
    return (
        use_cuda_attention(target)
        and max_cluster_size(target) > 0
        and use_cuda_kernel_gemv(target)
        and use_cuda_gemm(target)
    )


def use_wgsl_gemm(target: Any) -> bool:
    """Whether the prompt's matmuls on WGSL use :class:`~.gpu_gemm.WgslGemm` (register-tiled,
    256 threads) instead of dlight's Matmul default (64 threads, 4x4 outputs each): on webgpu
    unless ``LLMCHAT_WGSL_GEMM=tvm``."""
    choice = os.environ.get("LLMCHAT_WGSL_GEMM", "").strip().lower()
    return target.kind.name == "webgpu" and choice != "tvm"


def schedule_rules(target: Any) -> list[Any]:
    """The dlight rules, in order, for ``target``."""
    from tvm.s_tir import dlight as dl

    first = [DecodeGEMV()] if use_llmchat_gemv(target) else []
    if first and target.kind.name == "webgpu":
        from app.inference.pipelines import wgsl_gemv

        first = wgsl_gemv.rules()  # DecodeGEMV() unless LLMCHAT_WGSL_GEMV names variants
    if use_cuda_kernel_gemv(target):
        first = [CudaQ4Gemv(), *first]
    if use_cuda_gemm(target):
        first = [CudaQ4Gemm(), *first]
    if target.kind.name == "cuda":
        first = [CudaArgmax(), CudaRmsNorm(), *first]
    elif target.kind.name == "webgpu":
        from app.inference.pipelines.gpu_argmax import GpuArgmax

        first = [GpuArgmax(), *first]
        if use_wgsl_gemm(target):
            from app.inference.pipelines.gpu_gemm import WgslGemm

            first = [*first, WgslGemm()]
    return [
        *first,
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


def fusion_passes(target: Any) -> list[Any]:
    """On WGSL: prologue kernels (RMSNorm, SiLU gate) folded into the GEMV after them, which
    :func:`schedule_rules` schedules (:mod:`.wgsl_fusion`)."""
    from app.inference.pipelines.wgsl_fusion import fuse_prologues_pass, use_wgsl_fusion

    return [fuse_prologues_pass(schedule_rules(target), target)] if use_wgsl_fusion(target) else []


def fast_decode_pass() -> Any:
    """Module pass: :func:`fast_small_uint_to_float` on every PrimFunc (exact; removes I2F)."""
    return prim_func_pass("llmchat_fast_uint4_decode", fast_small_uint_to_float, only_unscheduled=True)


def uses_cuda_graph(target: Any) -> bool:
    """CUDA graphs are a CUDA runtime feature; other GPU runtimes launch kernels one by one."""
    return target.kind.name == "cuda"


def _backend_passes(target: Any) -> Any:
    """TVM's per-backend pass lists (library dispatch, lowering, finalization) for ``target``."""
    kind = target.kind.name
    if kind == "cuda":
        from tvm.relax.backend.cuda import pipeline
    elif kind == "rocm":
        from tvm.relax.backend.rocm import pipeline
    else:
        from tvm.relax.backend.gpu_generic import pipeline
    return pipeline


def schedule_passes(target: Any) -> list[Any]:
    """The pipeline's passes up to scheduled kernels (before the backend's lowering): what
    :mod:`.kernel_count` counts the launches of."""
    from tvm import relax
    from tvm.s_tir import dlight as dl

    return [
        *_backend_passes(target).library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        *([fuse_silu_gate_pass()] if use_cuda_kernel_gemv(target) else []),
        *([mark_rope_append_pass()] if fuse_rope_append(target) else []),
        fast_decode_pass(),
        *fusion_passes(target),
        *attention_passes(target),
        dl.ApplyDefaultSchedule(*schedule_rules(target)),
        *([skip_single_token_pass()] if fuse_rope_append(target) else []),
    ]


def gpu_pipeline(target: Any, cuda_graph: bool | None = None) -> Any:
    """The relax pipeline for a GPU ``target``, as ``tvm.compile(..., relax_pipeline=...)`` takes it."""
    import tvm

    backend = _backend_passes(target)
    graph = uses_cuda_graph(target) if cuda_graph is None else cuda_graph

    @tvm.transform.module_pass(opt_level=0, name="llmchat_gpu_pipeline")
    def _pipeline(mod: Any, ctx: Any) -> Any:
        config = dict(ctx.config) if ctx.config is not None else {}
        config["relax.backend.use_cuda_graph"] = bool(graph)
        passes = [
            *schedule_passes(target),
            *backend.dataflow_lower_passes(target),
            *backend.finalize_passes(target),
        ]
        with (
            _simt_matmul_only(),
            target,
            tvm.transform.PassContext(
                opt_level=ctx.opt_level,
                config=config,
                required_pass=list(ctx.required_pass),
                disabled_pass=list(ctx.disabled_pass),
            ),
        ):
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
