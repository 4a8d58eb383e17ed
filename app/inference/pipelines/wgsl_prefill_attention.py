"""A prompt chunk's attention on WGSL (WebGPU/Vulkan): llmchat's kernel in place of TVM's
``batch_prefill_ragged_kv`` (the chunk's own keys) and ``batch_prefill_paged_kv`` (the keys
already in the KV cache's pages: a later chunk of a long prompt, every turn after the first), with
their signatures, outputs and base-2 log-sum-exp.

TVM's kernels on WebGPU stage 32 queries and 32 keys a step with 128 threads, compute the softmax
of the 32 rows with one thread each over seven barriers a step, and walk every key tile of the
sequence whatever the causal mask hides. On the H200 the ragged one took 82 of the 322 ms of a
512-token Llama-2-7B prompt, and 70 of 91 ms of a Qwen2.5-0.5B one (session 23's profile).

This kernel (one workgroup of 128 threads per 32 query rows of one query head):

- stages the tile's queries once, and each step 32 keys and values (from the chunk's rows or from
  the pages), as ``vec4<f16>`` rows in workgroup memory (the keys' rows padded by 8 bytes: the 16
  keys a warp reads fall in distinct banks);
- computes the 32 x 32 scores with each thread holding 4 rows x 2 keys (4-value dot products
  from ``vec4`` loads), scaled into the log2 domain and masked;
- keeps each row's running maximum and sum in one thread (the online softmax), and each
  thread's 4 rows x 8 (or 4) output dimensions in registers, rescaled once a step;
- stops at the last key tile the causal mask leaves visible to the tile's last row (half the
  tiles of a prompt), and writes ``output`` four dimensions a store and ``lse`` as TVM does.

It needs RoPE applied before attention (the KV cache's ``RopeMode.NORMAL``, as llmchat's decode
attention on WGSL): :func:`prefill_attention_pass` leaves a module with RoPE inside attention alone.
``LLMCHAT_WGSL_PREFILL_ATTENTION=tvm`` keeps TVM's kernels
(:func:`.gpu_choices.use_wgsl_prefill_attention`).
"""

from __future__ import annotations

import math
from typing import Any

from app.inference.pipelines.cuda_attention import (
    PAGED_PREFILL_ATTENTION,
    PAGED_PREFILL_PARAMS,
    PREFILL_ATTENTION,
    PREFILL_PARAMS,
)
from app.inference.pipelines.tir_facts import static_int

#: query rows and keys of a tile, threads of a workgroup
BQ = 32
BK = 32
THREADS = 128
LOG2E = math.log2(math.e)
#: the running maximum before any key, and a masked score (log2 domain)
NEG = -1e30
#: TVM's log-sum-exp of a row that saw no key
NO_KEY_LSE = -5e4


def shared_bytes(d: int) -> int:
    """Workgroup memory: queries, keys (rows padded by 4 halves), values, the scores (fp32) and
    their exponentials (fp16, as the CUDA kernel's tensor cores take them), one fp32 value a row."""
    return BQ * d * 2 + BK * (d + 4) * 2 + BK * d * 2 + BK * BQ * (4 + 2) + BQ * 4


def supported(h_qo: int, h_kv: int, d: int, dtype: str, max_shared: int) -> bool:
    """float16, head_dim 64 or 128 (16 threads of 4 dimensions per 64), whole query groups, and
    the tiles within the adapter's workgroup memory."""
    return dtype == "float16" and d in (64, 128) and h_qo % h_kv == 0 and shared_bytes(d) <= max_shared


def prefill_kernel(h_qo: int, h_kv: int, d: int, paged: bool = False, page: int = 16) -> Any:
    """The PrimFunc with the parameters of TVM's ``batch_prefill_ragged_kv`` or, with ``paged``,
    of its ``batch_prefill_paged_kv`` (keys and values in the KV cache's pages of ``page`` slots:
    ``[pages, 2, h_kv, page, d]``), in TVM's order."""
    from tvm.script import tirx as T

    group = h_qo // h_kv
    halves = d // 64  # 64-dimension halves a thread's output covers (4 dimensions each)
    qrow, krow = d, d + 4  # rows (halves) of the staged queries, and of the keys (padded)
    vec = d // 4  # vec4s a row
    loads = BQ * vec // THREADS  # vec4 loads a thread makes to stage one tile of rows

    # fmt: off
    @T.macro
    def attend(q, q_indptr, ksrc, vsrc, kv_a, kv_b, kv_c, output, lse, causal, sm_scale, batch_size, total_q):
        # ragged: kv_a is kv_indptr; paged: kv_a page_indptr, kv_b page_values, kv_c length_info
        bx = T.launch_thread("blockIdx.x", (total_q + (BQ - 1)) // BQ + batch_size)
        h = T.launch_thread("blockIdx.y", h_qo)
        tid = T.launch_thread("threadIdx.x", THREADS)
        qs = T.decl_buffer((BQ * qrow,), "float16", scope="shared")
        ks = T.decl_buffer((BK * krow,), "float16", scope="shared")
        vs = T.decl_buffer((BK * d,), "float16", scope="shared")
        ps = T.decl_buffer((BK * BQ,), "float32", scope="shared")  # scores [key][row]
        pp = T.decl_buffer((BK * BQ,), "float16", scope="shared")  # their exp2 (p) [key][row]
        alpha = T.decl_buffer((BQ,), "float32", scope="shared")  # a row's rescale, then 1 / sum
        info = T.decl_buffer((4,), "int32", scope="local")  # sequence, its tile, q start, q len
        kvi = T.decl_buffer((2,), "int32", scope="local")  # k start, kv len
        s = T.decl_buffer((8,), "float32", scope="local")
        o = T.decl_buffer((4 * 4 * halves,), "float32", scope="local")
        qv = T.decl_buffer((16,), "float16", scope="local")
        kv = T.decl_buffer((8,), "float16", scope="local")
        pv = T.decl_buffer((4,), "float32", scope="local")
        vv = T.decl_buffer((4 * halves,), "float16", scope="local")
        stat = T.decl_buffer((5,), "float32", scope="local")  # row thread: max, sum, new max, rescale, p
        rq = T.meta_var(tid // 16)  # rows 4 rq .. 4 rq + 3 of the tile
        kp = T.meta_var(tid % 16)  # keys kp and kp + 16 of a step; dimensions 4 kp (+ 64)
        kvh = T.meta_var(h // group)

        # this workgroup's (sequence, query tile): tiles of each sequence in turn
        info[0] = 0
        info[1] = bx
        while info[0] < batch_size and (
            info[1] >= (q_indptr[info[0] + 1] - q_indptr[info[0]] + (BQ - 1)) // BQ
        ):
            info[1] = info[1] - (q_indptr[info[0] + 1] - q_indptr[info[0]] + (BQ - 1)) // BQ
            info[0] = info[0] + 1
        # a workgroup past the last tile gets no rows and no keys (no branch around the barriers)
        info[2] = q_indptr[T.min(info[0], batch_size)]
        info[3] = T.if_then_else(info[0] < batch_size, q_indptr[info[0] + 1] - q_indptr[info[0]], 0)
        kvi[0] = kv_a[T.min(info[0], batch_size)]
        if paged:  # whole pages but the last, which holds length_info keys
            kvi[1] = T.if_then_else(
                info[0] < batch_size and kv_a[info[0] + 1] > kv_a[info[0]],
                (kv_a[info[0] + 1] - kv_a[info[0]] - 1) * page + kv_c[info[0]], 0)
        else:
            kvi[1] = T.if_then_else(info[0] < batch_size, kv_a[info[0] + 1] - kv_a[info[0]], 0)
        # the tile's queries (zeros past the sequence)
        for i in T.unroll(loads):
            if info[1] * BQ + (tid + i * THREADS) // vec < info[3]:
                qs[T.ramp(((tid + i * THREADS) // vec) * qrow + (tid + i * THREADS) % vec * 4, 1, 4)] = q[
                    info[2] + info[1] * BQ + (tid + i * THREADS) // vec, h,
                    T.ramp((tid + i * THREADS) % vec * 4, 1, 4)]
            else:
                qs[T.ramp(((tid + i * THREADS) // vec) * qrow + (tid + i * THREADS) % vec * 4, 1, 4)] = (
                    T.Broadcast(T.float16(0), 4))
        for i in T.unroll(4 * 4 * halves):
            o[i] = T.float32(0)
        if tid < BQ:
            stat[0] = T.float32(NEG)
            stat[1] = T.float32(0)
        # key tiles up to the last one the causal mask shows the tile's last row
        for kt in T.serial(
            (T.if_then_else(
                causal > 0,
                T.min(kvi[1], kvi[1] - info[3] + T.min(info[1] * BQ + BQ, info[3])),
                kvi[1]) + (BK - 1)) // BK
        ):
            T.tvm_storage_sync("shared")  # the last step is done with ks, vs and ps
            for i in T.unroll(loads):
                r = T.meta_var((tid + i * THREADS) // vec)  # the tile's key r, its 4 dimensions from c
                c = T.meta_var((tid + i * THREADS) % vec * 4)
                if kt * BK + r < kvi[1]:
                    if paged:  # key j: slot j % page of page page_values[page_indptr[b] + j // page]
                        pg = T.meta_var(kv_b[kvi[0] + (kt * BK + r) // page])
                        sl = T.meta_var((kt * BK + r) % page)
                        ks[T.ramp(r * krow + c, 1, 4)] = ksrc[pg, 0, kvh, sl, T.ramp(c, 1, 4)]
                        vs[T.ramp(r * d + c, 1, 4)] = vsrc[pg, 1, kvh, sl, T.ramp(c, 1, 4)]
                    else:
                        ks[T.ramp(r * krow + c, 1, 4)] = ksrc[kvi[0] + kt * BK + r, kvh, T.ramp(c, 1, 4)]
                        vs[T.ramp(r * d + c, 1, 4)] = vsrc[kvi[0] + kt * BK + r, kvh, T.ramp(c, 1, 4)]
                else:
                    ks[T.ramp(r * krow + c, 1, 4)] = T.Broadcast(T.float16(0), 4)
                    vs[T.ramp(r * d + c, 1, 4)] = T.Broadcast(T.float16(0), 4)
            T.tvm_storage_sync("shared")
            # scores of rows 4 rq + i and keys kp, kp + 16
            for e in T.unroll(8):
                s[e] = T.float32(0)
            for c4 in T.serial(vec):
                for i in T.unroll(4):
                    qv[T.ramp(i * 4, 1, 4)] = qs[T.ramp((rq * 4 + i) * qrow + c4 * 4, 1, 4)]
                for c in T.unroll(2):
                    kv[T.ramp(c * 4, 1, 4)] = ks[T.ramp((kp + c * 16) * krow + c4 * 4, 1, 4)]
                for i in T.unroll(4):
                    for c in T.unroll(2):
                        for e in T.unroll(4):
                            s[i * 2 + c] = s[i * 2 + c] + T.Cast("float32", qv[i * 4 + e]) * T.Cast(
                                "float32", kv[c * 4 + e])
            # scaled to the log2 domain, masked; stored [key][row]
            for c in T.unroll(2):
                for i in T.unroll(4):
                    ps[(kp + c * 16) * BQ + rq * 4 + i] = T.if_then_else(
                        kt * BK + kp + c * 16 < kvi[1]
                        and (causal == 0 or kt * BK + kp + c * 16
                             <= kvi[1] - info[3] + info[1] * BQ + rq * 4 + i),
                        s[i * 2 + c] * sm_scale * T.float32(LOG2E),
                        T.float32(NEG))
            T.tvm_storage_sync("shared")
            # the online softmax of row tid: new maximum, p, the sum; the rows' rescale
            if tid < BQ:
                stat[2] = stat[0]
                for j in T.unroll(BK):
                    stat[2] = T.max(stat[2], ps[j * BQ + tid])
                stat[3] = T.exp2(stat[0] - stat[2])
                stat[1] = stat[1] * stat[3]
                for j in T.unroll(BK):
                    stat[4] = T.if_then_else(ps[j * BQ + tid] > T.float32(NEG / 2),
                                             T.exp2(ps[j * BQ + tid] - stat[2]), T.float32(0))
                    pp[j * BQ + tid] = T.Cast("float16", stat[4])
                    stat[1] = stat[1] + stat[4]
                alpha[tid] = stat[3]
                stat[0] = stat[2]
            T.tvm_storage_sync("shared")
            # the outputs of rows 4 rq + i, dimensions 64 g + 4 kp + e: rescale, then p . v
            for i in T.unroll(4):
                for ge in T.unroll(4 * halves):
                    o[i * 4 * halves + ge] = o[i * 4 * halves + ge] * alpha[rq * 4 + i]
            for j in T.serial(BK):
                for i in T.unroll(4):
                    pv[i] = T.Cast("float32", pp[j * BQ + rq * 4 + i])
                for g in T.unroll(halves):
                    vv[T.ramp(g * 4, 1, 4)] = vs[T.ramp(j * d + g * 64 + kp * 4, 1, 4)]
                for i in T.unroll(4):
                    for ge in T.unroll(4 * halves):
                        o[i * 4 * halves + ge] = o[i * 4 * halves + ge] + pv[i] * T.Cast("float32", vv[ge])
        T.tvm_storage_sync("shared")
        # each row's lse (base 2, TVM's) and 1 / sum, then the outputs four dimensions a store
        if tid < BQ:
            if info[1] * BQ + tid < info[3]:
                lse[info[2] + info[1] * BQ + tid, h] = T.if_then_else(
                    stat[1] > T.float32(0), stat[0] + T.log2(stat[1]), T.float32(NO_KEY_LSE))
            alpha[tid] = T.if_then_else(stat[1] > T.float32(0), T.float32(1) / stat[1], T.float32(0))
        T.tvm_storage_sync("shared")
        for i in T.unroll(4):
            if info[1] * BQ + rq * 4 + i < info[3]:
                for g in T.unroll(halves):
                    for e in T.unroll(4):
                        pv[e] = o[i * 4 * halves + g * 4 + e] * alpha[rq * 4 + i]
                    output[info[2] + info[1] * BQ + rq * 4 + i, h, T.ramp(g * 64 + kp * 4, 1, 4)] = T.Cast(
                        "float16x4", pv[T.ramp(0, 1, 4)])

    if not paged:  # only the variant asked for is parsed (the macro branches on ``paged``)

        @T.prim_func(private=True)
        def ragged(
            var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle,
            var_kv_indptr: T.handle,
            var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle,
            var_lse: T.handle, causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
            rope_theta: T.float32, sm_scale: T.float32,
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            batch_size = T.int32()
            total_q = T.int32()
            total_kv = T.int32()
            q_indptr_elem_offset = T.int32()
            kv_indptr_elem_offset = T.int32()
            q_rope_position_elem_offset = T.int32()
            k_rope_pos_offset_elem_offset = T.int32()
            q = T.match_buffer(var_q, (total_q, h_qo, d), "float16")
            q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                      elem_offset=q_indptr_elem_offset)
            k = T.match_buffer(var_k, (total_kv, h_kv, d), "float16")
            v = T.match_buffer(var_v, (total_kv, h_kv, d), "float16")
            kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32",
                                       elem_offset=kv_indptr_elem_offset)
            # RoPE is applied before attention (RopeMode.NORMAL): positions unused (TVM's names kept)
            q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32",  # noqa: F841
                                             elem_offset=q_rope_position_elem_offset)
            k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                               elem_offset=k_rope_pos_offset_elem_offset)
            output = T.match_buffer(var_output, (total_q, h_qo, d), "float16")
            lse = T.match_buffer(var_lse, (total_q, h_qo), "float32")
            attend(q, q_indptr, k, v, kv_indptr, kv_indptr, kv_indptr, output, lse, causal, sm_scale,
                   batch_size, total_q)

        return ragged

    @T.prim_func(private=True)
    def paged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch_size = T.int32()
        total_q = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_q, h_qo, d), "float16")
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32",
                                  elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page, d), "float16")
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32",
                                     elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32",
                                     elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32",
                                     elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",  # noqa: F841
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_q,), "int32",  # noqa: F841
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_q, h_qo, d), "float16")
        lse = T.match_buffer(var_lse, (total_q, h_qo), "float32")
        attend(q, q_indptr, pages, pages, page_indptr, page_values, length_info, output, lse, causal,
               sm_scale, batch_size, total_q)

    # fmt: on
    return paged_kv


def prefill_attention(func: Any, max_shared: int) -> Any | None:
    """``func`` (TVM's ``batch_prefill_ragged_kv`` or ``batch_prefill_paged_kv``) as
    :func:`prefill_kernel`, or None for shapes it does not take (:func:`supported`; pages
    ``[pages, 2, kv heads, page, head dim]`` and one ``length_info`` value a sequence: no sliding
    window)."""
    params = [str(p) for p in func.params]
    if params == PREFILL_PARAMS:
        q, k = func.params[0], func.params[2]
        h_kv, d_k, page = static_int(k.shape[1]), static_int(k.shape[2]), None
    elif params == PAGED_PREFILL_PARAMS:
        q, pages, length_info = func.params[0], func.params[2], func.params[5]
        if len(pages.shape) != 5 or len(length_info.shape) != 1 or str(pages.dtype) != str(q.dtype):
            return None
        two, h_kv, page, d_k = (static_int(x) for x in pages.shape[1:])
        if two != 2 or page is None:
            return None
    else:
        return None
    h_qo, d = static_int(q.shape[1]), static_int(q.shape[2])
    if None in (h_qo, d, h_kv) or d_k != d or not supported(h_qo, h_kv, d, str(q.dtype), max_shared):
        return None
    from app.inference.pipelines.wgsl_attention import _with_attrs

    return _with_attrs(prefill_kernel(h_qo, h_kv, d, paged=page is not None, page=page or 16), func)


def prefill_attention_pass(shared_bytes_limit: int) -> Any:
    """Module pass: :func:`prefill_attention` on TVM's prompt attention PrimFuncs, in a module whose
    KV cache is created with ``RopeMode.NORMAL`` (else TVM's kernel stays: it applies RoPE itself
    when ``rotary_mode`` is 1)."""
    import tvm

    from app.inference.pipelines.cuda_kernels import prim_func_pass
    from app.inference.pipelines.cuda_rope_append import _rope_mode_normal

    def rewrite(func: Any) -> Any | None:
        symbol = "" if func.attrs is None else str(func.attrs.get("global_symbol", ""))
        if symbol not in (PREFILL_ATTENTION, PAGED_PREFILL_ATTENTION):
            return None
        return prefill_attention(func, shared_bytes_limit)

    replace = prim_func_pass("llmchat_wgsl_prefill_attention_funcs", rewrite)

    @tvm.transform.module_pass(opt_level=0, name="llmchat_wgsl_prefill_attention")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return replace(mod) if _rope_mode_normal(mod) else mod

    return _pass
