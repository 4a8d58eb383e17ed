"""llmchat's CPU attention kernels over TVM's paged KV cache, in place of TVM's scalar ones.

TVM's KV cache (``PagedAttentionKVCache``) calls, on the CPU, TIR kernels that walk the keys one
at a time with scalar loops on one thread. A prompt chunk runs ``batch_prefill_ragged_kv`` (its
queries against its own keys, causal), then ``batch_prefill_paged_kv_cpu`` (against the keys of
earlier chunks, in the cache's pages) and ``merge_state_inplace_cpu`` (the two partial softmaxes
merged); a decode step runs ``batch_decode_paged_kv_cpu`` alone. This module builds drop-ins for
the four (same symbols, signatures and results) and :func:`replacement_kernel` picks the one for a
PrimFunc of the model.

The prefill kernels are a flash-attention loop for the CPU. A task is one KV head and a block of
``BQ`` consecutive queries; with grouped-query attention the ``group`` query heads that share the
KV head are rows of the same task, so a task has ``BQ * group`` rows that all read the same keys.
Tasks run in parallel (causal blocks are interleaved first/last so both halves of the thread pool
get the same work). For each tile of ``BK`` keys (one page of the cache): the tile is transposed
into ``Kt[d, key]``; scores ``S = Q @ Kt`` are computed ``RB`` rows at a time in register
accumulators (vector lanes along the keys); the online softmax rescales the running output once per
tile and uses a polynomial ``exp2`` that vectorizes; ``O += P @ V`` runs ``RB_O`` rows at a time
with the lanes along the head dimension. Causal tiles past a block's last query are skipped.

The decode kernel splits each sequence's pages over the threads (a task is one KV head and a share
of the pages, its ``group`` query heads together, so each key and value is read once per step) and
merges the tasks' partial softmaxes; see :func:`decode_attention_kernel`. ``rotary_mode == 1`` (RoPE inside
attention, ``RopeMode.INLINE``) uses the plain RoPE formula; llmchat's models use
``RopeMode.NORMAL`` (keys rotated when appended), so that path only keeps the signature whole.
"""

from __future__ import annotations

import math
from typing import Any

from app.inference.pipelines.tir_facts import static_int

# Attribute set on the PrimFuncs llmchat schedules or writes for the CPU (tests check it).
KERNEL_KIND_ATTR = "llmchat.cpu_kernel"

DECODE_SYMBOLS = ("batch_decode_paged_kv_cpu", "batch_decode_paged_kv_cpu_sliding_window")
# tasks per KV head of a sequence in a decode step: its pages split this many ways over the threads
DECODE_SPLITS = 16
PREFILL_PAGED_SYMBOL = "batch_prefill_paged_kv_cpu"
PREFILL_RAGGED_SYMBOL = "batch_prefill_ragged_kv"
MERGE_SYMBOL = "merge_state_inplace_cpu"

_LOG2E = math.log2(math.e)
_NEG = -3.0e38
# 2^f - 1 = f * P(f) for f in [-0.5, 0.5] (the classic Cephes exp2f coefficients; ~1e-7 relative)
_EXP2_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
)


def tirx_and(a: Any, b: Any) -> Any:
    from tvm import tirx

    return tirx.And(a, b)


def tirx_or(a: Any, b: Any) -> Any:
    from tvm import tirx

    return tirx.Or(a, b)


def fast_exp2(x: Any) -> Any:
    """``2 ** x`` for float32 ``x <= 127`` as a TIR expression that vectorizes (no libm call):
    ``x`` split into an integer ``n`` and ``f`` in [-0.5, 0.5], ``2^f`` by a polynomial, ``2^n``
    written into the exponent bits. Below -126 it is 0 (no denormals)."""
    from tvm.script import tirx as T

    xc = T.max(x, T.float32(-126.0))
    n = T.floor(xc + T.float32(0.5))
    f = xc - n
    p = T.float32(_EXP2_POLY[0])
    for c in _EXP2_POLY[1:]:
        p = p * f + T.float32(c)
    two_n = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
    return T.Select(x < T.float32(-126.0), T.float32(0.0), (f * p + T.float32(1.0)) * two_n)


# --------------------------------------------------------------------------------------------
# Prefill: ragged (the chunk's own keys) and paged (keys already in the cache)
# --------------------------------------------------------------------------------------------
def prefill_attention_kernel(
    num_kv_heads: int,
    num_qo_heads: int,
    head_dim: int,
    dtype: str,
    *,
    paged: bool,
    page_size: int = 16,
    wide: bool = True,
) -> Any:
    """A drop-in for TVM's ``batch_prefill_paged_kv_cpu`` (``paged``) or ``batch_prefill_ragged_kv``.

    Same parameters and results (the output and the log2-domain log-sum-exp that TVM's merge
    expects); the variant without sliding window. ``head_dim`` must be a multiple of 16 and
    ``page_size`` of 8. ``wide``: the target has 32 vector registers (AVX-512), so the register
    tiles can be twice as tall."""
    from tvm.relax.frontend.nn.llm._kernel_common import _rope
    from tvm.script import tirx as T

    H_qo, H_kv, D = num_qo_heads, num_kv_heads, head_dim
    G = H_qo // H_kv
    LANES = 16  # vector width of the tiles (one AVX-512 register, two AVX2 ones)
    BQ = LANES  # queries per task: a row group of a task is one query head's BQ queries
    R = BQ * G  # rows of a task: row g * BQ + i is query i of the group's head g
    BK = page_size if paged else 16  # keys per tile (a page of the cache)
    RJ = 8 if wide else 4  # keys of the score register tile
    RB_O = 2  # output rows computed together (RB_O * D floats: under 1 KiB, so on the stack)
    assert D % LANES == 0 and BK % RJ == 0
    P = page_size
    log2e = _LOG2E
    neg = _NEG

    # where a tile's keys are: a page of the cache, or BK rows of the chunk's own keys
    if paged:
        kv_stride, val_offset = D, H_kv * P * D

        def tile_key_base(kt: Any, h: Any, table: Any, first: Any) -> Any:
            return (table[first + kt] * 2 * H_kv + h) * P * D

        def kf4_index(kt: Any, j: Any, d: Any, h: Any, table: Any, first: Any) -> tuple:
            return (table[first + kt], 0, h, j, d)
    else:
        kv_stride, val_offset = H_kv * D, 0

        def tile_key_base(kt: Any, h: Any, table: Any, first: Any) -> Any:
            return (first + kt * BK) * H_kv * D + h * D

        def kf4_index(kt: Any, j: Any, d: Any, h: Any, table: Any, first: Any) -> tuple:
            return (first + kt * BK + j, h, d)

    def block_of(t: Any, n_blocks: Any) -> Any:
        # 0, n-1, 1, n-2, ...: contiguous ranges of tasks get equal causal work
        return T.if_then_else(t % 2 == 0, t // 2, n_blocks - 1 - t // 2)

    def visible(key: Any, i: Any, kv_len: Any, diag: Any, causal: Any) -> Any:
        return tirx_and(key < kv_len, tirx_or(causal == 0, key < diag + i + 1))

    def needs_mask(kt: Any, kv_len: Any, diag: Any, causal: Any) -> Any:
        # a tile past the last key, or (causal) past the diagonal of the block's first query
        return tirx_or(kt * BK + BK > kv_len, tirx_and(causal > 0, kt * BK + BK > diag + 1))

    # The body of a task (one KV head, BQ queries). ``Kf``/``Vf`` are flat views of the key and
    # value storage (``Kf4`` the key buffer as declared, for RoPE); ``tile_key_base`` finds a tile.
    # Scores are kept transposed, St[key, row], so the softmax runs down columns of vectors (no
    # horizontal reductions) and no key tile is transposed: keys are broadcast into the FMAs.
    @T.macro
    def attend_task(
        q,
        q_rope_position,
        k_rope_pos_offset,
        output,
        lse,
        Kf,
        Vf,
        Kf4,
        tile_table,
        tile_first,
        q_start,
        qo_len,
        kv_len,
        h_kv,
        qb,
        b,
        causal,
        rotary_mode,
        rope_scale,
        rope_theta,
        sm_scale,
    ):
        q_first: T.let[T.int32] = qb * BQ
        n_rows: T.let[T.int32] = T.min(BQ, qo_len - q_first)
        diag: T.let[T.int32] = kv_len - qo_len + q_first  # causal: query i sees keys <= diag + i
        # keys this block can see: all of them, or (causal) up to its last query's diagonal
        kv_end: T.let[T.int32] = T.if_then_else(causal > 0, T.min(kv_len, diag + n_rows), kv_len)
        with T.sblock("attn"):
            T.reads()
            T.writes()
            Qt = T.sblock_alloc_buffer((D, R), "float32")
            Out = T.sblock_alloc_buffer((R, D), "float32")
            Kc = T.sblock_alloc_buffer((BK, D), "float32")
            Vc = T.sblock_alloc_buffer((BK, D), "float32")
            St = T.sblock_alloc_buffer((BK, R), "float32")
            m = T.sblock_alloc_buffer((R,), "float32", scope="local")
            lsum = T.sblock_alloc_buffer((R,), "float32", scope="local")
            alpha = T.sblock_alloc_buffer((R,), "float32", scope="local")
            vmax = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
            vsum = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
            # register tiles: indexed by constants once unrolled, LANES wide, under 1 KiB: a stack
            # array that LLVM turns into registers. The small buffers indexed at run time above are
            # in another scope: TVM's storage rewrite packs the small buffers of one scope into one
            # array, and one dynamic index in it would keep the tiles in memory.
            acc = T.sblock_alloc_buffer((RJ, LANES), "float32")
            acc_o = T.sblock_alloc_buffer((RB_O, D), "float32")
            for g, i in T.grid(G, BQ):
                m[g * BQ + i] = T.float32(-5e4)
                lsum[g * BQ + i] = T.float32(1.0)
                for d in T.vectorized(D):
                    Out[g * BQ + i, d] = T.float32(0)
                for d in T.serial(D):
                    Qt[d, g * BQ + i] = T.if_then_else(
                        i < n_rows,
                        T.Cast(
                            "float32",
                            T.if_then_else(
                                rotary_mode == 1,
                                _rope(
                                    q,
                                    q_rope_position[q_start + q_first + i],
                                    D,
                                    rope_theta,
                                    rope_scale,
                                    (q_start + q_first + i, h_kv * G + g, d),
                                    dtype,
                                    {},
                                ),
                                q[q_start + q_first + i, h_kv * G + g, d],
                            ),
                        )
                        * (sm_scale * T.float32(log2e)),
                        T.float32(0),
                    )
            for kt in T.serial((kv_end + BK - 1) // BK):
                key_base: T.let[T.int32] = tile_key_base(kt, h_kv, tile_table, tile_first)
                n_keys: T.let[T.int32] = T.min(BK, kv_len - kt * BK)
                for j in T.serial(BK):
                    if j < n_keys:
                        if rotary_mode == 1:
                            for d in T.serial(D):
                                Kc[j, d] = T.Cast(
                                    "float32",
                                    _rope(
                                        Kf4,
                                        k_rope_pos_offset[b] + kt * BK + j,
                                        D,
                                        rope_theta,
                                        rope_scale,
                                        kf4_index(kt, j, d, h_kv, tile_table, tile_first),
                                        dtype,
                                        {},
                                    ),
                                )
                        else:
                            for d in T.vectorized(D):
                                Kc[j, d] = T.Cast("float32", Kf[key_base + j * kv_stride + d])
                        for d in T.vectorized(D):
                            Vc[j, d] = T.Cast("float32", Vf[key_base + val_offset + j * kv_stride + d])
                    else:  # past the last key: zeros, never the stale (maybe NaN) rest of a page
                        for d in T.vectorized(D):
                            Kc[j, d] = T.float32(0)
                            Vc[j, d] = T.float32(0)
                # St = Kc @ Qt, RJ keys x LANES rows at a time
                for rg, jb in T.grid(R // LANES, BK // RJ):
                    for jj in T.unroll(RJ):
                        for lane in T.vectorized(LANES):
                            acc[jj, lane] = T.float32(0)
                    for d in T.serial(D):
                        for jj in T.unroll(RJ):
                            for lane in T.vectorized(LANES):
                                acc[jj, lane] = acc[jj, lane] + Kc[jb * RJ + jj, d] * Qt[d, rg * LANES + lane]
                    for jj in T.unroll(RJ):
                        for lane in T.vectorized(LANES):
                            St[jb * RJ + jj, rg * LANES + lane] = acc[jj, lane]
                if needs_mask(kt, kv_len, diag, causal):
                    for j, g in T.grid(BK, G):
                        for i in T.vectorized(BQ):
                            St[j, g * BQ + i] = T.Select(
                                visible(kt * BK + j, i, kv_len, diag, causal),
                                St[j, g * BQ + i],
                                T.float32(neg),
                            )
                # online softmax, LANES rows at a time
                for rg in T.serial(R // LANES):
                    for lane in T.vectorized(LANES):
                        vmax[lane] = m[rg * LANES + lane]
                    for j in T.serial(BK):
                        for lane in T.vectorized(LANES):
                            vmax[lane] = T.max(vmax[lane], St[j, rg * LANES + lane])
                    for lane in T.vectorized(LANES):
                        alpha[rg * LANES + lane] = fast_exp2(m[rg * LANES + lane] - vmax[lane])
                        m[rg * LANES + lane] = vmax[lane]
                        vsum[lane] = T.float32(0)
                    for j in T.serial(BK):
                        for lane in T.vectorized(LANES):
                            St[j, rg * LANES + lane] = fast_exp2(St[j, rg * LANES + lane] - vmax[lane])
                            vsum[lane] = vsum[lane] + St[j, rg * LANES + lane]
                    for lane in T.vectorized(LANES):
                        lsum[rg * LANES + lane] = (
                            lsum[rg * LANES + lane] * alpha[rg * LANES + lane] + vsum[lane]
                        )
                # Out = Out * alpha + P @ V, RB_O rows at a time
                for rb in T.serial(R // RB_O):
                    for rr in T.unroll(RB_O):
                        for dv in T.unroll(D // LANES):
                            for dl in T.vectorized(LANES):
                                acc_o[rr, dv * LANES + dl] = (
                                    Out[rb * RB_O + rr, dv * LANES + dl] * alpha[rb * RB_O + rr]
                                )
                    for j in T.serial(BK):
                        for rr in T.unroll(RB_O):
                            for dv in T.unroll(D // LANES):
                                for dl in T.vectorized(LANES):
                                    acc_o[rr, dv * LANES + dl] = (
                                        acc_o[rr, dv * LANES + dl]
                                        + St[j, rb * RB_O + rr] * Vc[j, dv * LANES + dl]
                                    )
                    for rr in T.unroll(RB_O):
                        for dv in T.unroll(D // LANES):
                            for dl in T.vectorized(LANES):
                                Out[rb * RB_O + rr, dv * LANES + dl] = acc_o[rr, dv * LANES + dl]
            for g, i in T.grid(G, BQ):
                if i < n_rows:
                    for d in T.vectorized(D):
                        output[q_start + q_first + i, h_kv * G + g, d] = T.Cast(
                            dtype, Out[g * BQ + i, d] / lsum[g * BQ + i]
                        )
                    lse[q_start + q_first + i, h_kv * G + g] = m[g * BQ + i] + T.log2(lsum[g * BQ + i])

    if paged:
        # fmt: off
        @T.prim_func(s_tir=True)
        def batch_prefill_paged_kv(
            var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
            var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
            var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
            causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32,
            sm_scale: T.float32,
        ):
            T.func_attr({"tirx.is_scheduled": True, "global_symbol": PREFILL_PAGED_SYMBOL,
                         KERNEL_KIND_ATTR: "attention"})
            batch_size = T.int32()
            total_len = T.int32()
            nnz_pages = T.int32()
            max_num_pages = T.int32()
            q_indptr_elem_offset = T.int32()
            page_indptr_elem_offset = T.int32()
            page_values_elem_offset = T.int32()
            k_rope_pos_offset_elem_offset = T.int32()
            q_rope_position_elem_offset = T.int32()
            length_info_elem_offset = T.int32()
            q = T.match_buffer(var_q, (total_len, H_qo, D), dtype)
            q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                      elem_offset=q_indptr_elem_offset)
            pages = T.match_buffer(var_pages, (max_num_pages, 2, H_kv, P, D), dtype)
            page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                         elem_offset=page_indptr_elem_offset)
            page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32",
                                         elem_offset=page_values_elem_offset)
            k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                               elem_offset=k_rope_pos_offset_elem_offset)
            q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                             elem_offset=q_rope_position_elem_offset)
            output = T.match_buffer(var_output, (total_len, H_qo, D), dtype)
            lse = T.match_buffer(var_lse, (total_len, H_qo), "float32")
            length_info = T.match_buffer(var_length_info, (batch_size,), "int32",
                                         elem_offset=length_info_elem_offset)
            Kf = T.decl_buffer((max_num_pages * 2 * H_kv * P * D,), dtype, data=pages.data)
            Vf = T.decl_buffer((max_num_pages * 2 * H_kv * P * D,), dtype, data=pages.data)
            Kf4 = pages
            tile_table = page_values

            for b in T.serial(batch_size):
                q_start: T.let[T.int32] = q_indptr[b]
                qo_len: T.let[T.int32] = q_indptr[b + 1] - q_start
                page_begin: T.let[T.int32] = page_indptr[b]
                kv_len: T.let[T.int32] = T.if_then_else(
                    page_begin != page_indptr[b + 1],
                    (page_indptr[b + 1] - page_begin - 1) * P + length_info[b], 0)
                tile_first: T.let[T.int32] = page_begin
                n_blocks: T.let[T.int32] = (qo_len + BQ - 1) // BQ
                for task in T.parallel(H_kv * n_blocks):
                    h_kv: T.let[T.int32] = task // n_blocks
                    qb: T.let[T.int32] = block_of(task % n_blocks, n_blocks)
                    attend_task(q, q_rope_position, k_rope_pos_offset, output, lse, Kf, Vf, Kf4, tile_table,
                                tile_first, q_start, qo_len, kv_len, h_kv, qb, b, causal, rotary_mode,
                                rope_scale, rope_theta, sm_scale)
        # fmt: on
        return batch_prefill_paged_kv

    # fmt: off
    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle,
        var_lse: T.handle, causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
        rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": PREFILL_RAGGED_SYMBOL,
                     KERNEL_KIND_ATTR: "attention"})
        batch_size = T.int32()
        total_q = T.int32()
        total_kv = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_q, H_qo, D), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (total_kv, H_kv, D), dtype)
        v = T.match_buffer(var_v, (total_kv, H_kv, D), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32",
                                   elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (total_q, H_qo, D), dtype)
        lse = T.match_buffer(var_lse, (total_q, H_qo), "float32")
        Kf = T.decl_buffer((total_kv * H_kv * D,), dtype, data=k.data)
        Vf = T.decl_buffer((total_kv * H_kv * D,), dtype, data=v.data)
        Kf4 = k
        tile_table = kv_indptr

        for b in T.serial(batch_size):
            q_start: T.let[T.int32] = q_indptr[b]
            qo_len: T.let[T.int32] = q_indptr[b + 1] - q_start
            kv_start: T.let[T.int32] = kv_indptr[b]
            kv_len: T.let[T.int32] = kv_indptr[b + 1] - kv_start
            tile_first: T.let[T.int32] = kv_start
            n_blocks: T.let[T.int32] = (qo_len + BQ - 1) // BQ
            for task in T.parallel(H_kv * n_blocks):
                h_kv: T.let[T.int32] = task // n_blocks
                qb: T.let[T.int32] = block_of(task % n_blocks, n_blocks)
                attend_task(q, q_rope_position, k_rope_pos_offset, output, lse, Kf, Vf, Kf4, tile_table,
                            tile_first, q_start, qo_len, kv_len, h_kv, qb, b, causal, rotary_mode,
                            rope_scale, rope_theta, sm_scale)
    # fmt: on
    return batch_prefill_ragged_kv


# --------------------------------------------------------------------------------------------
# Decode: one query per sequence against the cache's pages
# --------------------------------------------------------------------------------------------
def _shuffle(vectors: list[Any], indices: list[int]) -> Any:
    from tvm.script import tirx as T

    return T.Shuffle(vectors, [T.int32(i) for i in indices])


def transposed_sum(vectors: list[Any]) -> Any:
    """A vector whose lane ``j`` is the sum of the lanes of ``vectors[j]``: ``L`` float vectors of
    ``L`` lanes (``L`` a power of two) reduced together in ``log2(L)`` rounds of two shuffles and
    one add per pair (``L - 1`` adds in all, against ``L * log2(L)`` for one reduction per vector)."""
    lanes = len(vectors)
    vecs = list(vectors)
    half = lanes // 2
    while half >= 1:
        n = len(vecs)
        first: list[int] = []
        second: list[int] = []
        for o in range(0, lanes, 2 * half):
            first += [*range(o, o + half), *range(lanes + o, lanes + o + half)]
            second += [*range(o + half, o + 2 * half), *range(lanes + o + half, lanes + o + 2 * half)]
        vecs = [
            _shuffle([vecs[j], vecs[j + n // 2]], first) + _shuffle([vecs[j], vecs[j + n // 2]], second)
            for j in range(n // 2)
        ]
        half //= 2
    return vecs[0]


def horizontal(vector: Any, lanes: int, combine: Any) -> Any:
    """``combine`` folded over the ``lanes`` lanes of ``vector`` (a tree of shuffles): a scalar."""
    while lanes > 1:
        lanes //= 2
        vector = combine(
            _shuffle([vector], list(range(lanes))), _shuffle([vector], list(range(lanes, 2 * lanes)))
        )
    return vector


def decode_attention_kernel(
    num_kv_heads: int,
    num_qo_heads: int,
    head_dim: int,
    dtype: str,
    sliding_window: bool,
    page_size: int,
    *,
    wide: bool = True,
    splits: int = DECODE_SPLITS,
) -> Any:
    """A drop-in for TVM's ``batch_decode_paged_kv_cpu`` (same signature and results).

    A task is one KV head of one sequence and a ``1/splits`` share of its pages; tasks run in
    parallel and write unnormalized partial results, which a last loop merges per query head. So
    the keys are split over the threads even when there are fewer KV heads than threads, and the
    ``group`` query heads of a KV head are computed together: each key and value is read from
    memory once for all of them. A full page of the cache (``L`` = 16 vector lanes with AVX-512,
    else 8): per query head, ``L`` keys' dot products with the head dimension in vector lanes,
    reduced together by :func:`transposed_sum` into one vector of ``L`` scores; the online softmax
    on those vectors; ``O += P @ V`` a vector of ``O`` at a time over the page's keys, unrolled.
    A partial last page (and the sliding-window variant, and ``rotary_mode == 1``: RoPE applied
    inside attention, ``RopeMode.INLINE``, with the plain RoPE formula) takes a key-at-a-time
    path. llmchat's models use ``RopeMode.NORMAL``: the cache rotates keys when they are appended.
    """
    from tvm.relax.frontend.nn.llm._kernel_common import (
        _declare_length_info,
        _get_kv_chunk_len,
        _get_seq_offset,
        _rope,
    )
    from tvm.script import tirx as T

    H_qo, H_kv, D, P, S = num_qo_heads, num_kv_heads, head_dim, page_size, splits
    G = num_qo_heads // num_kv_heads
    L = 16 if wide and P % 16 == 0 and D % 16 == 0 else 8
    assert D % L == 0 and P % L == 0, "head_dim and page_size must be multiples of 8"
    folds = D // L
    fast_pages = 0 if sliding_window else 1  # full pages are read a page at a time
    log2e = _LOG2E
    neg = _NEG
    symbol = DECODE_SYMBOLS[1 if sliding_window else 0]

    # fmt: off
    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": symbol, KERNEL_KIND_ATTR: "attention"})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, H_qo, D), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, H_kv, P, D), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, H_qo, D), dtype)
        lse = T.match_buffer(lse_handle, (B, H_qo), "float32")
        length_info = _declare_length_info(var_length_info, B, sliding_window, length_info_elem_offset)
        Pf = T.decl_buffer((max_num_pages * 2 * H_kv * P * D,), dtype, data=pages.data)
        # the tasks' partial results: unnormalized output, running max and sum per query head
        part_o = T.alloc_buffer((B * H_kv * S, G, D), "float32")
        part_m = T.alloc_buffer((B * H_kv * S, G), "float32")
        part_l = T.alloc_buffer((B * H_kv * S, G), "float32")
        # splits per KV head: S, or fewer when the longest sequence has fewer pages (no idle tasks)
        most_pages = T.alloc_buffer((1,), "int32")
        most_pages[0] = 1
        for b0 in T.serial(B):
            most_pages[0] = T.max(most_pages[0], page_table_indptr[b0 + 1] - page_table_indptr[b0])
        n_split: T.let[T.int32] = T.min(most_pages[0], S)

        for task in T.parallel(B * H_kv * n_split):
            with T.sblock("attn"):
                T.reads()
                T.writes()
                # On the stack (CPU buffers of the global scope under 1 KiB): the register tiles,
                # indexed by constants once unrolled, which LLVM keeps in registers, and the small
                # arrays indexed at run time.
                acc_lo = T.sblock_alloc_buffer((L // 2, L), "float32")
                acc_hi = T.sblock_alloc_buffer((L // 2, L), "float32")
                accg = T.sblock_alloc_buffer((G, L), "float32")
                ov = T.sblock_alloc_buffer((G, L), "float32")
                q_local = T.sblock_alloc_buffer((G, D), "float32")
                o_acc = T.sblock_alloc_buffer((G, D), "float32")
                sc = T.sblock_alloc_buffer((G, P), "float32")
                m = T.sblock_alloc_buffer((G,), "float32")
                lsum = T.sblock_alloc_buffer((G,), "float32")
                alpha = T.sblock_alloc_buffer((G,), "float32")
                mx = T.sblock_alloc_buffer((1,), "float32")
                b: T.let[T.int32] = task // (H_kv * n_split)
                h_kv: T.let[T.int32] = task // n_split % H_kv
                split: T.let[T.int32] = task % n_split
                begin: T.let[T.int32] = page_table_indptr[b]
                end: T.let[T.int32] = page_table_indptr[b + 1]
                kv_len: T.let[T.int32] = T.if_then_else(
                    begin != end, _get_kv_chunk_len(end - begin, P, b, length_info, sliding_window), 0)
                n_chunks: T.let[T.int32] = (kv_len + P - 1) // P
                # this task's chunks of P keys: an even share, the remainder spread one by one
                c_first: T.let[T.int32] = split * n_chunks // n_split
                c_last: T.let[T.int32] = (split + 1) * n_chunks // n_split
                for g in T.serial(G):
                    m[g] = T.float32(-5e4)
                    lsum[g] = T.float32(0)
                    for d in T.serial(D):
                        o_acc[g, d] = T.float32(0)
                        q_local[g, d] = T.Cast("float32", T.if_then_else(
                            rotary_mode == 1,
                            _rope(Q, q_rope_position[b], D, rope_theta, rope_scale, (b, h_kv * G + g, d),
                                  dtype, {}),
                            Q[b, h_kv * G + g, d])) * (sm_scale * T.float32(log2e))
                for chunk in T.serial(c_first, c_last):
                    n_keys: T.let[T.int32] = T.min(P, kv_len - chunk * P)
                    if tirx_and(tirx_and(n_keys == P, rotary_mode != 1), T.int32(fast_pages) == 1):
                        # a full page: its keys' scores, L at a time, per query head
                        k_base: T.let[T.int32] = (page_table_values[begin + chunk] * 2 * H_kv + h_kv) * P * D
                        for g in T.serial(G):  # (unrolled, LLVM would keep the page in registers)
                            for jb in T.unroll(P // L):
                                for j in T.unroll(L // 2):
                                    for i in T.vectorized(L):
                                        acc_lo[j, i] = q_local[g, i] * T.Cast(
                                            "float32", Pf[k_base + (jb * L + j) * D + i])
                                        acc_hi[j, i] = q_local[g, i] * T.Cast(
                                            "float32", Pf[k_base + (jb * L + L // 2 + j) * D + i])
                                    for c in T.unroll(1, folds):
                                        for i in T.vectorized(L):
                                            acc_lo[j, i] = acc_lo[j, i] + q_local[g, c * L + i] * T.Cast(
                                                "float32", Pf[k_base + (jb * L + j) * D + c * L + i])
                                            acc_hi[j, i] = acc_hi[j, i] + q_local[g, c * L + i] * T.Cast(
                                                "float32", Pf[k_base + (jb * L + L // 2 + j) * D + c * L + i])
                                sc[g, T.ramp(jb * L, 1, L)] = transposed_sum(
                                    [acc_lo[j, T.ramp(0, 1, L)] for j in range(L // 2)]
                                    + [acc_hi[j, T.ramp(0, 1, L)] for j in range(L // 2)])
                    else:
                        # a partial page, or keys that move (sliding window) or rotate (inline
                        # RoPE): one key at a time
                        for j in T.serial(P):
                            if j < n_keys:
                                seq_offset: T.let[T.int32] = _get_seq_offset(
                                    chunk * P + j, b, length_info, sliding_window)
                                page_no: T.let[T.int32] = page_table_values[begin + seq_offset // P]
                                page_offset: T.let[T.int32] = seq_offset % P
                                if rotary_mode == 1:
                                    for g in T.serial(G):
                                        mx[0] = T.float32(0)
                                        for d in T.serial(D):
                                            mx[0] = mx[0] + q_local[g, d] * T.Cast("float32", _rope(
                                                pages, k_rope_pos_offset[b] + chunk * P + j, D, rope_theta,
                                                rope_scale, (page_no, 0, h_kv, page_offset, d), dtype, {}))
                                        sc[g, j] = mx[0]
                                else:
                                    for g in T.unroll(G):
                                        for i in T.vectorized(L):
                                            accg[g, i] = q_local[g, i] * T.Cast(
                                                "float32", pages[page_no, 0, h_kv, page_offset, i])
                                        for c in T.unroll(1, folds):
                                            for i in T.vectorized(L):
                                                accg[g, i] = accg[g, i] + q_local[g, c * L + i] * T.Cast(
                                                    "float32", pages[page_no, 0, h_kv, page_offset, c * L + i]
                                                )
                                        sc[g, j] = horizontal(accg[g, T.ramp(0, 1, L)], L, T.Add)
                            else:
                                for g in T.serial(G):
                                    sc[g, j] = T.float32(neg)
                    # one online-softmax step per query head, on vectors of the page's scores
                    for g in T.serial(G):
                        mx[0] = T.max(m[g], horizontal(
                            _page_fold(sc, g, P, L, T.max), L, T.max))
                        for j in T.vectorized(P):
                            sc[g, j] = fast_exp2(sc[g, j] - mx[0])
                        alpha[g] = fast_exp2(m[g] - mx[0])
                        m[g] = mx[0]
                        lsum[g] = lsum[g] * alpha[g] + horizontal(_page_fold(sc, g, P, L, T.Add), L, T.Add)
                        for d in T.vectorized(D):
                            o_acc[g, d] = o_acc[g, d] * alpha[g]
                    # O += P @ V
                    if tirx_and(n_keys == P, T.int32(fast_pages) == 1):
                        v_page: T.let[T.int32] = page_table_values[begin + chunk]
                        v_base: T.let[T.int32] = ((v_page * 2 + 1) * H_kv + h_kv) * P * D
                        for c in T.unroll(folds):
                            for g in T.unroll(G):
                                for i in T.vectorized(L):
                                    ov[g, i] = o_acc[g, c * L + i]
                            for j in T.unroll(P):
                                for g in T.unroll(G):
                                    for i in T.vectorized(L):
                                        ov[g, i] = ov[g, i] + sc[g, j] * T.Cast(
                                            "float32", Pf[v_base + j * D + c * L + i])
                            for g in T.unroll(G):
                                for i in T.vectorized(L):
                                    o_acc[g, c * L + i] = ov[g, i]
                    else:
                        for j in T.serial(P):
                            if j < n_keys:
                                seq_offset2: T.let[T.int32] = _get_seq_offset(
                                    chunk * P + j, b, length_info, sliding_window)
                                page_no2: T.let[T.int32] = page_table_values[begin + seq_offset2 // P]
                                page_offset2: T.let[T.int32] = seq_offset2 % P
                                for g in T.unroll(G):
                                    for d in T.vectorized(D):
                                        o_acc[g, d] = o_acc[g, d] + sc[g, j] * T.Cast(
                                            "float32", pages[page_no2, 1, h_kv, page_offset2, d])
                for g in T.serial(G):
                    part_m[task, g] = m[g]
                    part_l[task, g] = lsum[g]
                    for d in T.vectorized(D):
                        part_o[task, g, d] = o_acc[g, d]

        # merge the partials of each query head
        for bh in T.serial(B * H_qo):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                o_sum = T.sblock_alloc_buffer((D,), "float32")
                st = T.sblock_alloc_buffer((3,), "float32", scope="local")  # max, sum, weight
                b2: T.let[T.int32] = bh // H_qo
                g2: T.let[T.int32] = bh % H_qo % G
                first: T.let[T.int32] = (b2 * H_kv + bh % H_qo // G) * n_split
                st[0] = T.float32(-5e4)
                st[1] = T.float32(0)
                for s in T.serial(n_split):
                    st[0] = T.max(st[0], part_m[first + s, g2])
                for d in T.vectorized(D):
                    o_sum[d] = T.float32(0)
                for s in T.serial(n_split):
                    st[2] = fast_exp2(part_m[first + s, g2] - st[0])
                    st[1] = st[1] + part_l[first + s, g2] * st[2]
                    for d in T.vectorized(D):
                        o_sum[d] = o_sum[d] + part_o[first + s, g2, d] * st[2]
                if st[1] == T.float32(0):  # no keys: TVM's neutral result
                    st[1] = T.float32(1)
                for d in T.vectorized(D):
                    output[b2, bh % H_qo, d] = T.Cast(dtype, o_sum[d] / st[1])
                lse[b2, bh % H_qo] = st[0] + T.log2(st[1])
    # fmt: on

    return batch_decode_paged_kv


def _page_fold(buf: Any, g: Any, page: int, lanes: int, combine: Any) -> Any:
    """``combine`` of the ``page // lanes`` vectors of row ``g`` of ``buf``, lane by lane."""
    from tvm.script import tirx as T

    vec = buf[g, T.ramp(0, 1, lanes)]
    for k in range(1, page // lanes):
        vec = combine(vec, buf[g, T.ramp(k * lanes, 1, lanes)])
    return vec


# --------------------------------------------------------------------------------------------
# Merging two partial softmaxes (the chunk's own keys and the cache's)
# --------------------------------------------------------------------------------------------
def merge_state_kernel(dtype: str) -> Any:
    """A drop-in for TVM's ``merge_state_inplace_cpu``: ``V, S <- merge((V, S), (V_other, S_other))``
    with log2-domain log-sum-exps, the (row, head) pairs in parallel and the head dimension in
    vector lanes."""
    from tvm.script import tirx as T

    # fmt: off
    @T.prim_func(s_tir=True)
    def merge_state_inplace(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": MERGE_SYMBOL, KERNEL_KIND_ATTR: "attention"})
        N = T.int32()
        H = T.int32()
        D = T.int32()
        V = T.match_buffer(v, (N, H, D), dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        for nh in T.parallel(N * H):
            with T.sblock("merge"):
                T.reads()
                T.writes()
                n: T.let[T.int32] = nh // H
                h: T.let[T.int32] = nh % H
                s_max: T.let[T.float32] = T.max(S[n, h], S_other[n, h])
                w: T.let[T.float32] = T.exp2(S[n, h] - s_max)
                w_other: T.let[T.float32] = T.exp2(S_other[n, h] - s_max)
                for d in T.serial(D):  # D is dynamic here: LLVM vectorizes the loop
                    V[n, h, d] = T.Cast(dtype, (T.Cast("float32", V[n, h, d]) * w
                                                + T.Cast("float32", V_other[n, h, d]) * w_other)
                                        / (w + w_other))
                S[n, h] = T.log2(w + w_other) + s_max
    # fmt: on
    return merge_state_inplace


# --------------------------------------------------------------------------------------------
# Which kernel replaces which
# --------------------------------------------------------------------------------------------
ATTENTION_SYMBOLS = (*DECODE_SYMBOLS, PREFILL_PAGED_SYMBOL, PREFILL_RAGGED_SYMBOL, MERGE_SYMBOL)


def _global_symbol(func: Any) -> str | None:
    if func.attrs is None or "global_symbol" not in func.attrs:
        return None
    return str(func.attrs["global_symbol"])


def _has_avx512(target: Any) -> bool:
    try:
        from tvm.target import codegen

        return bool(codegen.target_has_features("avx512f", target))
    except Exception:  # an older TVM or a non-x86 target: the narrow tiles
        return False


def replacement_kernel(func: Any, target: Any = None) -> Any | None:
    """llmchat's kernel for TVM's attention PrimFunc ``func`` (one of :data:`ATTENTION_SYMBOLS`),
    or None when its shapes do not fit ours (TVM's kernel then stays)."""
    symbol = _global_symbol(func)
    if symbol == MERGE_SYMBOL:
        return merge_state_kernel(str(func.params[0].dtype))
    try:
        q = func.params[0]
        cache = func.params[2] if symbol in (PREFILL_PAGED_SYMBOL, PREFILL_RAGGED_SYMBOL) else func.params[1]
        _len, h_qo, d = (static_int(x) for x in q.shape)
        h_kv = static_int(cache.shape[-3 if symbol != PREFILL_RAGGED_SYMBOL else -2])
        d2 = static_int(cache.shape[-1])
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    dtype = str(q.dtype)
    if None in (h_qo, d, h_kv) or d != d2 or d % 16 or h_qo % h_kv or dtype != str(cache.dtype):
        return None
    if symbol == PREFILL_RAGGED_SYMBOL:
        if str(func.params[3].dtype) != dtype or static_int(func.params[3].shape[-1]) != d:
            return None  # keys and values of different head sizes (MLA)
        return prefill_attention_kernel(h_kv, h_qo, d, dtype, paged=False, wide=_has_avx512(target))
    page = static_int(cache.shape[3])
    if page is None:
        return None
    if symbol == PREFILL_PAGED_SYMBOL:
        if page % 8:
            return None
        return prefill_attention_kernel(
            h_kv, h_qo, d, dtype, paged=True, page_size=page, wide=_has_avx512(target)
        )
    if page % 8:
        return None
    return decode_attention_kernel(
        h_kv, h_qo, d, dtype, symbol == DECODE_SYMBOLS[1], page, wide=_has_avx512(target)
    )
