"""dlight-style rule: the prompt's matmuls on WGSL (WebGPU/Vulkan) as a register-tiled GEMM.

dlight's ``Matmul`` rule gives every target but CUDA, ROCm and Adreno its default configuration:
64 threads, 4x4 outputs each (32x32 tiles), a reduction step of 8, and — for a quantized weight —
every thread decoding single weight values, each with its own load of the packed word and of the
group scale. A 512-token prefill then does 16 FMAs per value loaded from global memory and meets
two barriers every 128 FMAs per thread.

:class:`WgslGemm` instead tiles ``C[tokens, features] = x[tokens, K] @ W[features, K].T`` as

- 256 threads (16 along the features, 16 along the tokens), each holding ``mf x mt`` fp32
  accumulators (8x8 by default: a 128x128 tile), smaller tiles where the features are few;
- per step of ``BK`` values of K, the dequantized weight tile and the activation tile (as fp32)
  staged in workgroup memory, rows padded by one word (conflict-free reads and writes);
- the weight decoded word by word: each thread loads one packed word (and its group scale) once
  and writes its 8 values, instead of 8 loads of the same word;
- the thread's column of the weight tile and row of the activation tile read from workgroup
  memory into registers once per k, then ``mf * mt`` FMAs from registers;
- the thread's features strided by 16 (neighbouring threads write neighbouring outputs, and read
  neighbouring words of the weight tile).

Matches one reduction block ``C[.., t, f] += A * B`` over a static K whose one spatial side is
the symbolic token count and the other a static feature count (the prefill ``dequant_matmul``
with its ``dequantize`` stage, and plain ``x @ W.T`` of unquantized weights); anything else
returns None so dlight's rules get it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.tir_facts import static_int

#: threads along the features (threadIdx.x) and along the tokens (threadIdx.y)
THREADS_F = 16
THREADS_T = 16
#: rows a prompt chunk is assumed to have when choosing a tile (the grid's size)
ASSUMED_ROWS = 512
#: fewest workgroups a tile should leave for an assumed chunk (2 per SM of a 132-SM GPU)
MIN_WORKGROUPS = 256


@dataclass(frozen=True)
class GemmConfig:
    """Outputs per thread along features (``mf``) and tokens (``mt``), and the K step."""

    mf: int
    mt: int
    bk: int

    @property
    def tile_f(self) -> int:
        return THREADS_F * self.mf

    @property
    def tile_t(self) -> int:
        return THREADS_T * self.mt

    def shared_bytes(self) -> int:
        """Workgroup memory of the two fp32 tiles, rows padded by one word."""
        return (self.tile_f + self.tile_t) * (self.bk + 1) * 4


#: tiles from the largest down; the first that leaves enough workgroups (and fits) is used
CANDIDATES = (GemmConfig(8, 8, 16), GemmConfig(8, 4, 16), GemmConfig(4, 4, 32), GemmConfig(4, 2, 32))


def choose_gemm_config(
    features: int, k: int, shared_bytes: int, rows: int = ASSUMED_ROWS, min_workgroups: int = MIN_WORKGROUPS
) -> GemmConfig | None:
    """The largest candidate tile whose grid for ``rows`` x ``features`` has ``min_workgroups``
    workgroups and whose tiles fit ``shared_bytes``; the smallest that fits otherwise."""
    fitting = [c for c in CANDIDATES if c.shared_bytes() <= shared_bytes and c.bk <= max(k, 8)]
    if not fitting:
        return None
    for cfg in fitting:
        if -(-features // cfg.tile_f) * -(-rows // cfg.tile_t) >= min_workgroups:
            return cfg
    return fitting[-1]


def _ty(expr: Any) -> str:
    return str(expr.ty)


def _drop_roundtrip_casts(func: Any) -> Any:
    """``f32(f16(x))`` -> ``x`` for float32 x (left by staging fp16 activations as fp32)."""
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


class WgslGemm:
    """dlight rule: the prompt's (dequantizing) matmuls as a register-tiled GEMM for WGSL."""

    def __init__(self, config: GemmConfig | None = None, min_workgroups: int = MIN_WORKGROUPS) -> None:
        self.config = config
        self.min_workgroups = min_workgroups

    def is_target_available(self, target: Any) -> bool:
        return "gpu" in target.keys

    def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
        from tvm import s_tir, tirx

        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._apply(func, target, s_tir)
        except Exception:
            return None

    def _apply(self, func: Any, target: Any, s_tir: Any) -> Any:
        from tvm.s_tir.dlight.analysis import get_root_block
        from tvm.s_tir.dlight.gpu.matmul import (
            auto_inline_consumer_chain,
            auto_inline_producers,
            get_index_map,
            get_reduction_blocks,
        )

        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        reduction_blocks = get_reduction_blocks(sch, blocks)
        if reduction_blocks is None or len(reduction_blocks) != 1:
            return None
        main = reduction_blocks[0]
        stmt = sch.get(main)
        if len(stmt.reads) != 2 or str(stmt.writes[0].source.dtype) not in ("float32", "float16"):
            return None
        if get_index_map(stmt) is None:
            return None
        # C[S, I, J] += A[S, I, K] * B[S, J, K]
        reindex_a = sch.reindex(main, ("read", 0))
        reindex_b = sch.reindex(main, ("read", 1))
        reindex_c = sch.reindex(main, ("write", 0))
        matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main))
        sch.transform_layout(reindex_a, ("write", 0), a_map)
        sch.transform_layout(reindex_b, ("write", 0), b_map)
        sch.transform_layout(reindex_c, ("read", 0), c_map)
        sch.transform_block_layout(main, matmul_map)
        ext = [sch.get(lp).extent for lp in sch.get_loops(main)]
        if len(ext) != 4 or static_int(ext[0]) != 1:
            return None
        k = static_int(ext[3])
        i_static, j_static = static_int(ext[1]), static_int(ext[2])
        if k is None or (i_static is None) == (j_static is None):
            return None  # one side must be the symbolic token count, the other static features
        features = i_static if i_static is not None else j_static
        feature_side = 1 if i_static is not None else 2  # index into (batch, i, j, k)
        if features < THREADS_F:
            return None
        cfg = self.config or choose_gemm_config(
            features,
            k,
            int(target.attrs.get("max_shared_memory_per_block", 16384)),
            min_workgroups=self.min_workgroups,
        )
        if cfg is None or cfg.shared_bytes() > int(target.attrs.get("max_shared_memory_per_block", 16384)):
            return None
        if int(target.attrs.get("max_num_threads", 256)) < THREADS_F * THREADS_T:
            return None
        # pad the features to the feature tile, the tokens to the token tile, K to the K step
        pads = [1, 0, 0, cfg.bk]
        pads[feature_side] = cfg.tile_f
        pads[3 - feature_side] = cfg.tile_t
        sch.pad_einsum(main, pads)
        # the block's features as (tile, f // 16 within it, f % 16): a thread's features are
        # strided by THREADS_F (neighbouring threads, neighbouring words of the tiles), and its
        # accumulators index (f // 16, f % 16 == threadIdx.x): compact mf x mt registers
        tf_, nt = cfg.tile_f, THREADS_F
        if feature_side == 1:
            sch.transform_layout(main, ("write", 0), lambda b, f, t: (b, f // tf_, f % tf_ // nt, f % nt, t))
        else:
            sch.transform_layout(main, ("write", 0), lambda b, t, f: (b, t, f // tf_, f % tf_ // nt, f % nt))
        if feature_side == 1:
            sch.transform_block_layout(main, lambda b, f, t, k: (b, f // tf_, f % tf_ // nt, f % nt, t, k))
        else:
            sch.transform_block_layout(main, lambda b, t, f, k: (b, f // tf_, f % tf_ // nt, f % nt, t, k))
        batch, bf, vf, tx, t_loop, kl = sch.get_loops(main)
        a_is_weight = feature_side == 1  # A (read 0) is indexed by I
        bt, ty, vt = sch.split(t_loop, [None, THREADS_T, cfg.mt], preserve_unit_iters=True)
        ko, ki = sch.split(kl, [None, cfg.bk], preserve_unit_iters=True)
        sch.reorder(bt, bf, ty, tx, ko, ki, vf, vt)
        bt = sch.fuse(batch, bt)
        sch.bind(bf, "blockIdx.x")
        sch.bind(bt, "blockIdx.y")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        acc = sch.cache_write(main, 0, "local")
        sch.reverse_compute_at(acc, tx, preserve_unit_loops=True)

        w_index, x_index = (0, 1) if a_is_weight else (1, 0)
        w_shared = sch.cache_read(main, w_index, "shared")
        x_shared = sch.cache_read(main, x_index, "shared")
        for blk in (w_shared, x_shared):
            sch.compute_at(blk, ko, preserve_unit_loops=True)
        # registers: the thread's activation row at one k, then one weight value per feature
        w_reg = sch.cache_read(main, _read_index(sch, main, sch.get(w_shared).writes[0].source), "local")
        x_reg = sch.cache_read(main, _read_index(sch, main, sch.get(x_shared).writes[0].source), "local")
        sch.compute_at(x_reg, ki, preserve_unit_loops=True)
        sch.compute_at(w_reg, vf, preserve_unit_loops=True)

        x_dtype = str(sch.get(x_shared).writes[0].source.dtype)
        w_dtype = str(sch.get(w_shared).writes[0].source.dtype)
        stage_f32 = str(sch.get(main).writes[0].source.dtype) == "float32"
        self._fetch_activations(sch, x_shared, cfg)
        self._fetch_weight(sch, w_shared, cfg)
        auto_inline_producers(sch, w_shared)
        auto_inline_producers(sch, x_shared)
        if stage_f32:
            for blk, dt in ((x_shared, x_dtype), (w_shared, w_dtype), (x_reg, x_dtype), (w_reg, w_dtype)):
                if dt == "float16":
                    sch.unsafe_set_dtype(blk, 0, "float32")
        self._word_registers(sch, w_shared)
        for blk in (w_shared, x_shared):
            sch.storage_align(blk, 0, axis=-2, factor=cfg.bk, offset=1)
        auto_inline_consumer_chain(sch, acc)
        init = sch.decompose_reduction(main, ko)
        sch.unroll(ki)
        sch.unroll(vt)
        sch.unroll(vf)
        for blk in (acc, x_reg, w_reg):
            for lp in sch.get_loops(blk)[len(sch.get_loops(blk)) - 3 :]:
                sch.unroll(lp)
        for lp in sch.get_loops(init)[4:]:
            sch.unroll(lp)
        func = sch.mod["main"]
        if stage_f32:
            func = _drop_roundtrip_casts(func)
        out = s_tir.Schedule(func.with_attr("llmchat_kernel", "wgsl_gemm"))
        return out

    @staticmethod
    def _fetch_activations(sch: Any, block: Any, cfg: GemmConfig) -> None:
        """tile_t x bk activations: consecutive threads along K (contiguous loads)."""
        loops = sch.get_loops(block)[-3:]  # (1, tile_t, bk) under ko
        fused = sch.fuse(*loops)
        _, ty, tx = sch.split(fused, [None, THREADS_T, THREADS_F], preserve_unit_iters=True)
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")

    @staticmethod
    def _fetch_weight(sch: Any, block: Any, cfg: GemmConfig) -> None:
        """tile_f x bk weight values: each thread one run of 8 along K (one packed q4 word)."""
        _, f, k = sch.get_loops(block)[-3:]
        run = 8 if cfg.bk % 8 == 0 else 1
        kw, inner = sch.split(k, [None, run], preserve_unit_iters=True)
        fused = sch.fuse(f, kw)
        _, ty, tx = sch.split(fused, [None, THREADS_T, THREADS_F], preserve_unit_iters=True)
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.unroll(inner)

    @staticmethod
    def _word_registers(sch: Any, block: Any) -> None:
        """The packed words and scales the weight fetch reads, once per run of 8 (registers)."""
        inner_parent = sch.get_loops(block)[-2]
        stmt = sch.get(block)
        bufs = [r.source for r in stmt.reads]
        for buf in bufs:
            if len(buf.shape) != 2:
                continue
            try:
                idx = _read_index(sch, block, buf)
                cached = sch.cache_read(block, idx, "local")
                sch.compute_at(cached, inner_parent, preserve_unit_loops=True)
            except Exception:  # a region the run does not cover in one element: read as is
                continue


def _read_index(sch: Any, block: Any, buffer: Any) -> int:
    for i, region in enumerate(sch.get(block).reads):
        if region.source.same_as(buffer):
            return i
    raise ValueError("buffer is not read by the block")
