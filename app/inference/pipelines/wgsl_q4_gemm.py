"""A hand-scheduled q4f16_1 prompt GEMM for WGSL (WebGPU/Vulkan): ``out[t, f] = x[t, :] . W[f, :]``
for a prompt of ``n`` tokens, written as TIR that TVM's WebGPU code generator lowers.

Rule :class:`WgslQ4Gemm` takes the prompt-sized ``q4f16_1`` matmuls that
:func:`.cuda_gemm.match_q4f16_gemm` recognises (a ``dequantize`` stage, the fp32 reduction, and
decode's epilogues) with a float16 output (an optional bias before the cast, an optional residual
after it) and gives them a new body. :class:`.gpu_gemm.WgslGemm` (a dlight-style
schedule) keeps every other prompt matmul (unquantized weights, q4f32_1).

Why a second GEMM: the scheduled one reads its tiles from workgroup memory one float at a time
(16 loads for 64 FMAs a step, as many load instructions as the FMAs' issue slots) and stalls on
every step's global loads (two barriers, nothing in flight). Here:

- a workgroup of 16 x 16 threads computes a ``16 mf`` features x ``16 mt`` tokens tile
  (:class:`GemmTile`); each thread owns ``mt x mf`` fp32 accumulators;
- a K step is one quantization group (32 values): the weight tile (one 4-byte word and one scale
  per feature and 8 values) is decoded into workgroup memory laid out ``[k][feature]``, the
  activation tile to ``[k][token]``; a thread stores whole ``vec4``s (four features or four
  tokens of one k), so both arrays become ``array<vec4<f32>>`` in the WGSL;
- a thread's features are ``4 tx + j`` and ``64 + 4 tx + j`` (tokens likewise with ``ty``), so per
  k it reads its 8 activations and 8 weights as four ``vec4`` loads for 64 FMAs; neighbouring
  threads read neighbouring words (no bank conflicts);
- the next step's words, scales and activations are loaded into registers before this step's
  FMAs (a register prefetch), so global latency overlaps the arithmetic;
- the epilogue writes four features a store (``vec4<f16>``), residual and bias read alike.

On the H200 (NVIDIA's Vulkan driver, session 23): Llama-2-7B's 512-token prompt 928 → 1,595
tok/s with this GEMM alone, its four GEMMs at 26–30 TFLOPS (40–45 % of the fp32 FMA rate;
BENCHMARKS.md). The decoded weight is ``(q - 7) * scale`` in fp32 (exact), what the scheduled
GEMM computes after dropping the fp16 round trip; sums are fp32 throughout.

**fp16 arithmetic** (``GemmTile.half``, ``LLMCHAT_WGSL_GEMM=f16``; tested on lavapipe, not yet
measured on a GPU, so not the default): the weight is decoded as the model's dequantize stage
does, ``(q - 7) * scale`` in fp16; both tiles are staged as ``vec4<f16>`` (half the workgroup
memory: 128 x 128 tiles fit WebGPU's default 16 KiB); the multiply-adds are ``vec4<f16>`` FMAs
(two packed fp16 FMAs each on NVIDIA and RDNA, twice their fp32 rate) into a step's fp16 sums,
added to the fp32 accumulators at the end of every step, so no fp16 sum spans more than one
group's 32 products. (llama.cpp's Vulkan GEMM of quantized weights sums all of K in fp16 on a
device with fp16 and no matrix cores or integer dot products: ``ggml_vk_get_mul_mat_mat_f16acc``.)
The cost, against float64 on lavapipe (the tests): 0.6–2.1e-3 of the largest output (the most
at K = 4,096 with a few activations 300 times the rest) where fp32 sums give 1.9–4.5e-4.

``LLMCHAT_WGSL_GEMM=tiled`` keeps the scheduled GEMM for these too (A/B), ``=tvm`` dlight's
Matmul (:func:`.gpu_choices.use_wgsl_gemm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.cuda_gemm import match_q4f16_gemm
from app.inference.pipelines.cuda_gemv import Q4MatmulMatch
from app.inference.pipelines.tir_facts import WebGPUKernelRule
from app.inference.pipelines.wgsl_q4_gemv import in_params_order

#: values a K step (one q4f16_1 group: 4 words of a row, one scale)
STEP = 32
#: threads along the features (x) and the tokens (y)
THREADS = 16
#: rows a prompt chunk is assumed to have when choosing a tile
ASSUMED_ROWS = 512
#: fewest workgroups a tile should leave for an assumed chunk (2 a multiprocessor of a 132-SM GPU)
MIN_WORKGROUPS = 256


@dataclass(frozen=True)
class GemmTile:
    """Outputs a thread computes along the features (``mf``) and the tokens (``mt``): 4 or 8;
    ``half``: the products and a K step's sums in fp16 (tiles staged in fp16), else fp32."""

    mf: int
    mt: int
    half: bool = False

    @property
    def tile_f(self) -> int:
        return THREADS * self.mf

    @property
    def tile_t(self) -> int:
        return THREADS * self.mt

    def shared_bytes(self) -> int:
        """The two tiles of one K step (fp16 or fp32 values)."""
        return (self.tile_f + self.tile_t) * STEP * (2 if self.half else 4)


#: from the largest down; the first that leaves enough workgroups (and fits) is used
TILES = (GemmTile(8, 8), GemmTile(8, 4), GemmTile(4, 8), GemmTile(4, 4))


def choose_tile(
    features: int,
    shared_bytes: int,
    rows: int = ASSUMED_ROWS,
    min_workgroups: int = MIN_WORKGROUPS,
    half: bool = False,
) -> GemmTile | None:
    """The largest tile that divides ``features``, fits ``shared_bytes`` and leaves
    ``min_workgroups`` for ``rows`` tokens; the smallest that divides and fits otherwise."""
    tiles = [GemmTile(t.mf, t.mt, half) for t in TILES]
    fitting = [t for t in tiles if features % t.tile_f == 0 and t.shared_bytes() <= shared_bytes]
    for tile in fitting:
        if features // tile.tile_f * -(-rows // tile.tile_t) >= min_workgroups:
            return tile
    return fitting[-1] if fitting else None


def gemm_kernel(m: Q4MatmulMatch, tile: GemmTile) -> Any:
    """The PrimFunc of ``m`` in ``tile``: parameters (x, weight, scale, bias, residual, out);
    :func:`build` drops those ``m`` lacks and orders them as the original function."""
    from tvm.script import tirx as T

    k, nf = m.in_features, m.out_features
    mf, mt, tile_f, tile_t, half = tile.mf, tile.mt, tile.tile_f, tile.tile_t, tile.half
    steps = k // STEP
    has_bias, has_res = m.bias is not None, m.residual is not None
    fq, tq = tile_f // 4, tile_t // 4  # feature and token quads of a tile (vec4 words a k row)
    w_threads = fq * 4  # a thread: one word (8 values of K) of four features
    x_threads = tq * (STEP // 4)  # a thread: four values of K of four tokens
    vf, vt = mf // 4, mt // 4  # vec4s a thread reads along the features / tokens per k
    quads = mt * vf  # a thread's outputs, four features a vec4
    tile_dtype = "float16" if half else "float32"  # workgroup memory, the products
    acc_shape = (quads,) if half else (mt * mf,)

    @T.macro
    def load_step(wr, sr, xr, w, s, x, tid, wf, wk, xt, xk, rows, step):
        # step ``step``'s weight word and scale of four features, and four values of K of four
        # tokens (zeros past the prompt), into registers
        if tid < w_threads:
            for q in T.unroll(4):
                wr[q] = w[wf + q, step * 4 + wk]
                sr[q] = s[wf + q, step]
        if tid < x_threads:
            for q in T.unroll(4):
                if xt + q < rows:
                    xr[T.ramp(q * 4, 1, 4)] = x.vload([0, xt + q, step * STEP + xk * 4], "float16x4")
                else:
                    xr[T.ramp(q * 4, 1, 4)] = T.Broadcast(T.float16(0), 4)

    @T.macro
    def stage(ws, xs, wr, sr, xr, quad, tid, wk, xk):
        # the registers' step into workgroup memory: decoded weights [k][feature], activations
        # [k][token], four features / tokens a vec4 store
        if tid < w_threads:
            for j in T.unroll(8):  # value j of the word: k = 8 wk + j, four features
                for q in T.unroll(4):
                    if half:  # (q - 7) * scale in fp16, as the model's dequantize stage
                        quad[q] = (
                            T.Cast("float16", (wr[q] >> T.uint32(4 * j)) & T.uint32(15)) - T.float16(7)
                        ) * sr[q]
                    else:  # the same in fp32: exact
                        quad[q] = (
                            T.Cast("float32", (wr[q] >> T.uint32(4 * j)) & T.uint32(15)) - T.float32(7)
                        ) * T.Cast("float32", sr[q])
                ws[T.ramp((wk * 8 + j) * tile_f + (tid % fq) * 4, 1, 4)] = quad[T.ramp(0, 1, 4)]
        if tid < x_threads:
            for c in T.unroll(4):  # k = 4 xk + c, four tokens
                for q in T.unroll(4):
                    quad[q] = T.Cast(tile_dtype, xr[q * 4 + c])
                xs[T.ramp((xk * 4 + c) * tile_t + (tid % tq) * 4, 1, 4)] = quad[T.ramp(0, 1, 4)]

    @T.prim_func(private=True)
    def kernel(
        x_h: T.handle, w: T.Buffer((nf, k // 8), "uint32"), s: T.Buffer((nf, k // 32), "float16"),
        b: T.Buffer((nf,), "float16"), r_h: T.handle, out_h: T.handle,
    ):  # fmt: skip
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "llmchat_kernel": "wgsl_q4_gemm"})
        n = T.int64()
        x = T.match_buffer(x_h, (1, n, k), "float16")
        r = T.match_buffer(r_h, (1, n, nf), "float16")
        out = T.match_buffer(out_h, (1, n, nf), "float16")
        bx = T.launch_thread("blockIdx.x", nf // tile_f)
        # WGSL has no 64-bit integers: the token count and every index in int32
        by = T.launch_thread("blockIdx.y", (T.Cast("int32", n) + (tile_t - 1)) // tile_t)
        ty = T.launch_thread("threadIdx.y", THREADS)
        tx = T.launch_thread("threadIdx.x", THREADS)
        ws = T.decl_buffer((STEP * tile_f,), tile_dtype, scope="shared")
        xs = T.decl_buffer((STEP * tile_t,), tile_dtype, scope="shared")
        # fp32 accumulators: vec4s of four features (fp16 sums), single values (fp32 sums)
        acc = T.decl_buffer(acc_shape, "float32x4" if half else "float32", scope="local")
        # fp16: one K step's sums (added to ``acc`` at the step's end)
        part = T.decl_buffer((quads,), "float16x4", scope="local")
        wr = T.decl_buffer((4,), "uint32", scope="local")
        sr = T.decl_buffer((4,), "float16", scope="local")
        xr = T.decl_buffer((16,), "float16", scope="local")
        quad = T.decl_buffer((4,), tile_dtype, scope="local")
        av = T.decl_buffer((mt,), tile_dtype, scope="local")
        bv = T.decl_buffer((vf,) if half else (mf,), "float16x4" if half else "float32", scope="local")
        rows = T.meta_var(T.Cast("int32", n))
        tid = T.meta_var(ty * THREADS + tx)
        f0 = T.meta_var(bx * tile_f)
        t0 = T.meta_var(by * tile_t)
        # weights: thread -> feature quad (tid % fq) and word (tid // fq) of the step
        wf = T.meta_var(f0 + (tid % fq) * 4)
        wk = T.meta_var(tid // fq)
        # activations: thread -> token quad (tid % tq) and 4 values of K (tid // tq)
        xt = T.meta_var(t0 + (tid % tq) * 4)
        xk = T.meta_var(tid // tq)

        if half:
            for i in T.unroll(quads):
                acc[i] = T.Broadcast(T.float32(0), 4)
                part[i] = T.Broadcast(T.float16(0), 4)
        else:
            for i in T.unroll(mt * mf):
                acc[i] = T.float32(0)
        load_step(wr, sr, xr, w, s, x, tid, wf, wk, xt, xk, rows, 0)  # step 0 (registers)
        for st in T.serial(steps):
            T.tvm_storage_sync("shared")  # the last step's FMAs are done with the tiles
            stage(ws, xs, wr, sr, xr, quad, tid, wk, xk)
            T.tvm_storage_sync("shared")
            # the next step's words and activations go out before this step's FMAs
            if st + 1 < steps:
                load_step(wr, sr, xr, w, s, x, tid, wf, wk, xt, xk, rows, st + 1)
            for kk in T.unroll(STEP):
                for h in T.unroll(vt):
                    av[T.ramp(h * 4, 1, 4)] = xs[T.ramp(kk * tile_t + h * 64 + ty * 4, 1, 4)]
                for g in T.unroll(vf):
                    if half:
                        bv[g] = ws[T.ramp(kk * tile_f + g * 64 + tx * 4, 1, 4)]
                    else:
                        bv[T.ramp(g * 4, 1, 4)] = ws[T.ramp(kk * tile_f + g * 64 + tx * 4, 1, 4)]
                for i in T.unroll(mt):
                    if half:  # four fp16 products and sums a vec4 (two packed FMAs where offered)
                        for g in T.unroll(vf):
                            part[i * vf + g] = part[i * vf + g] + T.Broadcast(av[i], 4) * bv[g]
                    else:
                        for j in T.unroll(mf):
                            acc[i * mf + j] = acc[i * mf + j] + av[i] * bv[j]
            if half:  # a group's fp16 sums into the fp32 accumulators
                for i in T.unroll(quads):
                    acc[i] = acc[i] + T.Cast("float32x4", part[i])
                    part[i] = T.Broadcast(T.float16(0), 4)
        # epilogue: token 64 h + 4 ty + i, features 64 g + 4 tx + (0..3), four a store
        for hi in T.unroll(mt):
            if t0 + (hi // 4) * 64 + ty * 4 + hi % 4 < rows:
                for g in T.unroll(vf):
                    if half:
                        if has_bias:
                            acc[hi * vf + g] = acc[hi * vf + g] + T.Cast(
                                "float32x4", b[T.ramp(f0 + g * 64 + tx * 4, 1, 4)]
                            )
                    else:
                        for q in T.unroll(4):
                            quad[q] = acc[hi * mf + g * 4 + q]
                            if has_bias:
                                quad[q] = quad[q] + T.Cast("float32", b[f0 + g * 64 + tx * 4 + q])
                    if has_res:
                        out[0, t0 + (hi // 4) * 64 + ty * 4 + hi % 4, T.ramp(f0 + g * 64 + tx * 4, 1, 4)] = (
                            T.Cast("float16x4", acc[hi * vf + g] if half else quad[T.ramp(0, 1, 4)])
                            + r[0, t0 + (hi // 4) * 64 + ty * 4 + hi % 4, T.ramp(f0 + g * 64 + tx * 4, 1, 4)]
                        )
                    else:
                        out[0, t0 + (hi // 4) * 64 + ty * 4 + hi % 4, T.ramp(f0 + g * 64 + tx * 4, 1, 4)] = (
                            T.Cast("float16x4", acc[hi * vf + g] if half else quad[T.ramp(0, 1, 4)])
                        )

    return kernel


_ROLES = ("x", "w", "s", "b", "r", "out")


def build(func: Any, m: Q4MatmulMatch, tile: GemmTile) -> Any:
    """``func`` (the matched prompt matmul) as :func:`gemm_kernel`, with ``func``'s parameters in
    its order."""
    new = gemm_kernel(m, tile)
    return in_params_order(func, m, new, dict(zip(_ROLES, new.params, strict=True)))


class WgslQ4Gemm(WebGPUKernelRule):
    """Prompt-sized q4f16_1 matmuls on WebGPU -> :func:`build` in the tile :func:`choose_tile`
    picks (or ``tile``); ``half=True``: fp16 products and a K step's sums."""

    def __init__(self, tile: GemmTile | None = None, half: bool = False) -> None:
        self.tile = tile
        self.half = tile.half if tile is not None else half

    def kernel(self, func: Any, max_shared: int = 1 << 30) -> Any | None:
        m = match_q4f16_gemm(func)
        if m is None or str(m.out.dtype) != "float16":
            return None
        tile = self.tile or choose_tile(m.out_features, max_shared, half=self.half)
        if tile is None or m.out_features % tile.tile_f or tile.shared_bytes() > max_shared:
            return None
        return build(func, m, tile)
