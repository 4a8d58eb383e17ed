"""Prefill's quantized matmuls on tensor cores: ``llmchat::q4f16_gemm`` (``cuda_kernels.cu``).

dlight rule :class:`CudaQ4Gemm` takes the multi-row PrimFunc ``dequant_matmul_te`` builds for a
prompt (a ``dequantize`` stage annotated ``q4f16_1``, the fp32 reduction over it, and the same
epilogues as decode: fp32 output, fp16 cast with optional bias, fp16 residual add) and replaces
its body by a launch over (N / cols) x ceil(M / rows) blocks, M the prompt length (a shape
variable): rows 128 and cols 128 (256 threads) for layers with at least :data:`WIDE_N` outputs,
else rows 64 and cols 64 (128 threads). TVM 0.27's own tensor-core matmul schedule segfaults on
these shapes, which is why prefill ran on FP32 cores before.

From sm_80, a wide layer (:func:`takes_mma`) whose prompt gives at least :data:`MMA_MIN_BLOCKS`
blocks takes ``llmchat::q4f16_gemm_mma`` instead (section 7 of ``cuda_kernels.cu``: ``mma.sync``
with ``ldmatrix``, a 4-stage ``cp.async`` ring, weights decoded in registers; 128 x 128 tiles, 128
threads): the PrimFunc's host code picks the kernel by the prompt's length (:func:`mma_min_rows`).
Both give the same bits.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cuda_gemv import Q4MatmulMatch, match_q4_operands
from app.inference.pipelines.cuda_kernels import (
    KernelRule,
    epilogue_mode,
    launch,
    matmul_call,
    record_flag,
    records_qkv,
)
from app.inference.pipelines.tir_facts import root_blocks, static_int, static_shape
from app.inference.quantization.base import DEQUANTIZE_STAGE, FORMAT_ANNOTATION

KERNEL = "llmchat::q4f16_gemm"
MMA_KERNEL = "llmchat::q4f16_gemm_mma"
TILE_N = 64
#: from this many output features on a block takes 128 prompt rows (each decoded weight serves
#: twice as many tokens); below it 64, so that narrow layers still give every multiprocessor work
#: (H200, 512-token prompt: 4096 outputs 90 us with 128 rows vs 170 us with 64; 896 outputs 68 vs
#: 56 us)
WIDE_N = 3072
#: warps along the outputs of a 128-row tile (the kernel's WN: 32 outputs each, so 128 outputs and
#: 256 threads a block; 2 warps, 64 outputs, elsewhere). H200, benchmarks/kernels/gemm_check.cu, us
#: per matmul, 2 warps -> 4 (benchmarks/results/h200-2026-12-03-s17): Llama-3-8B 2,048-token chunk
#: qkv 584.7 -> 539.4, o 392.7 -> 361.6, gate_up 2,557.7 -> 2,466.3, down 1,072.8 -> 986.7;
#: Llama-2-7B at 512 tokens 295.4 -> 271.8, 86.9 -> 77.9, 557.8 -> 532.6, 216.5 -> 197.3; with
#: 64-row tiles slower (Qwen2.5-3B qkv 42.6 -> 49.3), so those keep 2. Outputs bit-identical.
WIDE_WARPS = 4
#: the mma.sync kernel's tile (rows and outputs) and threads
MMA_TILE = 128
MMA_THREADS = 128
#: the fewest blocks a prompt must give the mma.sync kernel: two full waves of an H200 (132
#: multiprocessors, 2 blocks each), rounded down. H200, benchmarks/kernels/gemm_check.cu, us per
#: matmul, WMMA (4 warps along the outputs, session 17) -> mma.sync, the same call
#: (benchmarks/results/h200-2026-12-03-s18/call3): Llama-3-8B 2,048-token chunk qkv (768 blocks)
#: 548.7 -> 442.5, o (512) 366.0 -> 293.8, gate_up 2,485.5 -> 1,988.5, down (512) 988.1 -> 929.0;
#: at 512 tokens Llama-2-7B gate_up (688) 537.5 -> 437.9, but qkv (384) 275.8 -> 292.5, o and
#: down (128) 78.4 -> 100.7 and 197.4 -> 235.9
MMA_MIN_BLOCKS = 512


def tile_rows(out_features: int) -> int:
    """Prompt rows per thread block for a layer with ``out_features`` outputs."""
    return 128 if out_features >= WIDE_N else 64


def tile_warps(out_features: int) -> int:
    """Warps along the outputs (the kernel's WN, 32 outputs each) for ``out_features`` outputs."""
    wide = tile_rows(out_features) == 128 and out_features % (32 * WIDE_WARPS) == 0
    return WIDE_WARPS if wide else 2


def takes_mma(in_features: int, out_features: int) -> bool:
    """Whether a layer may take the mma.sync kernel: a wide layer (128-row tiles) with outputs by
    128 and inputs by 128 (its scales are copied 4 groups at a time)."""
    return tile_rows(out_features) == 128 and out_features % MMA_TILE == 0 and in_features % 128 == 0


def mma_min_rows(out_features: int) -> int:
    """The shortest prompt for which a layer with ``out_features`` outputs gives the mma.sync
    kernel :data:`MMA_MIN_BLOCKS` blocks (``out_features / 128`` column tiles per 128 rows)."""
    row_tiles = -(-MMA_MIN_BLOCKS // (out_features // MMA_TILE))
    return (row_tiles - 1) * MMA_TILE + 1


def match_q4f16_gemm(func: Any) -> Q4MatmulMatch | None:
    """The roles of ``func``'s buffers when it is a prompt-sized q4f16_1 matmul llmchat's kernel
    handles (``in_features`` a multiple of 32, ``out_features`` of 64); None otherwise."""
    blocks = root_blocks(func)
    if len(blocks) < 2 or [b.name_hint for b in blocks[:2]] != [DEQUANTIZE_STAGE, "dequant_matmul"]:
        return None
    stage, main = blocks[0], blocks[1]
    if str(stage.annotations.get(FORMAT_ANNOTATION, "")) != "q4f16_1":
        return None
    params = list(func.params)
    stage_reads = [r.source for r in stage.reads]
    if len(stage_reads) != 2:
        return None
    weight, scale = stage_reads
    main_reads = [r.source for r in main.reads if not r.source.same_as(stage.writes[0].source)]
    if len(main_reads) != 1:
        return None
    x = main_reads[0]
    out = params[-1]
    ws, ss = static_shape(weight), static_shape(scale)
    if ws is None or ss is None or len(x.shape) != 3 or len(out.shape) != 3:
        return None
    k, n = static_int(x.shape[-1]), ws[0]
    if (
        k is None
        or n % TILE_N
        or static_int(x.shape[0]) != 1
        or static_int(out.shape[0]) != 1
        or static_int(out.shape[-1]) != n
        or not x.shape[1].same_as(out.shape[1])
    ):
        return None
    roles = match_q4_operands(func, main, blocks[2:], x, weight, scale, out, k, n)
    return None if roles is None else Q4MatmulMatch(x, weight, scale, *roles, out, k, n)


def build_gemm_func(func: Any, m: Q4MatmulMatch, mma: bool = False) -> Any:
    """``func`` with its body replaced by a launch of ``llmchat::q4f16_gemm``; with ``mma`` (sm_80
    and later) and a layer that :func:`takes_mma`, by a branch on the prompt's length between that
    launch and one of ``llmchat::q4f16_gemm_mma``."""
    from tvm import tirx

    mode = epilogue_mode(m.out, m.residual)
    tile_m, warps_n = tile_rows(m.out_features), tile_warps(m.out_features)
    record = records_qkv(func)
    types = f"{mode}, {'true' if m.bias is not None else 'false'}, {'float' if mode == 0 else 'half'}"
    # RECORD is spelled out when WN follows it
    tail = record_flag(record) if warps_n == 2 else f", {'true' if record else 'false'}, {warps_n}"
    name = f"{KERNEL}<{m.in_features}, {m.out_features}, {tile_m}, {types}{tail}>"
    rows = tirx.Cast("int32", m.x.shape[1])
    call = matmul_call(name, m.x, m.weight, m.scale, m.bias, m.residual, m.out, rows)
    grid = {
        "blockIdx.x": m.out_features // (32 * warps_n),
        "blockIdx.y": tirx.floordiv(rows + (tile_m - 1), tile_m),
    }
    body = launch(call, grid, {"threadIdx.x": 64 * warps_n})
    if not (mma and takes_mma(m.in_features, m.out_features)):
        return func.with_body(body)
    mma_name = f"{MMA_KERNEL}<{m.in_features}, {m.out_features}, {types}{record_flag(record)}>"
    mma_call = matmul_call(mma_name, m.x, m.weight, m.scale, m.bias, m.residual, m.out, rows)
    mma_grid = {
        "blockIdx.x": m.out_features // MMA_TILE,
        "blockIdx.y": tirx.floordiv(rows + (MMA_TILE - 1), MMA_TILE),
    }
    mma_body = launch(mma_call, mma_grid, {"threadIdx.x": MMA_THREADS})
    min_rows = mma_min_rows(m.out_features)
    if min_rows <= 1:
        return func.with_body(mma_body)
    return func.with_body(tirx.IfThenElse(rows >= min_rows, mma_body, body))


class CudaQ4Gemm(KernelRule):
    """dlight rule: prompt-sized ``q4f16_1`` matmuls on CUDA -> :func:`build_gemm_func` (``mma``:
    the target may take the mma.sync kernel, ``gpu_choices.use_cuda_gemm_mma``)."""

    def __init__(self, mma: bool = False) -> None:
        self.mma = mma

    def replace(self, func: Any) -> Any | None:
        m = match_q4f16_gemm(func)
        return None if m is None else build_gemm_func(func, m, self.mma)
