"""A hand-scheduled q4f16_1 decode GEMV for WGSL (WebGPU/Vulkan): the CUDA kernel's design
(:mod:`.cuda_gemv`) written as TIR that TVM's WebGPU code generator lowers.

Rule :class:`WgslQ4Gemv` takes the batch-1 ``q4f16_1`` GEMVs :func:`.cuda_gemv.match_q4f16_gemv`
recognises (float32 logits; float16 output with an optional bias before the cast and an optional
residual after it) and gives them a new body:

- a workgroup of ``sets x lanes`` threads; each set of ``lanes`` threads owns ``rows`` output rows
  and splits their 32-value groups (one 16-byte word of weights and one scale per row) between
  its lanes: lane ``l`` takes groups ``l, l + lanes, ...``;
- per group a lane loads the ``rows`` weight words and scales first, then the group's 32
  activations (L1/L2: every set reads the same vector), which it reuses for all its rows;
- the 4-bit values are decoded two at a time into ``vec2<f16>`` with the exponent trick of
  llmchat's CUDA kernel (``(w & 0x000F000F) | 0x64006400`` is 1024 + n in each half) and multiplied
  by activation pairs ``(x_i, x_{i+4})`` in fp16, 8 products per word summed in fp16; each group's
  sum is scaled and added in fp32 (the CUDA kernel's arithmetic: ``decode="f32"`` instead decodes
  each value with TVM's own fp32 exponent trick and sums in fp32 throughout);
- the lanes' fp32 partial sums meet in workgroup memory (one barrier), and the first ``rows``
  lanes of a set write the set's rows through the epilogue.

Why: every layout of dlight-style ``DecodeGEMV`` on WGSL (:mod:`.wgsl_gemv`, 91 swept on the H200)
stayed at or below 1.36 TB/s of weights, the down projection at 0.54, against a 2.74 TB/s WGSL
copy; on CUDA the same kind of TIR GEMV was limited by instruction throughput and shared-memory
traffic until the hand-written kernel (registers reused across rows, two-at-a-time fp16 decode).
Whether this one does better on WGSL is for the H200 sweep (``benchmarks/wgsl_gemv_sweep.py``,
variants ``q4-...``) to say: the layouts below are not yet measured.

``LLMCHAT_WGSL_GEMV`` (:mod:`.wgsl_gemv`) names the rules; ``q4-rR-lL-tT[-f32]`` is this kernel
with ``R`` rows per set, ``L`` lanes per set, ``T`` threads per workgroup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.cuda_gemv import Q4MatmulMatch, match_q4f16_gemv
from app.inference.pipelines.tir_facts import WebGPUKernelRule, static_shape

#: 1024 + 7 and the other constants of the fp16 decode (see :func:`gemv_kernel`)
_MAGIC = 0x64006400
_LO = 0x000F000F
_HI = 0x00F000F0


@dataclass(frozen=True)
class Q4GemvLayout:
    """``rows`` output rows per set of ``lanes`` threads, ``threads`` per workgroup, and the decode:
    ``unpack`` (``unpack2x16float``, two values at a time) or ``f32`` (TVM's, one at a time)."""

    rows: int
    lanes: int
    threads: int
    decode: str = "unpack"
    #: int8 kernels: load the next step's weights before this step's dot products (two register sets)
    prefetch: bool = False
    #: int8 kernels without ``prefetch``: the steps whose weights are loaded before the vector is
    #: staged (as many register sets); each later step's load goes out ``preload - 1`` steps ahead
    preload: int = 1

    @property
    def sets(self) -> int:
        return self.threads // self.lanes

    @property
    def rows_per_workgroup(self) -> int:
        return self.rows * self.sets

    def fits(self, out_features: int, in_features: int) -> bool:
        return (
            self.threads % self.lanes == 0
            and out_features % self.rows_per_workgroup == 0
            and in_features % 32 == 0
        )

    @property
    def name(self) -> str:
        return (
            f"q4-r{self.rows}-l{self.lanes}-t{self.threads}"
            + ("" if self.decode == "unpack" else f"-{self.decode}")
            + ("-pf" if self.prefetch else "")
            + (f"-pre{self.preload}" if self.preload > 1 else "")
        )


def parse(name: str) -> Q4GemvLayout | None:
    """The layout a ``q4-rR-lL-tT[-f32|-dp4a]`` name gives, None for another name (limits on
    the shapes it takes are :func:`parse_rule`'s)."""
    rule = parse_rule(name)
    return None if rule is None else rule[0]


def parse_rule(name: str) -> tuple[Q4GemvLayout, int, int] | None:
    """(layout, fewest rows, most K) of ``q4-rR-lL-tT[-f32|-dp4a|-dp4a2][-pf][-nminN][-kmaxN]``:
    the kernel in that layout (``pf``: the int8 kernel's weights loaded a step ahead) for GEMVs of
    ``N`` output rows or more and a reduction of ``N`` or less."""
    parts = name.split("-")
    if len(parts) < 4 or parts[0] != "q4":
        return None
    try:
        rows, lanes, threads = (int(p[1:]) for p, c in zip(parts[1:4], "rlt", strict=True) if p[:1] == c)
    except ValueError:
        return None
    decode, min_rows, max_k, prefetch, preload = "unpack", 0, 1 << 30, False, 1
    for opt in parts[4:]:
        if opt in ("f32", "dp4a", "dp4a2") and decode == "unpack":
            decode = opt
        elif opt == "pf" and decode.startswith("dp4a") and preload == 1:
            prefetch = True
        elif opt.startswith("pre") and opt[3:].isdigit() and decode.startswith("dp4a") and not prefetch:
            preload = int(opt[3:])
            if not 1 <= preload <= 8:
                return None
        elif opt.startswith("nmin") and opt[4:].isdigit():
            min_rows = int(opt[4:])
        elif opt.startswith("kmax") and opt[4:].isdigit():
            max_k = int(opt[4:])
        else:
            return None
    if rows < 1 or lanes < 1 or threads > 256 or threads % lanes or rows > 8:
        return None
    return Q4GemvLayout(rows, lanes, threads, decode, prefetch, preload), min_rows, max_k


#: the longest reduction ``q4-auto`` takes: the int8 kernel stages the whole quantized vector in
#: workgroup memory (:func:`shared_bytes`: 24 KiB at 16,384 in 256-thread workgroups), longer ones
#: go to the rules after it
MAX_K = 16384
#: workgroups ``q4-auto`` aims at: the most rows per set (4, 2, 1) that still give this many
#: workgroups, else the fewest rows. H200, NVIDIA's Vulkan driver, in the model (GPU profile, µs
#: per launch, benchmarks/results/h200-2026-12-02-s12/ab1): Llama-2-7B down (11008 -> 4096)
#: DecodeGEMV (the rule before: the int8 kernel took K <= 8191 only) 51.9, int8 with 2 rows a set
#: (256 workgroups) 25.9, 1 row (512) 33.0; o (4096 -> 4096) 4 rows (128 workgroups) 17.5, 2 rows
#: 15.8, 1 row 16.3; qkv (4096 -> 12288) 4 rows (384) 21.9, 2 rows 26.0, 1 row 32.4; Qwen2.5-3B
#: down (11008 -> 2048) 1 row (256) 20.8, 2 rows 23.4, DecodeGEMV 34.3; o (2048 -> 2048) 4 rows
#: (64) 13.7, 2 rows 12.8, 1 row 12.1
MIN_WORKGROUPS = 256
#: the switch for :data:`MIN_WORKGROUPS`, for A/B runs (part of the library cache key)
MIN_WORKGROUPS_ENV = "LLMCHAT_WGSL_MIN_WORKGROUPS"


def min_workgroups() -> int:
    """:data:`MIN_WORKGROUPS`, or the number ``LLMCHAT_WGSL_MIN_WORKGROUPS`` names (a power of two
    from 32 to 4,096)."""
    from app.errors import LlmchatError

    raw = os.environ.get(MIN_WORKGROUPS_ENV, "").strip()
    if not raw:
        return MIN_WORKGROUPS
    if not raw.isdigit() or int(raw) not in {1 << e for e in range(5, 13)}:
        raise LlmchatError(
            f"{MIN_WORKGROUPS_ENV}={raw!r} is not a power of two from 32 to 4096",
            f"unset {MIN_WORKGROUPS_ENV}",
        )
    return int(raw)


def shared_bytes(layout: Q4GemvLayout, k: int) -> int:
    """Workgroup memory of the int8 kernel (:func:`dp4a_kernel`) for a reduction of ``k``: the
    quantized vector (two 16-byte words per 32 values and level), its scales and sums, and the
    lanes' partial sums."""
    levels = 2 if layout.decode == "dp4a2" else 1
    padded = -(-(k // 32) // layout.threads) * layout.threads
    return padded * (32 * levels + 4 + 4 * levels) + layout.sets * layout.rows * layout.lanes * 4


def q8_words(k: int) -> int:
    """Length (uint32 words) of a quantized vector of ``k`` values as ``q8="stage"`` writes it
    (:func:`dp4a_kernel`): each 32-value group's two 16-byte words of int8 (even and odd values of
    each 8-value word interleaved), then every group's scale (float32 bits), then every group's
    sum of its int8 values."""
    return k // 32 * 10


def q8n_words(k: int) -> int:
    """Length (uint32 words) of a vector of ``k`` values written quantized by the GEMV that
    produces it for the RMSNorm after it (``norm_out`` of :func:`dp4a_kernel`), in half groups of
    16 values (a producing workgroup's rows): the int8 words of ``x * w`` (the norm's weight, not
    yet its scale) as :func:`q8_words` lays them out, then every half group's scale (float32
    bits), its int8 sum, and its sum of ``x^2`` (float32 bits), from which the GEMVs reading it
    (``read_norm``) compute the norm's ``rsqrt(sum / k + eps)``."""
    return k // 32 * 14


#: the switch for ``q4-auto``'s :attr:`Q4GemvLayout.preload` (part of the library cache key)
PRELOAD_ENV = "LLMCHAT_WGSL_Q4_PRELOAD"
#: ``q4-auto``'s steps of weights loaded before the staging, unless ``LLMCHAT_WGSL_Q4_PRELOAD``
#: names another number
PRELOAD = 1


def preload_steps() -> int:
    """:data:`PRELOAD`, or the number ``LLMCHAT_WGSL_Q4_PRELOAD`` names (1 to 8)."""
    from app.errors import LlmchatError

    raw = os.environ.get(PRELOAD_ENV, "").strip()
    if not raw:
        return PRELOAD
    if not raw.isdigit() or not 1 <= int(raw) <= 8:
        raise LlmchatError(
            f"{PRELOAD_ENV}={raw!r} is not a number of steps from 1 to 8", f"unset {PRELOAD_ENV}"
        )
    return int(raw)


#: the switch for the gate_up (SiLU pairs) layout, for A/B runs (part of the library cache key):
#: ``r8`` 8 rows a set of 32 lanes, ``l16`` 4 rows a set of 16 lanes (16 sets: a workgroup's 32
#: gated outputs one group as with ``r8``); unset: :func:`choose`'s rule. H200, NVIDIA's Vulkan
#: driver, decode tok/s Qwen2.5-3B / Llama-2-7B, one device call
#: (benchmarks/results/h200-2026-12-03-s16/call2): float16 output 413.9 / 291.5 with 4 rows of
#: 32 lanes (688 workgroups on the 7B's gate_up), 409.3 / 274.2 with ``r8``, 415.5 / 281.6 with
#: ``l16``; the gated output quantized (the down projection reading it) 420.2 / 291.7 with ``r8``,
#: 440.9 / 296.4 with ``l16``: the layout of a quantized output's pairs
GATE_LAYOUT_ENV = "LLMCHAT_WGSL_GATE_LAYOUT"


def _pair_layouts(group_out: bool) -> tuple[tuple[int, int], ...]:
    """(rows, lanes) of the layouts tried for SiLU pairs, in order (:data:`GATE_LAYOUT_ENV`)."""
    from app.errors import LlmchatError

    raw = os.environ.get(GATE_LAYOUT_ENV, "").strip().lower()
    if raw not in ("", "r8", "l16"):
        raise LlmchatError(f"{GATE_LAYOUT_ENV}={raw!r} is not r8 or l16", f"unset {GATE_LAYOUT_ENV}")
    if raw == "l16" or (group_out and raw != "r8"):
        return ((4, 16),)
    if raw == "r8":
        return ((8, 32),)
    return ((4, 32), (2, 32))


#: the switch for the layout of a GEMV that writes its output quantized for the RMSNorm after it
#: (``norm_out``: a workgroup's 16 rows one half group), for A/B runs (part of the library cache
#: key): ``r2`` 2 rows a set of 32 lanes (8 sets), ``r1`` 1 row a set of 16 lanes (16 sets),
#: ``r4l64`` 4 rows a set of 64 lanes (4 sets), ``r8l128`` 8 rows a set of 128 lanes (2 sets: fewer
#: steps a lane, a longer sum of the lanes' parts); unset: :data:`NORM_OUT_LAYOUT`. H200, NVIDIA's
#: Vulkan driver, Llama-2-7B decode tok/s (bench protocol): ``r1`` 377.0 against 409.6
#: (benchmarks/results/h200-2026-12-04-s21/callE), ``r4l64`` 394.5 and ``r8l128`` 346.4 against
#: 406.4 / 408.8 (h200-2026-12-04-s22/callB). (Whole groups of 32 rows a workgroup, measured first,
#: left the Llama-2-7B's o and down projections with 128 workgroups: 20.5 and 30.2 µs a launch in the H200's
#: GPU profile against 15.8 and 19.0, benchmarks/results/h200-2026-12-04-s19/callA.)
NORM_OUT_LAYOUT_ENV = "LLMCHAT_WGSL_NORM_OUT_LAYOUT"
NORM_OUT_LAYOUTS = {
    "r2": (2, 32),
    "r1": (1, 16),
    "r2p": (2, 32),
    "r1p": (1, 16),
    "r4l64": (4, 64),
    "r8l128": (8, 128),
}
NORM_OUT_LAYOUT = "r2"


def _norm_out_choice() -> str:
    """The value of ``LLMCHAT_WGSL_NORM_OUT_LAYOUT`` (:data:`NORM_OUT_LAYOUT` when unset); a value
    not in :data:`NORM_OUT_LAYOUTS` is refused."""
    from app.errors import LlmchatError

    raw = os.environ.get(NORM_OUT_LAYOUT_ENV, "").strip().lower() or NORM_OUT_LAYOUT
    if raw not in NORM_OUT_LAYOUTS:
        raise LlmchatError(
            f"{NORM_OUT_LAYOUT_ENV}={raw!r} is not one of {', '.join(NORM_OUT_LAYOUTS)}",
            f"unset {NORM_OUT_LAYOUT_ENV}",
        )
    return raw


def norm_out_parallel() -> bool:
    """Whether a GEMV writing a norm's vector quantizes its 16 values with several threads (the
    ``...p`` values of ``LLMCHAT_WGSL_NORM_OUT_LAYOUT``: four threads a word each, one the int8
    sum, one the sum of squares and the scale, on three sets) rather than one."""
    return _norm_out_choice().endswith("p")


def _norm_out_layout() -> tuple[int, int]:
    """(rows, lanes) of a GEMV writing its output quantized for the norm after it."""
    return NORM_OUT_LAYOUTS[_norm_out_choice()]


def choose(
    k: int, n: int, max_shared: int = 1 << 30, pairs: bool = False, group_out: bool = False
) -> Q4GemvLayout | None:
    """The product's layout for a ``k -> n`` GEMV (``q4-auto``): int8 dot4, 32 lanes a set, 256
    threads, and the most rows per set (4, 2 or 1; ``pairs``: 4 or 2, gate and up rows) that tile
    ``n`` in :func:`min_workgroups` workgroups or more (else the fewest that tile it); None for
    reductions over :data:`MAX_K`, over ``max_shared`` bytes of workgroup memory, or rows no layout
    tiles: other rules take those. ``group_out`` (pairs whose gated output is written quantized,
    ``q8_out`` of :func:`dp4a_kernel`): 4 rows a set of 16 lanes, 16 sets, a workgroup's 32
    outputs one group; ``group_out`` without pairs (a GEMV writing its output quantized for the
    norm after it): 16 rows a workgroup, :func:`_norm_out_layout`."""
    if k > MAX_K:
        return None
    if pairs:
        shapes = _pair_layouts(group_out)
    else:
        shapes = (_norm_out_layout(),) if group_out else ((4, 32), (2, 32), (1, 32))
    least = min_workgroups()
    fitting = [Q4GemvLayout(rows, lanes, 256, "dp4a", preload=preload_steps()) for rows, lanes in shapes]
    fitting = [lay for lay in fitting if lay.fits(n, k) and shared_bytes(lay, k) <= max_shared]
    for layout in fitting:
        if n // layout.rows_per_workgroup >= least:
            return layout
    return fitting[-1] if fitting else None


def gemv_kernel(m: Q4MatmulMatch, layout: Q4GemvLayout, out_dtype: str) -> Any:
    """The scheduled PrimFunc of ``m`` in ``layout``: parameters (x, weight, scale, bias, residual,
    out); :func:`build` drops those ``m`` lacks and orders them as the original function."""
    from tvm.script import tirx as T

    k, n = m.in_features, m.out_features
    rows, lanes, sets = layout.rows, layout.lanes, layout.sets
    groups = k // 32
    iters = -(-groups // lanes)
    has_bias, has_res = m.bias is not None, m.residual is not None
    unpack = layout.decode == "unpack"
    blocks = n // layout.rows_per_workgroup
    out_f32 = out_dtype == "float32"

    @T.prim_func(private=True)
    def kernel(
        x: T.Buffer((1, 1, k), "float16"),
        w: T.Buffer((n, k // 8), "uint32"),
        s: T.Buffer((n, groups), "float16"),
        b: T.Buffer((n,), "float16"),
        r: T.Buffer((1, 1, n), "float16"),
        out: T.Buffer((1, 1, n), out_dtype),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", blocks)
        ty = T.launch_thread("threadIdx.y", sets)
        tx = T.launch_thread("threadIdx.x", lanes)
        part = T.decl_buffer((sets * rows * lanes,), "float32", scope="shared")
        acc = T.decl_buffer((rows,), "float32", scope="local")
        wq = T.decl_buffer((rows * 4,), "uint32", scope="local")
        sc = T.decl_buffer((rows,), "float16", scope="local")
        xf = T.decl_buffer((32,), "float32", scope="local")
        u = T.decl_buffer((1,), "float32x2", scope="local")
        us = T.decl_buffer((2,), "float32", scope="local")
        corr = T.decl_buffer((1,), "float32", scope="local")
        gsum = T.decl_buffer((1,), "float32", scope="local")
        row0 = (bx * sets + ty) * rows
        for rr in T.unroll(rows):
            acc[rr] = T.float32(0)
        for it in T.unroll(iters):
            if tx + it * lanes < groups:
                # the rows' weights and scales (DRAM) before the activations (cached)
                for rr in T.unroll(rows):
                    wq[T.ramp(rr * 4, 1, 4)] = w.vload([row0 + rr, (tx + it * lanes) * 4], "uint32x4")
                    sc[rr] = s[row0 + rr, tx + it * lanes]
                if unpack:
                    # the group's activations in fp32; those met as 16 n + 1024 pre-divided by 16
                    for j in T.unroll(32):
                        xf[j] = T.Cast("float32", x[0, 0, (tx + it * lanes) * 32 + j]) * T.if_then_else(
                            (j % 8) % 2 == 1, T.float32(0.0625), T.float32(1)
                        )
                    # sum x (n + 1024) - 1031 x (low nibbles) and x / 16 (16 n + 1024) - 71 x (high)
                    corr[0] = T.float32(0)
                    for j in T.unroll(32):
                        corr[0] = corr[0] + xf[j] * T.if_then_else(
                            (j % 8) % 2 == 1, T.float32(71 * 16), T.float32(1031)
                        )
                    for rr in T.unroll(rows):
                        gsum[0] = T.float32(0) - corr[0]
                        for q in T.unroll(4):
                            for e in T.unroll(4):
                                # e: 0 -> nibbles (0, 4), 1 -> (1, 5), 2 -> (2, 6), 3 -> (3, 7) of word q
                                u[0] = T.call_pure_extern(
                                    "float32x2",
                                    "unpack2x16float",
                                    (
                                        (wq[rr * 4 + q] >> T.uint32((e // 2) * 8))
                                        & (T.uint32(_LO) << T.Cast("uint32", (e % 2) * 4))
                                    )
                                    | T.uint32(_MAGIC),
                                )
                                us[T.ramp(0, 1, 2)] = u[0]
                                gsum[0] = gsum[0] + us[0] * xf[q * 8 + (e // 2) * 2 + e % 2]
                                gsum[0] = gsum[0] + us[1] * xf[q * 8 + 4 + (e // 2) * 2 + e % 2]
                        acc[rr] = acc[rr] + T.Cast("float32", sc[rr]) * gsum[0]
                else:
                    for j in T.unroll(32):
                        xf[j] = T.Cast("float32", x[0, 0, (tx + it * lanes) * 32 + j])
                    for rr in T.unroll(rows):
                        gsum[0] = T.float32(0)
                        for j in T.unroll(32):
                            gsum[0] = gsum[0] + xf[j] * (
                                T.reinterpret(
                                    "float32",
                                    ((wq[rr * 4 + j // 8] >> T.uint32((j % 8) * 4)) & T.uint32(15))
                                    | T.uint32(1258291200),
                                )
                                - T.float32(8388615.0)
                            )
                        acc[rr] = acc[rr] + T.Cast("float32", sc[rr]) * gsum[0]
        for rr in T.unroll(rows):
            part[(ty * rows + rr) * lanes + tx] = acc[rr]
        T.tvm_storage_sync("shared")
        # lane l of a set sums row l % rows over the set's lanes (every lane reads; rows write)
        gsum[0] = T.float32(0)
        for ln in T.unroll(lanes):
            gsum[0] = gsum[0] + part[(ty * rows + tx % rows) * lanes + ln]
        if tx < rows:
            if out_f32:
                out[0, 0, row0 + tx] = gsum[0]
            elif has_bias and has_res:
                out[0, 0, row0 + tx] = (
                    T.Cast("float16", gsum[0] + T.Cast("float32", b[row0 + tx])) + r[0, 0, row0 + tx]
                )
            elif has_bias:
                out[0, 0, row0 + tx] = T.Cast("float16", gsum[0] + T.Cast("float32", b[row0 + tx]))
            elif has_res:
                out[0, 0, row0 + tx] = T.Cast("float16", gsum[0]) + r[0, 0, row0 + tx]
            else:
                out[0, 0, row0 + tx] = T.Cast("float16", gsum[0])

    return kernel


def _epilogue(
    T: Any, out: Any, b: Any, r: Any, row: Any, value: Any, out_f32: bool, has_bias: bool, has_res: bool
):
    """The store of one output row: float32 as is; float16 with the bias before the cast and the
    residual after it (TVM's ``dequant_matmul_out`` and ``T_add``)."""
    if out_f32:
        return value
    if has_bias:
        value = value + T.Cast("float32", b[row])
    value = T.Cast("float16", value)
    return value + r[0, 0, row] if has_res else value


def dp4a_kernel(
    m: Q4MatmulMatch,
    layout: Q4GemvLayout,
    out_dtype: str,
    norm_eps: float | None = None,
    silu_pairs: bool = False,
    q8: str = "",
    q8_out: bool = False,
    norm_out: bool = False,
    read_norm: float | None = None,
    norm_out_par: bool = False,
) -> Any:
    """:func:`gemv_kernel` with the activations quantized to int8 (a scale per 32 values, as
    llama.cpp's q8_1) once per workgroup into workgroup memory, and the 4-bit weights multiplied
    four at a time by WGSL's ``dot4I8Packed``: two masks and two integer dot products per word of
    8 weights. ``dp4a``: one int8 level, whose rounding (up to half a step of max|x| / 127 per
    value) is the difference from the float kernels; ``dp4a2``: the rounding's remainder as a
    second int8 level (steps of max|x| / 127 / 254), two more dot products per word, and an error
    below float16's own.

    Two kernels of a decode layer fold into it (:mod:`.wgsl_fusion`, one dispatch instead of two):

    - ``norm_eps``: the GEMV's input is TVM's RMSNorm of ``x`` with weight ``nw`` (parameter
      after ``x``): every workgroup sums ``x^2`` (its threads, then 16 partial sums, two
      barriers) and stages ``half(rsqrt(sum / K + eps) * x * nw)``, TVM's arithmetic;
    - ``silu_pairs``: the ``n`` rows are ``gate`` (the first half) and ``up``; each set computes
      ``rows / 2`` gate rows and the matching up rows and writes ``silu(gate) * up`` in float16,
      TVM's arithmetic, into an output of ``n / 2``.

    ``q8`` splits the kernel in two at the staging (the vector quantized once per step instead of
    once per workgroup, :func:`q8_norm` / :func:`fused_gemv`): ``"stage"`` is the prologue alone
    (the RMSNorm with ``norm_eps``, the quantization) in one workgroup, writing the quantized
    vector into the global ``qg`` (:func:`q8_words`); ``"read"`` is the GEMV alone, each lane
    reading its groups' words, scale and sum from ``qg`` (no staging, no barrier before the dot
    products). ``dp4a`` only.

    ``q8_out`` (with ``silu_pairs``, a workgroup's outputs one 32-value group: ``rows / 2 x sets``
    = 32): the gated output is written quantized (:func:`q8_words` of ``n / 2`` values) for the
    down projection to read with ``q8="read"`` instead of quantizing it in each of its workgroups:
    the workgroup's 32 float16 values meet in workgroup memory and one thread quantizes them as the
    staging would (the same :func:`quantize` arithmetic on the same float16 values).

    The RMSNorm after a GEMV, without a kernel of its own (``norm_out`` and ``read_norm``): a
    norm's ``rsqrt(mean(x^2) + eps)`` is one number for the whole row, and the int8 rounding of a
    group of values does not change when they are all multiplied by one number. So the GEMV
    producing ``x`` (a workgroup's 16 rows one half group, float16 output) also writes ``x * w``
    (``nw2``, the norm's weight) quantized with a scale per 16 values and each half group's sum of
    ``x^2`` (``qo``, :func:`q8n_words`), and each GEMV after the norm (``q8="read"`` with
    ``read_norm`` = the norm's eps) reads those words (two scales a 32-value group of weights),
    sums the squares (16 threads at its start, all of them after its last barrier) and multiplies
    its dot products by the norm's scale before its epilogue. ``norm_out_par``: after the
    barrier, threads 0-3 each pack one of the half group's four words, thread ``lanes`` its int8
    sum and thread ``2 * lanes`` its sum of squares and scale (each from the 16 values in
    workgroup memory, the same arithmetic as thread 0 alone)."""
    from tvm.script import tirx as T

    from app.inference.pipelines.wgsl_vector_params import install

    install()  # the weights' 16-byte loads (and the vector's 8-byte ones) as one load each

    k, n = m.in_features, m.out_features
    stage_only, read_q8 = q8 == "stage", q8 == "read"
    has_norm = norm_eps is not None
    eps = float(norm_eps or 0.0)
    half = layout.rows // 2
    n_out = n // 2 if silu_pairs else n
    red_lanes = 16  # the norm's second level: partial sums of threads / 16 threads each
    rows, lanes, sets, threads = layout.rows, layout.lanes, layout.sets, layout.threads
    levels = 2 if layout.decode == "dp4a2" else 1
    groups = k // 32
    iters = -(-groups // lanes)
    stage_iters = -(-groups // threads)
    padded = stage_iters * threads
    staged = 1 if read_q8 else padded  # the vector's slots in workgroup memory
    has_bias, has_res = m.bias is not None, m.residual is not None
    blocks = 1 if stage_only else n // layout.rows_per_workgroup
    out_f32 = out_dtype == "float32"
    words = q8n_words(k) if read_norm is not None else q8_words(k)
    if q8_out and not (silu_pairs and half * sets == 32 and levels == 1 and q8 != "stage"):
        raise ValueError("q8_out needs SiLU pairs, 32 outputs a workgroup and one int8 level")
    if norm_out and (
        silu_pairs or out_dtype != "float16" or rows * sets != 16 or levels != 1 or q8 == "stage"
    ):
        raise ValueError("norm_out needs a float16 output, 16 rows a workgroup and one int8 level")
    if read_norm is not None and (q8 != "read" or levels != 1):
        raise ValueError("read_norm reads the words of a norm's vector (q8='read', one int8 level)")
    # read_norm: the half groups' sums of squares, summed by red_lanes threads, per_thread each
    per_thread = -(-(2 * groups) // red_lanes)
    out_groups = n_out // 32
    out_shape, out_dt = ((q8_words(n_out),), "uint32") if q8_out else ((1, 1, n_out), out_dtype)
    rn_eps = float(read_norm or 0.0)
    fine = float(2 * 127)  # the second level's steps per first-level step
    # steps loaded before the staging, and register sets of weights (this step's and those ahead)
    pre = 1 if layout.prefetch else max(1, min(layout.preload, iters))
    slots = 2 if layout.prefetch else pre

    @T.macro
    def load_step(wq, sc, w, s, row0, g0, tx, step):
        # step ``step``'s weight words and scales of the set's rows (DRAM) into register slot
        # ``step % slots``
        for rr in T.unroll(rows):
            wq[T.ramp((step % slots * rows + rr) * 4, 1, 4)] = w.vload(
                [_row(silu_pairs, row0, g0, rr, half, n), T.min(tx + step * lanes, groups - 1) * 4],
                "uint32x4",
            )
            sc[step % slots * rows + rr] = s[
                _row(silu_pairs, row0, g0, rr, half, n), T.min(tx + step * lanes, groups - 1)
            ]

    @T.macro
    def load_group(xh, src, g):
        # the 32 float16 values of group g of the vector ``x`` or the norm's weight, 4 a load
        # (8 loads of 8 bytes, not 32 of 2: .wgsl_vector_params)
        for v in T.unroll(8):
            if len(src.shape) == 3:
                xh[T.ramp(v * 4, 1, 4)] = src.vload([0, 0, g * 32 + v * 4], "float16x4")
            else:
                xh[T.ramp(v * 4, 1, 4)] = src.vload([g * 32 + v * 4], "float16x4")

    def gated(g: Any, u: Any) -> Any:
        # TVM's SiLU gate of a gate row's sum and its up row's, in float16
        return T.Cast("float16", g) * T.sigmoid(T.Cast("float16", g)) * T.Cast("float16", u)

    @T.macro
    def quantize(xv, amax, qv, qsum):
        # 32 values (float32 of float16) with their max |x| to int8 steps of max|x| / 127 (and the
        # remainder's level with dp4a2), and the sum of each level's int8 values
        for lv in T.unroll(levels):
            qsum[lv] = 0
        for j in T.unroll(32):
            xv[j] = xv[j] * T.if_then_else(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))
            qv[j] = T.Cast("int32", T.round(xv[j]))
            qsum[0] = qsum[0] + qv[j]
            if levels == 2:
                qv[32 + j] = T.Cast("int32", T.round((xv[j] - T.Cast("float32", qv[j])) * T.float32(fine)))
                qsum[1] = qsum[1] + qv[32 + j]

    @T.macro
    def pack(qv, pk, lv):
        # level lv's 32 int8 values as 8 words: per 8-value word q the even values (0, 2, 4, 6)
        # in word 2q and the odd ones in word 2q + 1 (the nibble order of the weight words)
        for q in T.unroll(4):
            for o in T.unroll(2):
                pk[q * 2 + o] = (
                    (T.Cast("uint32", qv[lv * 32 + q * 8 + o]) & T.uint32(255))
                    | ((T.Cast("uint32", qv[lv * 32 + q * 8 + o + 2]) & T.uint32(255)) << T.uint32(8))
                    | ((T.Cast("uint32", qv[lv * 32 + q * 8 + o + 4]) & T.uint32(255)) << T.uint32(16))
                    | ((T.Cast("uint32", qv[lv * 32 + q * 8 + o + 6]) & T.uint32(255)) << T.uint32(24))
                )

    @T.prim_func(private=True)
    def kernel(
        x: T.Buffer((1, 1, k), "float16"),
        nw: T.Buffer((k,), "float16"),
        w: T.Buffer((n, k // 8), "uint32"),
        s: T.Buffer((n, groups), "float16"),
        b: T.Buffer((n,), "float16"),
        r: T.Buffer((1, 1, n), "float16"),
        out: T.Buffer(out_shape, out_dt),
        qg: T.Buffer((words,), "uint32"),
        nw2: T.Buffer((n,), "float16"),
        qo: T.Buffer((q8n_words(n),), "uint32"),
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", blocks)
        ty = T.launch_thread("threadIdx.y", sets)
        tx = T.launch_thread("threadIdx.x", lanes)
        # the norm's partial sums of squares (threads, then 16) and its scale
        red = T.decl_buffer((threads,), "float32", scope="shared")
        red2 = T.decl_buffer((red_lanes,), "float32", scope="shared")
        ss = T.decl_buffer((1,), "float32", scope="local")
        xr = T.decl_buffer((stage_iters * 32 if has_norm else 1,), "float32", scope="local")
        usum = T.decl_buffer((1,), "float32", scope="local")
        # the quantized activations, per group and level: two vec4 words of int8 (even / odd
        # values of each 8-value word interleaved) and the sum of the quantized values; the scale
        xq = T.decl_buffer((staged * 2 * levels,), "uint32x4", scope="shared")
        xd = T.decl_buffer((staged,), "float32", scope="shared")
        xs = T.decl_buffer((staged * levels,), "int32", scope="shared")
        part = T.decl_buffer((sets * rows * lanes,), "float32", scope="shared")
        xv = T.decl_buffer((32,), "float32", scope="local")
        qv = T.decl_buffer((32 * levels,), "int32", scope="local")
        pk = T.decl_buffer((8,), "uint32", scope="local")
        amax = T.decl_buffer((1,), "float32", scope="local")
        qsum = T.decl_buffer((levels,), "int32", scope="local")
        acc = T.decl_buffer((rows,), "float32", scope="local")
        wq = T.decl_buffer((slots * rows * 4,), "uint32", scope="local")
        sc = T.decl_buffer((slots * rows,), "float16", scope="local")
        xw = T.decl_buffer((8 * levels,), "uint32", scope="local")
        isum = T.decl_buffer((levels,), "int32", scope="local")
        gsum = T.decl_buffer((1,), "float32", scope="local")
        ov = T.decl_buffer((1,), "float16", scope="local")
        pp = T.decl_buffer((1,), "float32", scope="local")
        ih = T.decl_buffer((2,), "int32", scope="local")
        hs = T.decl_buffer((2,), "float32", scope="local")
        xh = T.decl_buffer((32,), "float16", scope="local")  # a group of the vector or norm weight
        row0 = (bx * sets + ty) * rows
        # set row rr: rows row0 + rr, or with silu_pairs gate rows g0 + rr (rr < half) and the
        # matching up rows n / 2 + g0 + rr - half
        g0 = (bx * sets + ty) * half
        tid = ty * lanes + tx
        # the first ``pre`` steps' weights (DRAM) go out before the staging
        if not stage_only:
            for p0 in T.unroll(pre):
                load_step(wq, sc, w, s, row0, g0, tx, p0)
        if read_norm is not None:  # noqa: SIM102 (a Python switch around a TIR condition)
            # the norm's sum of squares: red_lanes threads each sum per_thread half groups' now
            # (their loads overlap the dot products), everyone sums those after the last barrier
            if tid < red_lanes:
                pp[0] = T.float32(0)
                for i in T.unroll(per_thread):
                    pp[0] = pp[0] + T.if_then_else(
                        tid * per_thread + i < 2 * groups,
                        T.reinterpret(
                            "float32", qg[groups * 12 + T.min(tid * per_thread + i, 2 * groups - 1)]
                        ),
                        T.float32(0),
                    )
        if not read_q8:
            if has_norm:
                ss[0] = T.float32(0)
                for st in T.unroll(stage_iters):
                    load_group(xh, x, T.min(tid + st * threads, groups - 1))
                    for j in T.unroll(32):
                        # the thread's values stay in registers for the staging below
                        xr[st * 32 + j] = T.Cast("float32", xh[j])
                        ss[0] = ss[0] + T.if_then_else(
                            tid + st * threads < groups, xr[st * 32 + j] * xr[st * 32 + j], T.float32(0)
                        )
                red[tid] = ss[0]
                T.tvm_storage_sync("shared")
                if tid < red_lanes:
                    ss[0] = T.float32(0)
                    for i in T.unroll(threads // red_lanes):
                        ss[0] = ss[0] + red[tid * (threads // red_lanes) + i]
                    red2[tid] = ss[0]
                T.tvm_storage_sync("shared")
                ss[0] = T.float32(0)
                for i in T.unroll(red_lanes):
                    ss[0] = ss[0] + red2[i]
                ss[0] = T.rsqrt(ss[0] / T.float32(k) + T.float32(eps))
            for st in T.unroll(stage_iters):
                amax[0] = T.float32(0)
                if has_norm:
                    load_group(xh, nw, T.min(tid + st * threads, groups - 1))
                else:
                    load_group(xh, x, T.min(tid + st * threads, groups - 1))
                for j in T.unroll(32):
                    if has_norm:
                        xv[j] = T.Cast(
                            "float32",
                            T.Cast("float16", ss[0] * xr[st * 32 + j] * T.Cast("float32", xh[j])),
                        )
                    else:
                        xv[j] = T.Cast("float32", xh[j])
                    amax[0] = T.max(amax[0], T.fabs(xv[j]))
                quantize(xv, amax, qv, qsum)
                for lv in T.unroll(levels):
                    pack(qv, pk, lv)
                    if stage_only:
                        if tid + st * threads < groups:
                            qg[T.ramp((tid + st * threads) * 8, 1, 4)] = pk.vload([0], "uint32x4")
                            qg[T.ramp((tid + st * threads) * 8 + 4, 1, 4)] = pk.vload([4], "uint32x4")
                            qg[groups * 9 + tid + st * threads] = T.reinterpret("uint32", qsum[lv])
                    else:
                        xq[((tid + st * threads) * levels + lv) * 2] = pk.vload([0], "uint32x4")
                        xq[((tid + st * threads) * levels + lv) * 2 + 1] = pk.vload([4], "uint32x4")
                        xs[(tid + st * threads) * levels + lv] = qsum[lv]
                if stage_only:
                    if tid + st * threads < groups:
                        qg[groups * 8 + tid + st * threads] = T.reinterpret(
                            "uint32", amax[0] / T.float32(127)
                        )
                else:
                    xd[tid + st * threads] = amax[0] / T.float32(127)
            if not stage_only:
                T.tvm_storage_sync("shared")
        if not stage_only:
            for rr in T.unroll(rows):
                acc[rr] = T.float32(0)
            for it in T.unroll(iters):
                # this step's weights are in slot ``cur``; the load below fetches step ``ld`` (the
                # next one with prefetch, ``pre - 1`` ahead with preload, else this one; the first
                # ``pre`` steps went out before the staging)
                cur = (it % slots) * rows
                ld = it + slots - 1
                if ld >= pre and ld < iters:
                    load_step(wq, sc, w, s, row0, g0, tx, ld)
                for lv in T.unroll(levels):
                    if read_q8:
                        xw[T.ramp(0, 1, 4)] = qg.vload([T.min(tx + it * lanes, groups - 1) * 8], "uint32x4")
                        xw[T.ramp(4, 1, 4)] = qg.vload(
                            [T.min(tx + it * lanes, groups - 1) * 8 + 4], "uint32x4"
                        )
                    else:
                        xw[T.ramp(lv * 8, 1, 4)] = xq[(T.min(tx + it * lanes, groups - 1) * levels + lv) * 2]
                        xw[T.ramp(lv * 8 + 4, 1, 4)] = xq[
                            (T.min(tx + it * lanes, groups - 1) * levels + lv) * 2 + 1
                        ]
                if read_norm is not None:
                    # the group's two half-group scales
                    hs[T.ramp(0, 1, 2)] = T.reinterpret(
                        "float32x2",
                        qg.vload([groups * 8 + T.min(tx + it * lanes, groups - 1) * 2], "uint32x2"),
                    )
                for rr in T.unroll(rows):
                    if read_norm is not None:
                        for hh in T.unroll(2):
                            ih[hh] = 0
                            for q2 in T.unroll(2):
                                ih[hh] = ih[hh] + _dot8(
                                    T, wq[(cur + rr) * 4 + hh * 2 + q2], xw, (hh * 2 + q2) * 2
                                )
                            ih[hh] = ih[hh] - 7 * T.reinterpret(
                                "int32", qg[groups * 10 + T.min(tx + it * lanes, groups - 1) * 2 + hh]
                            )
                        acc[rr] = acc[rr] + T.if_then_else(
                            tx + it * lanes < groups,
                            (T.Cast("float32", ih[0]) * hs[0] + T.Cast("float32", ih[1]) * hs[1])
                            * T.Cast("float32", sc[cur + rr]),
                            T.float32(0),
                        )
                    else:
                        for lv in T.unroll(levels):
                            isum[lv] = 0
                            for q in T.unroll(4):
                                isum[lv] = isum[lv] + _dot8(T, wq[(cur + rr) * 4 + q], xw, lv * 8 + q * 2)
                        gsum[0] = T.Cast(
                            "float32",
                            isum[0]
                            - 7
                            * _staged(
                                T,
                                read_q8,
                                qg,
                                groups * 9,
                                xs,
                                T.min(tx + it * lanes, groups - 1),
                                levels,
                                "int32",
                            ),
                        )
                        if levels == 2:
                            gsum[0] = gsum[0] + T.Cast(
                                "float32", isum[1] - 7 * xs[T.min(tx + it * lanes, groups - 1) * levels + 1]
                            ) * T.float32(1 / fine)
                        acc[rr] = acc[rr] + T.if_then_else(
                            tx + it * lanes < groups,
                            gsum[0]
                            * (
                                T.Cast("float32", sc[cur + rr])
                                * _staged(
                                    T,
                                    read_q8,
                                    qg,
                                    groups * 8,
                                    xd,
                                    T.min(tx + it * lanes, groups - 1),
                                    1,
                                    "float32",
                                )
                            ),
                            T.float32(0),
                        )
            for rr in T.unroll(rows):
                part[(ty * rows + rr) * lanes + tx] = acc[rr]
            if read_norm is not None:  # noqa: SIM102 (a Python switch around a TIR condition)
                if tid < red_lanes:
                    red2[tid] = pp[0]
            T.tvm_storage_sync("shared")
            if read_norm is not None:
                ss[0] = T.float32(0)
                for i in T.unroll(red_lanes):
                    ss[0] = ss[0] + red2[i]
                ss[0] = T.rsqrt(ss[0] / T.float32(k) + T.float32(rn_eps))
            if silu_pairs:
                # lane l < half: gate row l of the set and its up row (half + l)
                gsum[0] = T.float32(0)
                usum[0] = T.float32(0)
                for ln in T.unroll(lanes):
                    gsum[0] = gsum[0] + part[(ty * rows + tx % half) * lanes + ln]
                    usum[0] = usum[0] + part[(ty * rows + half + tx % half) * lanes + ln]
                if read_norm is not None:
                    gsum[0] = gsum[0] * ss[0]
                    usum[0] = usum[0] * ss[0]
                if q8_out:
                    # the workgroup's 32 gated values (float16, as written unquantized) meet in
                    # workgroup memory (the norm's, free by now); thread 0 quantizes them as the
                    # staging does
                    if tx < half:
                        red[ty * half + tx] = T.Cast("float32", gated(gsum[0], usum[0]))
                    T.tvm_storage_sync("shared")
                    if tid == 0:
                        amax[0] = T.float32(0)
                        for j in T.unroll(32):
                            xv[j] = red[j]
                            amax[0] = T.max(amax[0], T.fabs(xv[j]))
                        quantize(xv, amax, qv, qsum)
                        pack(qv, pk, 0)
                        out[T.ramp(bx * 8, 1, 4)] = pk.vload([0], "uint32x4")
                        out[T.ramp(bx * 8 + 4, 1, 4)] = pk.vload([4], "uint32x4")
                        out[out_groups * 8 + bx] = T.reinterpret("uint32", amax[0] / T.float32(127))
                        out[out_groups * 9 + bx] = T.reinterpret("uint32", qsum[0])
                elif tx < half:
                    out[0, 0, g0 + tx] = gated(gsum[0], usum[0])
            else:
                gsum[0] = T.float32(0)
                for ln in T.unroll(lanes):
                    gsum[0] = gsum[0] + part[(ty * rows + tx % rows) * lanes + ln]
                if read_norm is not None:
                    gsum[0] = gsum[0] * ss[0]
                if tx < rows:
                    if norm_out:
                        ov[0] = _epilogue(T, out, b, r, row0 + tx, gsum[0], out_f32, has_bias, has_res)
                        out[0, 0, row0 + tx] = ov[0]
                        # x * w and x^2 of the workgroup's 16 rows (half group bx) meet in
                        # workgroup memory (the norm's, free by now)
                        red[ty * rows + tx] = T.Cast("float32", ov[0]) * T.Cast("float32", nw2[row0 + tx])
                        red[16 + ty * rows + tx] = T.Cast("float32", ov[0]) * T.Cast("float32", ov[0])
                    else:
                        out[0, 0, row0 + tx] = _epilogue(
                            T, out, b, r, row0 + tx, gsum[0], out_f32, has_bias, has_res
                        )
                if norm_out and norm_out_par:
                    T.tvm_storage_sync("shared")
                    if tid < 4 or tid == lanes or tid == 2 * lanes:
                        amax[0] = T.float32(0)
                        for j in T.unroll(16):
                            amax[0] = T.max(amax[0], T.fabs(red[j]))
                        pp[0] = T.if_then_else(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))
                    if tid < 4:
                        # word w = bx % 2 * 4 + tid of the group packs its values (w // 2) * 8 + w % 2
                        # + 0, 2, 4, 6: in this half group tid // 2 * 8 + tid % 2 + 0, 2, 4, 6
                        pk[0] = T.uint32(0)
                        for b4 in T.unroll(4):
                            pk[0] = pk[0] | (
                                (
                                    T.Cast(
                                        "uint32",
                                        T.Cast(
                                            "int32", T.round(red[tid // 2 * 8 + tid % 2 + 2 * b4] * pp[0])
                                        ),
                                    )
                                    & T.uint32(255)
                                )
                                << T.uint32(8 * b4)
                            )
                        qo[bx // 2 * 8 + bx % 2 * 4 + tid] = pk[0]
                    if tid == lanes:
                        qsum[0] = 0
                        for j in T.unroll(16):
                            qsum[0] = qsum[0] + T.Cast("int32", T.round(red[j] * pp[0]))
                        qo[out_groups * 10 + bx] = T.reinterpret("uint32", qsum[0])
                    if tid == 2 * lanes:
                        qo[out_groups * 8 + bx] = T.reinterpret("uint32", amax[0] / T.float32(127))
                        gsum[0] = T.float32(0)
                        for j in T.unroll(16):
                            gsum[0] = gsum[0] + red[16 + j]
                        qo[out_groups * 12 + bx] = T.reinterpret("uint32", gsum[0])
                elif norm_out:
                    T.tvm_storage_sync("shared")
                    if tid == 0:
                        # the half group's 16 values in their half of a 32-value group (zeros in
                        # the other), quantized and packed as the staging does; its 4 words
                        amax[0] = T.float32(0)
                        for j in T.unroll(32):
                            xv[j] = T.if_then_else(j // 16 == bx % 2, red[j % 16], T.float32(0))
                            amax[0] = T.max(amax[0], T.fabs(xv[j]))
                        quantize(xv, amax, qv, qsum)
                        pack(qv, pk, 0)
                        for e in T.unroll(4):
                            qo[bx // 2 * 8 + bx % 2 * 4 + e] = T.if_then_else(bx % 2 == 0, pk[e], pk[4 + e])
                        qo[out_groups * 8 + bx] = T.reinterpret("uint32", amax[0] / T.float32(127))
                        qo[out_groups * 10 + bx] = T.reinterpret("uint32", qsum[0])
                        gsum[0] = T.float32(0)
                        for j in T.unroll(16):
                            gsum[0] = gsum[0] + red[16 + j]
                        qo[out_groups * 12 + bx] = T.reinterpret("uint32", gsum[0])

    return kernel


def _dot8(T: Any, word: Any, xw: Any, at: Any) -> Any:
    """The int8 dot product of a weight word's 8 nibbles (low nibbles, then high ones: two
    ``dot4I8Packed``) with the activation words ``xw[at]`` (even values) and ``xw[at + 1]`` (odd)."""
    nib = T.uint32(0x0F0F0F0F)
    return T.call_pure_extern("int32", "dot4I8Packed", word & nib, xw[at]) + T.call_pure_extern(
        "int32", "dot4I8Packed", (word >> T.uint32(4)) & nib, xw[at + 1]
    )


#: the parameters of :func:`dp4a_kernel`, in order
_DP4A_ROLES = ("x", "nw", "w", "s", "b", "r", "out", "q", "nw2", "qo")


def _staged(T: Any, read_q8: bool, qg: Any, offset: int, shared: Any, g: Any, stride: int, dtype: str) -> Any:
    """Group ``g``'s sum (``int32``) or scale (``float32``) of the quantized vector: from the global
    words ``qg`` at ``offset`` (``q8="read"``), else from workgroup memory."""
    if read_q8:
        return T.reinterpret(dtype, qg[offset + g])
    return shared[g * stride] if stride != 1 else shared[g]


def _row(silu_pairs: bool, row0: Any, g0: Any, rr: Any, half: int, n: int) -> Any:
    """The weight row of a set's row ``rr``: ``row0 + rr``; with SiLU pairs the gate rows
    ``g0 + rr`` (``rr < half``), then their up rows ``n / 2 + g0 + rr - half``."""
    if not silu_pairs:
        return row0 + rr
    return g0 + rr % half + (rr // half) * (n // 2)


def build(func: Any, m: Q4MatmulMatch, layout: Q4GemvLayout) -> Any | None:
    """``func`` (the matched GEMV) as :func:`gemv_kernel`, with ``func``'s parameters in its order;
    None when its buffers are not 3-D ``[1, 1, .]`` rows."""

    for buf in (m.x, m.out, m.residual):
        if buf is not None and (static_shape(buf) or [0])[:-1] != [1, 1]:
            return None
    if layout.decode.startswith("dp4a"):
        new = dp4a_kernel(m, layout, str(m.out.dtype))
        roles = dict(zip(_DP4A_ROLES, new.params, strict=True))
    else:
        new = gemv_kernel(m, layout, str(m.out.dtype))
        roles = dict(zip(("x", "w", "s", "b", "r", "out"), new.params, strict=True))
    return in_params_order(func, m, new, roles)


def in_params_order(func: Any, m: Q4MatmulMatch, new: Any, roles: dict[str, Any]) -> Any:
    """``new`` with the parameters ``roles`` names (x, w, s, b, r, out) in ``func``'s order: the
    roles ``m`` lacks are dropped."""
    from tvm import tirx

    old_roles = {"x": m.x, "w": m.weight, "s": m.scale, "b": m.bias, "r": m.residual, "out": m.out}
    params = []
    for p in func.params:
        role = next(name for name, b in old_roles.items() if b is not None and b.same_as(p))
        params.append(roles[role])
    return tirx.PrimFunc(params, new.body, new.ret_type, new.attrs)


#: workgroup memory the RMSNorm prologue adds (:func:`dp4a_kernel`): the threads' partial sums of
#: squares and 16 second-level sums, float32
def norm_shared_bytes(layout: Q4GemvLayout) -> int:
    return 4 * (layout.threads + 16)


def fused_gemv(
    gemv: Any,
    norm_eps: float | None,
    silu_out: Any | None,
    max_shared: int,
    q8: bool = False,
    q8_out: bool = False,
    norm_out: bool = False,
    read_norm: float | None = None,
) -> Any | None:
    """The GEMV ``gemv`` as one int8 kernel (:func:`dp4a_kernel` in :func:`choose`'s layout) that
    also computes its input's RMSNorm (``norm_eps``) and/or the SiLU gate of its output
    (``silu_out``: the ``[1, 1, n / 2]`` float16 buffer the gate kernel wrote). Parameters:
    ``gemv``'s in its order, its vector replaced by (``x``, the norm's weight) with the norm, its
    output by ``silu_out`` with the gate. None where the kernel does not take the GEMV (not a
    batch-1 q4f16_1 GEMV, K over :data:`MAX_K`, rows it does not tile, a gate after a bias or a
    residual, over ``max_shared``): the kernels stay apart.

    ``q8``: the GEMV reads its vector already quantized (``q8="read"`` of :func:`dp4a_kernel`, the
    words :func:`q8_norm` writes) in place of ``x``; no norm then. ``q8_out`` (with the gate): the
    gated output written quantized, ``q8_words(n / 2)`` uint32 words in place of ``silu_out``, for a
    down projection built with ``q8`` to read.

    ``norm_out`` (a float16 output, no gate): the GEMV also writes its output quantized for the
    RMSNorm after it (:func:`q8n_words` of ``n``; parameters the norm's weight, then the output,
    then those words), in :func:`choose`'s 16-row layout. ``read_norm`` (with ``q8``): the vector
    read is such words and the norm's eps; the GEMV applies the norm's scale itself."""
    from tvm import tirx

    m = match_q4f16_gemv(gemv)
    if m is None:
        return None
    for buf in (m.x, m.out, m.residual):
        if buf is not None and (static_shape(buf) or [0])[:-1] != [1, 1]:
            return None
    pairs = silu_out is not None
    if pairs and (
        m.bias is not None
        or m.residual is not None
        or str(m.out.dtype) != "float16"
        or str(silu_out.dtype) != "float16"
        or (static_shape(silu_out) or [0])[-1] * 2 != m.out_features
    ):
        return None
    if (q8 and norm_eps is not None) or (q8_out and not pairs):
        return None
    if norm_out and (pairs or str(m.out.dtype) != "float16" or m.out_features % 32):
        return None
    if read_norm is not None and not q8:
        return None
    probe = Q4GemvLayout(4, 32, 256, "dp4a")
    # the norm's partial sums (also where q8_out's values meet)
    extra = norm_shared_bytes(probe) if norm_eps is not None or q8_out else 0
    if read_norm is not None or norm_out:  # the groups' squares or the output's 32 values
        extra = norm_shared_bytes(probe)
    layout = choose(
        m.in_features, m.out_features, max_shared - extra, pairs=pairs, group_out=q8_out or norm_out
    )
    if layout is None:
        return None
    new = dp4a_kernel(
        m,
        layout,
        str(m.out.dtype),
        norm_eps=norm_eps,
        silu_pairs=pairs,
        q8="read" if q8 else "",
        q8_out=q8_out,
        norm_out=norm_out,
        read_norm=read_norm,
        norm_out_par=norm_out and norm_out_parallel(),
    )
    roles = dict(zip(_DP4A_ROLES, new.params, strict=True))
    old_roles = {"w": m.weight, "s": m.scale, "b": m.bias, "r": m.residual}
    params = []
    for p in gemv.params:
        if p.same_as(m.x):
            params += (
                [roles["q"]] if q8 else [roles["x"], roles["nw"]] if norm_eps is not None else [roles["x"]]
            )
        elif p.same_as(m.out):
            continue
        else:
            params.append(
                roles[next(name for name, b in old_roles.items() if b is not None and b.same_as(p))]
            )
    params += [roles["nw2"], roles["out"], roles["qo"]] if norm_out else [roles["out"]]
    return tirx.PrimFunc(params, new.body, new.ret_type, new.attrs)


def q8_norm(k: int, norm_eps: float) -> Any:
    """TVM's RMSNorm of a float16 ``[1, 1, k]`` row with its weight, quantized to int8 as the int8
    kernel stages it, in one 256-thread workgroup: parameters (x, the norm's weight, the
    :func:`q8_words` output). The GEMVs after it read it with :func:`fused_gemv`'s ``q8``, so the
    vector is normalized and quantized once per step rather than in each of their workgroups."""
    from tvm import tirx

    from app.inference.pipelines.cuda_gemv import Q4MatmulMatch

    x = tirx.decl_buffer((1, 1, k), "float16", name="x")
    match = Q4MatmulMatch(
        x=x, weight=x, scale=x, bias=None, residual=None, out=x, in_features=k, out_features=32
    )
    new = dp4a_kernel(match, Q4GemvLayout(1, 32, 256, "dp4a"), "float16", norm_eps=norm_eps, q8="stage")
    x_, nw, *_, q, _nw2, _qo = new.params
    return tirx.PrimFunc([x_, nw, q], new.body, new.ret_type, new.attrs)


class WgslQ4Gemv(WebGPUKernelRule):
    """Batch-1 q4f16_1 GEMVs on WebGPU -> :func:`build` in ``layout`` (where it tiles the rows, for
    ``min_rows`` output rows or more and a reduction of ``max_reduction`` or less); with no layout,
    the one :func:`choose` picks for each shape."""

    def __init__(self, layout: Q4GemvLayout | None, min_rows: int = 0, max_reduction: int = 1 << 30) -> None:
        self.layout = layout
        self.min_rows = min_rows
        self.max_reduction = max_reduction

    def kernel(self, func: Any, max_shared: int = 1 << 30) -> Any | None:
        m = match_q4f16_gemv(func)
        if m is None or m.out_features < self.min_rows or m.in_features > self.max_reduction:
            return None
        layout = self.layout or choose(m.in_features, m.out_features, max_shared)
        if layout is None or not layout.fits(m.out_features, m.in_features):
            return None
        if layout.decode.startswith("dp4a") and shared_bytes(layout, m.in_features) > max_shared:
            return None
        return build(func, m, layout)
