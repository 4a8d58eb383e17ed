"""A hand-written CUDA kernel for batch-1 ``q4f16_1`` GEMVs (the decode step's linear layers).

dlight-style rule :class:`CudaQ4Gemv` recognises a fused decode PrimFunc built by
``dequant_matmul_te`` for ``q4f16_1`` (its reduction block carries the ``llmchat_format``
annotation), with one of the epilogues the models produce: none (float32 logits), a cast to
float16, a float16 bias before the cast, a float16 residual add after it. It replaces the body by
a kernel launch whose work is done by ``llmchat::q4f16_gemv`` from ``cuda_kernels.cu``: every warp
computes R rows, the activations are reused across those rows from registers, the 4-bit values
are decoded two at a time with half2 bit tricks, and the weights stream past L1. TIR-generated
GEMVs with fp32 dequantization were limited by instruction throughput and shared-memory traffic
(1.2–1.9 TB/s on an H200 whose copy bandwidth is 4.25 TB/s).

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.cuda_kernels import (
    KernelRule,
    epilogue_mode,
    launch,
    matmul_call,
    record_flag,
    records_qkv,
)
from app.inference.pipelines.tir_facts import root_blocks, static_shape
from app.inference.quantization.base import FORMAT_ANNOTATION

KERNEL = "llmchat::q4f16_gemv"


@dataclass(frozen=True)
class GemvLayout:
    """Rows per warp, warps per block, and how many warps share one set of rows (split-K)."""

    rows_per_warp: int
    warps_per_block: int
    split: int = 1

    def blocks(self, out_features: int) -> int:
        """Grid size for ``out_features`` rows."""
        return out_features // (self.rows_per_warp * self.warps_per_block // self.split)


#: most warps that share one set of rows (split-K)
MAX_SPLIT = 4


def choose_layout(out_features: int, in_features: int) -> GemvLayout | None:
    """4 rows per warp (the activations are reused 4 times from registers), as many warps (up to
    :data:`MAX_SPLIT`) sharing each set of rows (split-K) as keep at least one step of 32 groups
    each (more loads in flight per row, short blocks that fill the last wave), and 4 warps per
    block, 8 when each warp still takes several steps. H200, weights rotating through 32 layers
    (benchmarks/kernels): Llama-2-7B qkv 10.3 us unsplit, 10.35 split 2, 8.95 split 4; gate_up
    15.2 split 2, 13.7 split 4; down 12.1 split 2, 9.4 split 4, 8.6 with 8 warps (4 warps stay
    best for one-step layers: qkv 8.95 vs 10.0, gate_up 13.7 vs 16.0); 8 rows per warp or 2 were
    slower everywhere. None when no layout tiles ``out_features``."""
    groups = in_features // 32
    split = 1
    while split < MAX_SPLIT and groups // (32 * split * 2) >= 1:
        split *= 2
    warps = 8 if groups > 32 * split else 4
    for rows in (4, 2, 1):
        if out_features % (rows * warps // split) == 0:
            return GemvLayout(rows, warps, split)
    return None


@dataclass(frozen=True)
class Q4MatmulMatch:
    """Buffer roles of a q4f16_1 matmul (decode GEMV or prompt GEMM) with its epilogue."""

    x: Any
    weight: Any
    scale: Any
    bias: Any | None
    residual: Any | None
    out: Any
    in_features: int
    out_features: int


def match_epilogue(blocks: list[Any], main: Any, out: Any, n: int) -> tuple[Any, Any] | None:
    """(bias, residual) of the blocks after a quantized matmul ``main``: none (float32 output),
    a cast to float16 (with a float16 bias before it), then optionally a float16 residual add.
    None for anything else."""
    bias = residual = None
    if not blocks:
        return (None, None) if str(out.dtype) == "float32" else None
    if [b.name_hint for b in blocks] not in (["dequant_matmul_out"], ["dequant_matmul_out", "T_add"]):
        return None
    if str(out.dtype) != "float16":
        return None
    extra = [r.source for r in blocks[0].reads if not r.source.same_as(main.writes[0].source)]
    if len(extra) > 1:
        return None
    if extra:
        bias = extra[0]
        if str(bias.dtype) != "float16" or static_shape(bias) != [n]:
            return None
    if len(blocks) == 2:
        others = [r.source for r in blocks[1].reads if not r.source.same_as(blocks[0].writes[0].source)]
        if len(others) != 1 or str(others[0].dtype) != "float16":
            return None
        residual = others[0]
        last = residual.shape[-1]
        if int(getattr(last, "value", last)) != n:
            return None
    return bias, residual


def match_q4f16_gemv(func: Any) -> Q4MatmulMatch | None:
    """The roles of ``func``'s buffers when it is a batch-1 q4f16_1 GEMV with a known epilogue."""
    blocks = root_blocks(func)
    names = [b.name_hint for b in blocks]
    if names not in (
        ["dequant_matmul"],
        ["dequant_matmul", "dequant_matmul_out"],
        ["dequant_matmul", "dequant_matmul_out", "T_add"],
    ):
        return None
    main = blocks[0]
    if str(main.annotations.get(FORMAT_ANNOTATION, "")) != "q4f16_1":
        return None
    reads = [r.source for r in main.reads]
    if len(reads) != 3:
        return None
    x, weight, scale = reads
    out = func.params[-1]
    shapes = [static_shape(b) for b in (x, weight, scale, out)]
    if any(s is None for s in shapes):
        return None
    xs, ws, _ss, os_ = shapes
    k, n = xs[-1], ws[0]
    if any(d != 1 for d in xs[:-1]) or os_[-1] != n or any(d != 1 for d in os_[:-1]):
        return None
    roles = match_q4_operands(func, main, blocks[1:], x, weight, scale, out, k, n)
    return None if roles is None else Q4MatmulMatch(x, weight, scale, *roles, out, k, n)


def match_q4_operands(
    func: Any, main: Any, epilogue: list[Any], x: Any, weight: Any, scale: Any, out: Any, k: int, n: int
) -> tuple[Any, Any] | None:
    """(bias, residual) when ``weight``/``scale`` hold an ``[n, k]`` q4f16_1 matrix applied to the
    float16 rows ``x``, the blocks after the matmul are a known epilogue, and ``func`` takes
    exactly these buffers; None otherwise."""
    if (
        str(x.dtype) != "float16"
        or str(weight.dtype) != "uint32"
        or static_shape(weight) != [n, k // 8]
        or str(scale.dtype) != "float16"
        or static_shape(scale) != [n, k // 32]
        or k % 32
    ):
        return None
    roles = match_epilogue(epilogue, main, out, n)
    if roles is None:
        return None
    known = [b for b in (x, weight, scale, *roles, out) if b is not None]
    params = list(func.params)
    if len(params) != len(known) or any(not any(p.same_as(b) for b in known) for p in params):
        return None
    return roles


def gemv_launch(m: Q4MatmulMatch, layout: GemvLayout, mode: int, out: Any, record: bool = False) -> Any:
    """The TIR launch of ``llmchat::q4f16_gemv`` for the matmul ``m`` in epilogue ``mode``,
    writing ``out`` (``m.out``, or a narrower buffer for a mode that writes fewer values);
    ``record``: the kernel records ``out`` as the layer's fused q/k/v projection."""
    name = (
        f"{KERNEL}<{m.in_features}, {m.out_features}, {layout.rows_per_warp}, {layout.split}, "
        f"{mode}, {'true' if m.bias is not None else 'false'}, {'float' if mode == 0 else 'half'}"
        f"{record_flag(record)}>"
    )
    call = matmul_call(name, m.x, m.weight, m.scale, m.bias, m.residual, out)
    grid = {"blockIdx.x": layout.blocks(m.out_features)}
    return launch(call, grid, {"threadIdx.x": 32, "threadIdx.y": layout.warps_per_block})


def build_kernel_func(func: Any, m: Q4MatmulMatch, layout: GemvLayout) -> Any:
    """``func`` with its body replaced by a launch of ``llmchat::q4f16_gemv``."""
    return func.with_body(gemv_launch(m, layout, epilogue_mode(m.out, m.residual), m.out, records_qkv(func)))


class CudaQ4Gemv(KernelRule):
    """dlight rule: batch-1 ``q4f16_1`` GEMVs on CUDA -> :func:`build_kernel_func`."""

    def replace(self, func: Any) -> Any | None:
        m = match_q4f16_gemv(func)
        layout = None if m is None else choose_layout(m.out_features, m.in_features)
        return None if layout is None else build_kernel_func(func, m, layout)
