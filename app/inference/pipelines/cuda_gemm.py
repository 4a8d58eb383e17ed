"""Prefill's quantized matmuls on tensor cores: ``llmchat::q4f16_gemm`` (``cuda_kernels.cu``).

dlight rule :class:`CudaQ4Gemm` takes the multi-row PrimFunc ``dequant_matmul_te`` builds for a
prompt (a ``dequantize`` stage annotated ``q4f16_1``, the fp32 reduction over it, and the same
epilogues as decode: fp32 output, fp16 cast with optional bias, fp16 residual add) and replaces
its body by a launch over (N / cols) x ceil(M / rows) blocks, M the prompt length (a shape
variable): rows 128 and cols 128 (256 threads) for layers with at least :data:`WIDE_N` outputs,
else rows 64 and cols 64 (128 threads). TVM 0.27's own tensor-core matmul schedule segfaults on
these shapes, which is why prefill ran on FP32 cores before.
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


def tile_rows(out_features: int) -> int:
    """Prompt rows per thread block for a layer with ``out_features`` outputs."""
    return 128 if out_features >= WIDE_N else 64


def tile_warps(out_features: int) -> int:
    """Warps along the outputs (the kernel's WN, 32 outputs each) for ``out_features`` outputs."""
    wide = tile_rows(out_features) == 128 and out_features % (32 * WIDE_WARPS) == 0
    return WIDE_WARPS if wide else 2


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


def build_gemm_func(func: Any, m: Q4MatmulMatch) -> Any:
    """``func`` with its body replaced by a launch of ``llmchat::q4f16_gemm``."""
    from tvm import tirx

    mode = epilogue_mode(m.out, m.residual)
    tile_m, warps_n = tile_rows(m.out_features), tile_warps(m.out_features)
    record = records_qkv(func)
    # RECORD is spelled out when WN follows it
    tail = record_flag(record) if warps_n == 2 else f", {'true' if record else 'false'}, {warps_n}"
    name = (
        f"{KERNEL}<{m.in_features}, {m.out_features}, {tile_m}, {mode}, "
        f"{'true' if m.bias is not None else 'false'}, {'float' if mode == 0 else 'half'}{tail}>"
    )
    rows = tirx.Cast("int32", m.x.shape[1])
    call = matmul_call(name, m.x, m.weight, m.scale, m.bias, m.residual, m.out, rows)
    grid = {
        "blockIdx.x": m.out_features // (32 * warps_n),
        "blockIdx.y": tirx.floordiv(rows + (tile_m - 1), tile_m),
    }
    return func.with_body(launch(call, grid, {"threadIdx.x": 64 * warps_n}))


class CudaQ4Gemm(KernelRule):
    """dlight rule: prompt-sized ``q4f16_1`` matmuls on CUDA -> :func:`build_gemm_func`."""

    def replace(self, func: Any) -> Any | None:
        m = match_q4f16_gemm(func)
        return None if m is None else build_gemm_func(func, m)
